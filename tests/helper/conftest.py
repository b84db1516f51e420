"""Fixtures for tests that run the node helper as a real subprocess."""

import collections
import http.server
import os
import shutil
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest

from tests.helper.client import HelperClient, install_helper, kill_recorded_engines

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


@pytest.fixture
def node_root(tmp_path):
    """The helper's --root; every engine recorded there is killed at teardown."""
    root = tmp_path / "llmgw"
    root.mkdir()
    yield root
    kill_recorded_engines(root)


# The fleet secret the control plane would have handed over, kept where the helper keeps it.
FLEET_SECRET = "5ec0" * 16


@pytest.fixture
def installed(node_root):
    path, sha = install_helper(node_root)
    keep_fleet_secret(node_root, FLEET_SECRET)
    return SimpleNamespace(root=node_root, path=path, sha=sha, secret=FLEET_SECRET)


def keep_fleet_secret(root, secret):
    fd = os.open(os.path.join(str(root), "fleet.key"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")


@pytest.fixture
def base_env():
    env = dict(os.environ)
    for name in PROXY_VARIABLES:
        env.pop(name, None)
    return env


@pytest.fixture
def start_helper(installed, base_env):
    """Start helper processes (each waits for its hello); all are killed at teardown."""
    clients = []

    def start(env=None):
        client = HelperClient(installed.path, installed.sha, installed.root, env=env or base_env)
        clients.append(client)
        client.wait_hello()
        return client

    yield start
    for client in clients:
        client.kill()


@pytest.fixture
def helper(start_helper):
    return start_helper()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ENGINE_SCRIPTS = {
    "sleep_engine.py": """
        import sys, time
        print("engine up", flush=True)
        while True:
            time.sleep(3600)
    """,
    "listen_engine.py": """
        import http.server, sys
        port = int(sys.argv[1])

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        server = http.server.HTTPServer(("0.0.0.0", port), Health)
        print("engine listening on", port, flush=True)
        server.serve_forever()
    """,
    "hang_engine.py": """
        import socket, sys, time
        sock = socket.socket()
        sock.bind(("127.0.0.1", int(sys.argv[1])))
        sock.listen(16)
        print("bound, never answering", flush=True)
        while True:
            time.sleep(3600)
    """,
    "exit_engine.py": """
        import sys
        print("loading model", flush=True)
        print("fatal: CUDA out of memory", flush=True)
        sys.exit(int(sys.argv[1]))
    """,
    "family_engine.py": """
        import os, subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(3600)"])
        with open(sys.argv[1] + ".tmp", "w") as handle:
            handle.write(str(worker.pid))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        print("engine with worker", worker.pid, flush=True)
        while True:
            time.sleep(3600)
    """,
}


@pytest.fixture
def engines(tmp_path):
    """Small engine stand-ins, as argv builders: engines.argv("sleep_engine.py", args...)."""
    directory = tmp_path / "engines"
    directory.mkdir()
    for name, text in ENGINE_SCRIPTS.items():
        (directory / name).write_text(textwrap.dedent(text))

    def argv(name, *args):
        return [sys.executable, str(directory / name)] + [str(a) for a in args]

    return SimpleNamespace(dir=directory, argv=argv)


# --------------------------------------------------------------------------------------------
# A local HTTPS file server


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return SimpleNamespace(cert=cert, key=key)


class Route:
    def __init__(self, body=b"", length=True, status=200, gate=None, redirect=None, stall_after=None):
        self.body = body
        self.length = length
        self.status = status
        self.gate = gate
        self.redirect = redirect
        self.stall_after = stall_after  # bytes of the body sent before waiting for stall_gate
        self.stall_gate = threading.Event()


class _FileHandler(http.server.BaseHTTPRequestHandler):
    # HTTP/1.0: without a Content-Length the end of the body is the end of the connection.
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        self._serve(head=False)

    def do_HEAD(self):
        self._serve(head=True)

    def _serve(self, head):
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        with owner.lock:
            owner.hits[(self.command, path)] += 1
            owner.auth.setdefault(path, []).append(self.headers.get("Authorization"))
        route = owner.routes.get(path)
        if route is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if route.gate is not None and not head and route.stall_after is None:
            route.gate.wait(30)
        if route.redirect is not None:
            self.send_response(302)
            self.send_header("Location", route.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(route.status)
        if route.length:
            self.send_header("Content-Length", str(len(route.body)))
        self.end_headers()
        if head:
            return
        try:
            if route.stall_after is not None:
                self.wfile.write(route.body[: route.stall_after])
                self.wfile.flush()
                route.stall_gate.wait(30)
                return
            for start in range(0, len(route.body), 65536):
                self.wfile.write(route.body[start : start + 65536])
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass

    def log_message(self, *args):
        pass


class FileServer:
    """HTTPS server on 127.0.0.1 serving routes; counts hits and Authorization headers."""

    def __init__(self, cert, key):
        self.routes = {}
        self.hits = collections.Counter()
        self.auth = {}
        self.lock = threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FileHandler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path, host="127.0.0.1"):
        return "https://%s:%d%s" % (host, self.port, path)

    def gets(self, path):
        with self.lock:
            return self.hits[("GET", path)]

    def close(self):
        for route in self.routes.values():
            route.stall_gate.set()
            if route.gate is not None:
                route.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def https_server(tls_cert):
    server = FileServer(tls_cert.cert, tls_cert.key)
    yield server
    server.close()


@pytest.fixture
def tls_env(base_env, tls_cert):
    """Environment for a helper that trusts the local server's certificate."""
    env = dict(base_env)
    env["SSL_CERT_FILE"] = str(tls_cert.cert)
    return env


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "llmgw-test", str(mount_point)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: %s" % result.stderr.decode(errors="replace").strip())
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
