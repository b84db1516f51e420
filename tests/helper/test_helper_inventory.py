"""inventory through a real helper, with a stand-in nvidia-smi on PATH (R-2.1-R-2.3)."""

import os
import sys

import pytest

from tests.helper.client import wait_until

FAKE_NVIDIA_SMI = """\
#!{python}
import os, sys
directory = os.environ["FAKE_SMI_DIR"]
kind = "gpus" if any(a.startswith("--query-gpu=") for a in sys.argv) else "apps"
with open(os.path.join(directory, kind + ".argv"), "w") as handle:
    handle.write("\\n".join(sys.argv[1:]))
with open(os.path.join(directory, kind + ".out")) as handle:
    text = handle.read()
code = int(open(os.path.join(directory, kind + ".code")).read()) if os.path.exists(os.path.join(directory, kind + ".code")) else 0
(sys.stderr if code else sys.stdout).write(text)
sys.exit(code)
"""


@pytest.fixture
def fake_smi(tmp_path, base_env):
    """A directory whose files say what the stand-in nvidia-smi prints; returns (dir, env)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(FAKE_NVIDIA_SMI.format(python=sys.executable))
    script.chmod(0o755)
    data = tmp_path / "smi"
    data.mkdir()
    (data / "gpus.out").write_text("")
    (data / "apps.out").write_text("")
    env = dict(base_env)
    env["PATH"] = "%s:%s" % (bin_dir, base_env.get("PATH", "/usr/bin:/bin"))
    env["FAKE_SMI_DIR"] = str(data)
    return data, env


def _meminfo_total():
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def test_no_nvidia_smi_means_no_gpus_not_an_error(start_helper, base_env, tmp_path):
    env = dict(base_env)
    env["PATH"] = str(tmp_path / "empty-bin")
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "absent"
    assert result["nvidia_smi_error"] is None
    assert result["gpus"] == []
    assert result["memory_bytes"] == _meminfo_total()
    assert result["cpus"] == len(os.sched_getaffinity(0))
    with open("/proc/sys/kernel/random/boot_id") as handle:
        assert result["boot_id"] == handle.read().strip()


def test_gpus_are_read_with_the_documented_query(start_helper, fake_smi):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 0, 0, 0\n1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559, 10, 3, 4\n"
    )
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "ok" and result["nvidia_smi_error"] is None
    assert [g["index"] for g in result["gpus"]] == [0, 1]
    assert result["gpus"][0]["healthy"] is True
    assert result["gpus"][1]["healthy"] is False
    assert result["gpus"][1]["reasons"] == ["4 uncorrected ECC errors (volatile)"]
    assert (data / "gpus.argv").read_text().splitlines() == [
        "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,ecc.errors.uncorrected.volatile.total",
        "--format=csv,noheader,nounits",
    ]
    assert (data / "apps.argv").read_text().splitlines() == [
        "--query-compute-apps=gpu_uuid,pid,used_memory",
        "--format=csv,noheader,nounits",
    ]


def test_a_failing_nvidia_smi_is_an_error_with_its_message(start_helper, fake_smi):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n\n"
    )
    (data / "gpus.code").write_text("9")
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "error"
    assert "status 9" in result["nvidia_smi_error"]
    assert "couldn't communicate with the NVIDIA driver" in result["nvidia_smi_error"]
    assert result["gpus"] == []


def test_a_lost_gpu_message_among_rows_is_reported(start_helper, fake_smi):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, 81920, 0, 0, 0\n"
        "Unable to determine the device handle for GPU 0000:2A:00.0: GPU is lost. Reboot the system to recover this GPU\n"
    )
    result = start_helper(env=env).call("inventory")
    assert result["nvidia_smi"] == "error"
    assert "GPU is lost" in result["nvidia_smi_error"]
    assert len(result["gpus"]) == 1


def test_memory_held_by_a_process_llmgw_did_not_start(start_helper, fake_smi, engines):
    data, env = fake_smi
    (data / "gpus.out").write_text(
        "0, GPU-ours, NVIDIA L40S, 46068, 30000, 50, 0\n"
        "1, GPU-theirs, NVIDIA L40S, 46068, 512, 0, 0\n"
        "2, GPU-free, NVIDIA L40S, 46068, 0, 0, 0\n"
    )
    helper = start_helper(env=env)
    engine = helper.call("launch", {"shard_id": "mine", "argv": engines.argv("sleep_engine.py"), "gpus": [0]})
    wait_until(lambda: helper.call("status")["shards"][0]["alive"], message="engine alive")
    (data / "apps.out").write_text(
        "GPU-ours, %d, 30000\nGPU-theirs, %d, 512\n" % (engine["pid"], os.getpid())
    )
    gpus = helper.call("inventory")["gpus"]
    assert gpus[0]["healthy"] is True, gpus[0]["reasons"]
    assert gpus[1]["healthy"] is False
    assert gpus[1]["reasons"] == ["512 MiB held by pid %d (not started by llmgw)" % os.getpid()]
    assert gpus[2]["healthy"] is True


def test_inventory_does_not_block_ping(start_helper, fake_smi):
    data, env = fake_smi
    helper = start_helper(env=env)
    pending = helper.send("inventory")
    assert helper.request("ping")["ok"]
    assert helper.answer(pending)["ok"]


def test_one_shot_inventory_shows_unknown_as_dash(fake_smi, tmp_path):
    import subprocess

    from tests.helper.client import HELPER_PATH

    data, env = fake_smi
    (data / "gpus.out").write_text("0, GPU-x, NVIDIA H100 80GB HBM3, 81559, 59, [N/A], [N/A]\n")
    result = subprocess.run(
        [sys.executable, str(HELPER_PATH), "inventory", "--root", str(tmp_path)], env=env, capture_output=True, timeout=60
    )
    text = result.stdout.decode()
    row = next(line for line in text.splitlines() if "H100" in line)
    assert "59 / 81559 MiB" in row
    assert row.split()[-3:] == ["-", "-", "ok"]


# -- what the node can run engines from (R-4.12) -------------------------------------------------

FAKE_CONTAINER_PROGRAM = """\
#!{python}
import os, sys, time
directory = os.environ["FAKE_CONTAINER_DIR"]
name = os.path.basename(sys.argv[0])
with open(os.path.join(directory, name + ".calls"), "a") as handle:
    handle.write(" ".join(sys.argv[1:]) + "\\n")
