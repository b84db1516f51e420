"""Real wheels made at test time, written by hand (a wheel is a zip with METADATA, WHEEL and
RECORD in its .dist-info): a wheelhouse that pip installs from with --no-index, no index and no
build backend needed."""

import base64
import hashlib
import zipfile
from pathlib import Path

# A console script that stands in for an engine: it serves /health, and /prefix answers the
# sys.prefix it runs under (the environment it was started from).
PROBE_MODULE = '''\
import http.server
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"ok", "/prefix": sys.prefix.encode()}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def main():
    print("probe engine up from", sys.prefix, flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory, name, version, files, console_scripts=None):
    """Write NAME-VERSION-py3-none-any.whl into directory: files {path in the wheel: bytes or
    text}, console_scripts {command: "module:function"}. Returns its path."""
    dist = name.replace("-", "_")
    info = "%s-%s.dist-info" % (dist, version)
    members = {path: data.encode() if isinstance(data, str) else data for path, data in files.items()}
    members[info + "/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)).encode()
    members[info + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: llmgw-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if console_scripts:
        lines = "".join("%s = %s\n" % item for item in console_scripts.items())
        members[info + "/entry_points.txt"] = ("[console_scripts]\n" + lines).encode()
    record = "".join("%s,%s,%d\n" % (path, _record_hash(data), len(data)) for path, data in members.items())
    members[info + "/RECORD"] = (record + info + "/RECORD,,\n").encode()
    path = Path(directory) / ("%s-%s-py3-none-any.whl" % (dist, version))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for member, data in members.items():
            wheel.writestr(member, data)
    return path


def probe_wheelhouse(directory, extra_bytes=0):
    """A wheelhouse holding llmgw-probe 1.0 (console script llmgw-probe), with extra_bytes of
    incompressible data in the package when asked (to fill a small disk)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {"llmgw_probe/__init__.py": PROBE_MODULE}
    if extra_bytes:
        files["llmgw_probe/ballast.bin"] = hashlib.shake_256(b"ballast").digest(extra_bytes)
    make_wheel(directory, "llmgw-probe", "1.0", files, {"llmgw-probe": "llmgw_probe:main"})
    return directory
