"""A real engine launched as llmgw launches it: the built-in template rendered, then the node
helper's launch op (a real subprocess), readiness from the helper's probe.

The engines and their tiny models come from tests/testbed/engines.py (built by scripts/engines;
without them the tests skip and say why, and under CI they fail).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw.engines import BUILTIN_ENGINES, ShardVars
from tests.helper.client import HelperClient, install_helper, kill_recorded_engines
from tests.testbed import engines as real


def bin_dir(engine: str) -> Path:
    real.require(engine)
    return real.EXECUTABLES[engine].parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Launched:
    helper: HelperClient
    shard_id: str
    port: int
    key: str
    argv: list[str]
    log_path: Path

    def request(self, method: str, path: str, body: dict | None = None, key: str | None = None,
                timeout: float = 60) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def launch_engine(root: Path, engine: str, bin_dir: Path, model: str, *, args=(), env=None,
                  shard_id: str = "real-0", start_timeout: float = 300) -> Launched:
    """Render the built-in template and start it through the helper; return once /health is 200."""
    path, sha = install_helper(root)
    helper_env = dict(os.environ)
    helper_env["PATH"] = f"{bin_dir}:{helper_env.get('PATH', '/usr/bin:/bin')}"
    helper = HelperClient(path, sha, root, env=helper_env)
    helper.wait_hello()
    try:
        return _launch_and_wait(helper, root, engine, model, list(args), dict(env or {}), shard_id, start_timeout)
    except OSError as exc:  # the helper went away
        helper.kill()
        kill_recorded_engines(root)
        raise AssertionError(f"the helper ended ({helper.proc.returncode}): {''.join(helper.stderr_lines)[-3000:]}") from exc
    except BaseException:
        helper.kill()
        kill_recorded_engines(root)
        raise


def _launch_and_wait(helper, root, engine, model, args, env, shard_id, start_timeout) -> Launched:
    port = free_port()
    key = "llmgw-engine-" + os.urandom(16).hex()
    variables = ShardVars(model=model, name="tiny", host="127.0.0.1", port=port, gpus_per_node=0, nnodes=1,
                          node_rank=0, leader_addr="127.0.0.1", leader_port=0, python=sys.executable)
    spec = BUILTIN_ENGINES[engine].render(variables, args, env, key)
    result = helper.call("launch", {
        "shard_id": shard_id, "argv": spec.argv, "env": spec.env, "files": spec.files,
        "file_sha256": spec.file_sha256, "port": port, "host": "127.0.0.1",
        "health_url": f"http://127.0.0.1:{port}{spec.health_path}", "gpus": []}, timeout=120)
    launched = Launched(helper, shard_id, port, key, result["argv"], Path(result["log_path"]))
    deadline = time.monotonic() + start_timeout
    while True:
        shard = next(s for s in helper.call("status", {"probe": True, "timeout": 2})["shards"]
                     if s["shard_id"] == shard_id)
        if shard["alive"] and shard["health"] and shard["health"]["status"] == 200:
            return launched
        gone = not shard["alive"]
        if gone and shard.get("exit_code") is None and time.monotonic() <= deadline:
            time.sleep(0.2)  # the helper records an engine's exit status just after it is gone
            continue
        if gone or time.monotonic() > deadline:
            raise AssertionError(f"{engine} did not become healthy: {shard}\n{launched.log()[-4000:]}")
        time.sleep(0.5)


def stop_engine(launched: Launched, root: Path) -> None:
    try:
        launched.helper.call("stop", {"shard_id": launched.shard_id, "grace": 15}, timeout=60)
    finally:
        launched.helper.kill()
        kill_recorded_engines(root)


# --- an engine port without the key (R-4.6) ---------------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# Served by engines outside their route lists, or named by ENGINES.md as open on some engine.
EXTRA_ROUTES = [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                ("GET", "/slots"), ("GET", "/props"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
                ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/llmgw-no-such-path")]
REFUSED = {401, 403, 404}  # what an engine port without the key may answer


def concrete(path: str) -> str:
    """A route template with its parameters filled in: /v1/models/{model} -> /v1/models/x."""
    return re.sub(r"\{[^}]+\}", "x", path)


def probe_all(engine, routes, open_routes):
    """Every route without the key (and with a wrong one): status per route, and what was served."""
    served = []
    seen = []
    for method, path in sorted(set(routes)):
        url = concrete(path)
        body = CHAT if method in ("POST", "PUT", "PATCH") else None
        for key in (None, "not-the-key"):
            status, data = engine.request(method, url, body=body, key=key)
            seen.append((method, url, key is not None, status))
            if (method, url) in open_routes:
                continue
            if status not in REFUSED:
                served.append((method, url, "wrong key" if key else "no key", status, data[:120]))
    return seen, served