hang = os.path.join(directory, "hang")
deadline = time.time() + 120
while os.path.exists(hang) and time.time() < deadline:
    time.sleep(0.05)
def said(kind, default=""):
    path = os.path.join(directory, name + "." + kind)
    return open(path).read() if os.path.exists(path) else default
if sys.argv[1:2] == ["info"]:
    code = int(said("info-code", "0"))
    (sys.stderr if code else sys.stdout).write(said("info"))
    sys.exit(code)
if sys.argv[1:3] == ["image", "inspect"]:
    image = sys.argv[-1]
    if image in said("images").split():
        print("sha256:" + "ab" * 32)
        sys.exit(0)
    sys.stderr.write("Error: No such image: %s\\n" % image)
    sys.exit(1)
sys.exit(2)
"""

NO_DAEMON = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?\n"


@pytest.fixture
def fake_containers(tmp_path, base_env):
    """A PATH of only stand-in programs: `add("docker")` puts a docker there whose answers the
    files in the returned directory give; returns (dir, env, add)."""
    bin_dir = tmp_path / "container-bin"
    bin_dir.mkdir()
    data = tmp_path / "container-data"
    data.mkdir()
    env = dict(base_env)
    env["PATH"] = str(bin_dir)
    env["FAKE_CONTAINER_DIR"] = str(data)

    def add(name, text=FAKE_CONTAINER_PROGRAM):
        script = bin_dir / name
        script.write_text(text.format(python=sys.executable))
        script.chmod(0o755)
        return str(script)

    yield data, env, add
    (data / "hang").unlink(missing_ok=True)  # a stand-in still waiting ends


def _calls(data, name):
    path = data / (name + ".calls")
    return path.read_text().splitlines() if path.exists() else []


def test_no_container_program_and_the_helpers_own_python(start_helper, base_env, tmp_path):
    import platform

    env = dict(base_env)
    env["PATH"] = str(tmp_path / "empty-bin")
    result = start_helper(env=env).call("inventory")
    unknown = {"answers": None, "error": None, "runtimes": None, "gpu": None, "images": None}
    assert result["containers"] == {"docker": dict(unknown, path=None), "podman": dict(unknown, path=None)}
    assert result["python"] == {"path": sys.executable, "version": platform.python_version()}
    assert result["venvs"] == {}


def test_a_docker_whose_daemon_answers_reports_runtimes_gpus_and_images(start_helper, fake_containers):
    data, env, add = fake_containers
    path = add("docker")
    (data / "docker.info").write_text('{"io.containerd.runc.v2":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"},'
                                      '"runc":{"path":"runc"}}\n')
    (data / "docker.images").write_text("vllm/vllm-openai:v1\n")
    result = start_helper(env=env).call("inventory", {"images": ["vllm/vllm-openai:v1", "absent/image:2"]})
    assert result["containers"]["docker"] == {
        "path": path, "answers": True, "error": None, "runtimes": ["io.containerd.runc.v2", "nvidia", "runc"],
        "gpu": True, "images": {"vllm/vllm-openai:v1": True, "absent/image:2": False}}
    assert result["containers"]["podman"]["path"] is None
    assert _calls(data, "docker") == ["info --format {{json .Runtimes}}",
                                      "image inspect --format {{.Id}} absent/image:2",
                                      "image inspect --format {{.Id}} vllm/vllm-openai:v1"]


@pytest.mark.parametrize("hook,gpu", [(False, False), (True, True)], ids=["no-nvidia", "nvidia-hook-on-path"])
def test_docker_gives_gpus_with_the_nvidia_runtime_or_its_hook(start_helper, fake_containers, hook, gpu):
    data, env, add = fake_containers
    add("docker")
    if hook:
        add("nvidia-container-runtime-hook", "#!/bin/sh\nexit 0\n")
    (data / "docker.info").write_text('{"runc":{"path":"runc"}}\n')
    docker = start_helper(env=env).call("inventory")["containers"]["docker"]
    assert docker["answers"] is True and docker["runtimes"] == ["runc"]
    assert docker["gpu"] is gpu
    assert docker["images"] == {}


def test_a_docker_that_cannot_reach_its_daemon_says_so_and_checks_nothing_else(start_helper, fake_containers):
    data, env, add = fake_containers
    add("docker")
    (data / "docker.info").write_text(NO_DAEMON)
    (data / "docker.info-code").write_text("1")
    docker = start_helper(env=env).call("inventory", {"images": ["vllm/vllm-openai:v1"]})["containers"]["docker"]
    assert docker["answers"] is False
    assert docker["error"].startswith("docker cannot reach its daemon")
    assert "Is the docker daemon running?" in docker["error"]
    assert docker["gpu"] is None and docker["images"] is None and docker["runtimes"] is None
    assert _calls(data, "docker") == ["info --format {{json .Runtimes}}"]


def test_a_hanging_docker_is_unknown_and_asked_again_only_once_it_answered(start_helper, fake_containers):
    data, env, add = fake_containers
    add("docker")
    (data / "docker.info").write_text('{"runc":{}}\n')
    (data / "hang").write_text("")
    helper = start_helper(env=env)
    for _ in range(2):
        docker = helper.call("inventory")["containers"]["docker"]
        assert docker["answers"] is None, docker  # unknown, never "absent"
        assert docker["gpu"] is None and docker["images"] is None
        assert docker["error"].startswith("docker info has not answered for")
    # The second inventory did not start another probe: the first one still waits.
    assert _calls(data, "docker") == ["info --format {{json .Runtimes}}"]
    (data / "hang").unlink()
    docker = wait_until(lambda: (d := helper.call("inventory")["containers"]["docker"])["answers"] is True and d,
                        message="docker answering once it no longer hangs")
    assert docker["runtimes"] == ["runc"] and docker["error"] is None


def test_podman_answers_without_a_daemon_and_takes_gpus_from_cdi(start_helper, fake_containers):
    from tests.helper.client import load_helper

    data, env, add = fake_containers
    path = add("podman")
    (data / "podman.info").write_text('"crun"\n')
    podman = start_helper(env=env).call("inventory")["containers"]["podman"]
    assert podman["path"] == path and podman["answers"] is True and podman["error"] is None
    assert podman["runtimes"] is None  # docker's daemon field only
    assert podman["gpu"] is load_helper().cdi_nvidia_gpu()  # this machine's /etc/cdi, /var/run/cdi
    assert _calls(data, "podman") == ["info --format {{json .Host.OCIRuntime.Name}}"]


def test_the_real_docker_cli_without_its_daemon(start_helper, base_env, tmp_path):
    import shutil

    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker program on PATH")
    env = dict(base_env)
    env["DOCKER_HOST"] = "unix://%s" % (tmp_path / "no-daemon.sock")
    found = start_helper(env=env).call("inventory", {"images": ["busybox:1"]})["containers"]["docker"]
    assert found["path"] == docker and found["answers"] is False, found
    assert found["error"].startswith("docker cannot reach its daemon (DOCKER_HOST=unix://%s)" % (tmp_path / "no-daemon.sock"))
    assert found["images"] is None and found["gpu"] is None


def test_venv_interpreters_are_found_or_named(start_helper, base_env, tmp_path):
    import platform

    helper = start_helper(env=base_env)
    base = {"kind": "venv", "packages": ["llmgw-probe"], "find_links": [str(tmp_path)]}
    result = helper.call("inventory", {"venvs": {"own": dict(base), "absent": dict(base, python="python3.0-absent"),
                                                 "path": dict(base, python=sys.executable)}})
    own, absent, by_path = result["venvs"]["own"], result["venvs"]["absent"], result["venvs"]["path"]
    assert own["found"] is True and own["python"] is None and own["error"] is None
    assert own["interpreter"] == os.path.realpath(sys.executable) and own["version"] == platform.python_version()
    assert own["built"] is False and len(own["id"]) == 64
    assert by_path["found"] is True and by_path["version"] == platform.python_version()
    assert by_path["id"] == own["id"]  # the same interpreter and recipe: the same environment
    assert absent["found"] is False and absent["interpreter"] is None and absent["built"] is None
    assert "python3.0-absent" in absent["error"] and "is not on PATH" in absent["error"]


@pytest.mark.parametrize("args,fragment", [
    ({"images": "vllm/vllm-openai"}, "argument 'images' must be list"),
    ({"images": ["Not An Image!"]}, "is not an image reference"),
    ({"venvs": {"k": {"kind": "container", "image": "x"}}}, "venvs['k'] must be a venv runtime"),
    ({"venvs": {"k": {"kind": "venv", "packages": []}}}, "runtime.packages must list at least one"),
])
def test_bad_inventory_arguments_are_refused(helper, args, fragment):
    answer = helper.request("inventory", args)
    assert answer["ok"] is False and answer["error"]["kind"] == "bad_args", answer
    assert fragment in answer["error"]["message"]
