"""`llmgw serve` and its router workers as processes of their own (R-10.4, R-9.1).

serve spawns the router supervisor detached; the workers go on serving when serve is killed;
the next serve on the state directory adopts them instead of starting others or failing on the
port, and applies the worker count it is given. These run the embedded default (this machine as
its one local node): what is looked at is the process tree, not a fleet.
"""

from __future__ import annotations

import json
import os
import urllib.request

from llmgw.router.supervisor import running_supervisor
from tests.integration.gateway import GatewayProcess, wait_for


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
    finally:
        first.kill()
        if second is not None:
            second.stop()
        first.stop_router()
