"""`llmgw serve` and its router workers as processes of their own (R-10.4, R-9.1).

serve spawns the router supervisor detached; the workers go on serving when serve is killed;
the next serve on the state directory adopts them instead of starting others or failing on the
port, and applies the worker count it is given. These run the embedded default (this machine as
its one local node): what is looked at is the process tree, not a fleet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from llmgw.router.supervisor import running_supervisor
from tests.integration.gateway import GatewayProcess, free_port, wait_for


def models(gateway: GatewayProcess, key: str) -> int:
    request = urllib.request.Request(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        json.loads(response.read())
        return response.status


def test_serve_spawns_its_router_which_outlives_a_kill_and_is_adopted(tmp_path):
    first = GatewayProcess(None, tmp_path / "state", workers=1).start()
    second = None
    try:
        supervisor = running_supervisor(first.router_dir)
        assert supervisor is not None and supervisor != first.proc.pid
        assert os.getsid(supervisor) == supervisor  # a session of its own: a signal to serve's group misses it
        [worker] = [w["pid"] for w in first.router_status()["workers"]]
        assert f"router supervisor started: pid {supervisor}" in first.log()
        key = first.create_key("outlives")
        wait_for(lambda: models(first, key) == 200, 30, "the new key to reach the router")

        first.kill()  # SIGKILL: the control plane is gone, the router is not
        assert running_supervisor(first.router_dir) == supervisor
        assert models(first, key) == 200  # served with the last snapshot

        second = GatewayProcess(None, first.state_dir, workers=2)
        second.port, second.admin_port = first.port, first.admin_port
        second.start()
        output = second.log()
        print(output[-3000:])
        assert f"adopting the running router supervisor: pid {supervisor}" in output
        assert "cannot listen" not in output
        assert running_supervisor(first.router_dir) == supervisor  # no second supervisor
        wait_for(lambda: len(second.router_status()["workers"]) == 2 and all(
            w["pid"] for w in second.router_status()["workers"]), 60, "the adopted router to run 2 workers")
        pids = [w["pid"] for w in second.router_status()["workers"]]
        assert worker in pids  # the running worker was kept, one was added
        assert models(second, key) == 200
        # The adopted router is still fed by the new serve, with the credential serve gave it.
        later = second.create_key("after-adoption")
        wait_for(lambda: models(second, later) == 200, 30, "a key made after the restart to reach the router")
    finally:
        first.kill()
        if second is not None:
            second.stop()
        first.stop_router()


def ctl(gateway: GatewayProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(gateway.state_dir), *args],
                          capture_output=True, text=True, env=gateway.env, timeout=60)


def feed_state(url: str, key: str) -> str | None:
    """The router's feed state as /healthz shows it to a request with a valid key (R-10.2)."""
    request = urllib.request.Request(url + "/healthz", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            document = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        document = json.loads(exc.read())
    except OSError:
        return None
    return (document.get("feed") or {}).get("state")


def test_r10_7_a_second_router_runs_on_a_credential_of_its_own_until_it_is_revoked(tmp_path):
    """The serve-spawned router needs no step (its credential is serve's doing); another router is
    given one by `ctl routers add`, is fed over the admin listener with it, and is cut off by
    `ctl routers revoke` while serve's own router goes on."""
    gateway = GatewayProcess(None, tmp_path / "state", workers=1).start()
    edge = None
    try:
        credential_file = gateway.router_dir / "credential"
        assert credential_file.stat().st_mode & 0o777 == 0o600
        assert credential_file.read_text().startswith("llmgw-router.local.")
        argv_of = [open(f"/proc/{pid}/cmdline", "rb").read() for pid in
                   [w["pid"] for w in gateway.router_status()["workers"]]]
        secret = credential_file.read_text().strip().encode()
        assert all(secret not in argv for argv in argv_of)

        added = ctl(gateway, "routers", "add", "edge1")
        assert added.returncode == 0, added.stderr
        credential = added.stdout.strip()
        assert credential.startswith("llmgw-router.edge1.") and "only time" in added.stderr
        assert ctl(gateway, "routers", "add", "edge1").returncode == 1  # it has one already
        path = tmp_path / "edge1.credential"
        path.write_text(credential + "\n")
        path.chmod(0o600)

        port = free_port()
        argv = [sys.executable, "-m", "llmgw.cli.main", "router", "--control", f"http://127.0.0.1:{gateway.admin_port}",
                "--credential-file", str(path), "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "edge")]
        # The admin token is no router credential: refused at the start, naming what to do.
        (tmp_path / "token-copy").write_text((gateway.state_dir / "admin-token").read_text())
        refused = subprocess.run([*argv[:argv.index("--credential-file") + 1], str(tmp_path / "token-copy"),
                                  *argv[argv.index("--credential-file") + 2:]],
                                 capture_output=True, text=True, env=gateway.env, timeout=60)
        assert refused.returncode == 1 and "routers add" in refused.stderr
        edge = subprocess.Popen(argv, stdout=open(tmp_path / "edge.log", "ab"), stderr=subprocess.STDOUT,
                                env=gateway.env)
        url = f"http://127.0.0.1:{port}"
        key = gateway.create_key("edge-user")
        wait_for(lambda: models(_At(url), key) == 200, 60, "the edge router fed over the admin listener, with the key")
        assert feed_state(url, key) == "live"
        listed = json.loads(ctl(gateway, "routers", "list", "--json").stdout)
        assert {r["name"]: r["state"] for r in listed["routers"]} == {"local": "active", "edge1": "active"}
        assert credential not in json.dumps(listed)
        wait_for(lambda: any(r["router"].startswith("edge1/") for r in gateway.admin("/api/status")[1]["routers"]),
                 30, "the edge router's reports, under its name")

        revoked = ctl(gateway, "routers", "revoke", "edge1")
        assert revoked.returncode == 0 and "revoked" in revoked.stdout
        wait_for(lambda: feed_state(url, key) == "last-known-good", 30, "the revoked router cut off")
        later = gateway.create_key("after-revoke")
        wait_for(lambda: models(gateway, later) == 200, 30, "serve's own router still fed")
        assert feed_state(url, key) == "last-known-good"
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(30)
        gateway.stop()


# A fault for one test only, put in the edge router's processes by the sitecustomize module
# Python imports at start: the first Change carrying keys makes Router.apply raise, its message
# holding text that must never leave the router.
FAULT_HOOK = """
import os

if os.environ.get("LLMGW_TEST_FAIL_A_KEYS_CHANGE"):
    from llmgw.contracts.feed import Change
    from llmgw.router.feedstate import FeedState

    _apply = FeedState.apply
    _failed = []

    def apply(self, message):
        if isinstance(message, Change) and message.keys is not None and not _failed:
            _failed.append(message.version)
            raise RuntimeError("sk-llmgw-never-sent: a fault of this router")
        _apply(self, message)

    FeedState.apply = apply
"""


def test_r10_10_a_change_a_router_cannot_apply_is_named_in_ctl_status(tmp_path):
    """A router that cannot apply a Change says which and why in its reports (xDS's NACK), takes
    the whole snapshot again, and `ctl status` shows, per router, the version it routes with and
    the last one it could not apply, with the reason in the router's words (none of the fault's text)."""
    gateway = GatewayProcess(None, tmp_path / "state", workers=0).start()
    edge = None
    try:
        added = ctl(gateway, "routers", "add", "edge1")
        assert added.returncode == 0, added.stderr
        path = tmp_path / "edge1.credential"
        path.write_text(added.stdout.strip() + "\n")
        path.chmod(0o600)
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(FAULT_HOOK)
        env = {**gateway.env, "LLMGW_TEST_FAIL_A_KEYS_CHANGE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), gateway.env.get("PYTHONPATH")]))}
        port = free_port()
        edge = subprocess.Popen([sys.executable, "-m", "llmgw.cli.main", "router", "--control",
                                 f"http://127.0.0.1:{gateway.admin_port}", "--credential-file", str(path),
                                 "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "edge")],
                                stdout=open(tmp_path / "edge.log", "ab"), stderr=subprocess.STDOUT, env=env)

        def edge_entry() -> dict | None:
            routers = gateway.admin("/api/status")[1]["routers"] or []
            return next((r for r in routers if r["router"].startswith("edge1/")), None)

        wait_for(lambda: (edge_entry() or {}).get("current"), 60, "the edge router's reports, current")
        assert edge_entry()["unapplied"] is None
        key = gateway.create_key("after-the-fault")  # the key refresh makes a Change with the keys
        wait_for(lambda: (edge_entry() or {}).get("unapplied"), 30, "the edge router to report the change it refused")
        wait_for(lambda: models(_At(f"http://127.0.0.1:{port}"), key) == 200, 30, "the edge router caught up")
        entry = edge_entry()
        unapplied = entry["unapplied"]
        assert unapplied["reason"] == "RuntimeError in the router (see its log)"
        assert unapplied["version"] >= 2 and unapplied["epoch"] == entry["snapshot"]["epoch"]
        wait_for(lambda: edge_entry()["current"] and edge_entry()["snapshot"]["version"] >= unapplied["version"], 30,
                 "the edge router on the whole snapshot, past the change it refused")

        listed = json.loads(ctl(gateway, "status", "--json").stdout)
        (router,) = [r for r in listed["routers"] if r["router"] == entry["router"]]
        assert router["unapplied"] == unapplied
        shown = subprocess.run([sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(gateway.state_dir),
                                "status"], capture_output=True, text=True, env={**gateway.env, "COLUMNS": "250"},
                               timeout=60)
        assert shown.returncode == 0, shown.stderr
        print(shown.stdout)
        assert (f"{entry['router']}: could not apply version {unapplied['version']} of epoch {unapplied['epoch']}"
                in shown.stdout)
        assert "RuntimeError in the router (see its log)" in shown.stdout
        assert "sk-llmgw-never-sent" not in shown.stdout + json.dumps(listed)
    finally:
        if edge is not None:
            edge.terminate()
            edge.wait(30)
        gateway.stop()


class _At:
    def __init__(self, url: str):
        self.url = url
