"""Operating a real `llmgw serve` on the testbed the way an operator does: the inventory it
reads, `llmgw ctl` run as a command, and the node's own processes looked at from outside."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.integration.gateway import GatewayProcess
from tests.testbed import Testbed
from tests.testbed.network import netns_pids

# Fast ticks so that a scenario sees many reconcile passes in its couple of minutes.
SCENARIO_GATEWAY = {"tick": "1s", "settling_window": "5s"}


def write_inventory(bed: Testbed, path: Path, *, models: list, profiles: dict, engines: dict | None = None,
                    known_hosts: Path | None = None, gateway: dict | None = None) -> Path:
    """The testbed's inventory with the scenario gateway settings (`gateway` added to them, and
    optionally another known_hosts)."""
    doc = bed.inventory(models=models, profiles=profiles)
    doc = {"gateway": {**SCENARIO_GATEWAY, **(gateway or {})}, **doc}
    if engines:
        doc["engines"] = engines
    if known_hosts is not None:
        doc["ssh"]["known_hosts"] = str(known_hosts)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@dataclass
class CtlResult:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


class Ctl:
    """`llmgw ctl ...` as a separate process against one gateway's state directory."""

    def __init__(self, gateway: GatewayProcess):
        self.gateway = gateway

    def run(self, *args: str, timeout: float = 60) -> CtlResult:
        argv = [sys.executable, "-m", "llmgw.cli.main", "ctl", "--state-dir", str(self.gateway.state_dir), *args]
        # A wide console: rich wraps at 80 columns when not on a terminal, which would split lines.
        env = {**self.gateway.env, "COLUMNS": "1000"}
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        return CtlResult(proc.returncode, proc.stdout, proc.stderr)

    def ok(self, *args: str) -> CtlResult:
        result = self.run(*args)
        assert result.code == 0, f"llmgw ctl {' '.join(args)} exited {result.code}: {result.stderr}"
        return result

    def json(self, *args: str):
        return self.ok(*args, "--json").json()


def node_processes(bed: Testbed, node: str) -> dict[int, list[str]]:
    """pid -> argv of every process running on a testbed node."""
    found = {}
    for pid in netns_pids(bed[node].netns):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        found[pid] = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    return found


def helper_session_pids(bed: Testbed, node: str) -> list[int]:
    """The node's long-lived helper processes (`... serve --expect-sha256 ...`), not engine supervisors."""
    return [pid for pid, argv in node_processes(bed, node).items()
            if "serve" in argv and "--expect-sha256" in argv]


def kill_pids(pids: list[int], sig: int = 9) -> None:
    import os

    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def sealed_envs(bed: Testbed, node: str) -> list[str]:
    """The environments the node's helper built and sealed (runtime: venv) under its root; one
    being built has no seal yet."""
    found = bed.run(node, ["sh", "-c", "cd /root/.llmgw/envs 2>/dev/null && for d in venv-*; do "
                                       "[ -f \"$d/.llmgw-complete\" ] && echo \"$d\"; done; true"])
    return found.stdout.split()
