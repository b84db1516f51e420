"""Hostile nodes: a helper file tampered with between connects, a helper directory opened to
others, and a host key that changed. What can be repaired is repaired; what cannot is reported
with its reason and runs nothing, while the other nodes serve traffic (R-1.3, R-1.5, R-9.4).

Three one-GPU nodes each serve one replica of `chat` (min 3). Then:
  A. `tampered`: one byte of its helper file flips and the helper session dies. The link
     reconnects, the bootstrap refuses the file, a good copy is uploaded; the engine there is
     not touched.
  B. `tampered` reboots with its helper directory made 0755, and `rekeyed` is reinstalled with
     a new host key. Neither may run anything: both show as unhealthy with the reason in
     `llmgw ctl nodes`, no engine starts on them, and `chat` keeps serving from `good`.
  C. (two other nodes) a scratch filer anyone can write is both nodes' cache: what one fetched
     the other takes without downloading again, and a directory another user planted under a
     model's cache name is never held nor served; the fetch says whose it is.
  D. Code on a node of the fleet (it holds the fleet secret) rewrites the fetched weights on
     the filer in place, same size, mtime put back: the next start there is refused, naming the
     file in `ctl replicas`, and nothing is removed or downloaded again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

from llmgw.weights import parse_weights
from tests.integration.gateway import GatewayProcess, wait_for
from tests.scenarios.operating import SCENARIO_GATEWAY, Ctl, helper_session_pids, kill_pids, write_inventory
from tests.testbed import GPU, NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

HOSTILE = ("tampered", "rekeyed")
OBSERVE = 20.0  # seconds both hostile nodes are watched once reported: several ticks and link retries


class Traffic:
    """Steady non-streaming requests from the official client, each one counted."""

    def __init__(self, url: str, key: str, model: str):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        self.model = model
        self.sent = self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.sent += 1
            try:
                reply = self.client.chat.completions.create(model=self.model,
                                                            messages=[{"role": "user", "content": "hello"}])
                self.ok += reply.choices[0].message.content.startswith(self.model)
            except openai.APIError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.1)  # a client's pace

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)

    def account(self) -> str:
        return (f"{self.sent} requests sent, {self.ok} succeeded, {len(self.failures)} failed"
                + (f" ({self.failures[:3]})" if self.failures else ""))


def _helper_dir(bed, node: str) -> Path:
    """The node's helper directory seen from the host (its /root is a folder of the testbed)."""
    return bed[node].home_dir / ".llmgw" / "helper"


def _helper_file(bed, node: str) -> Path:
    directory = _helper_dir(bed, node)
    (found,) = [p for p in directory.iterdir() if p.name.startswith("llmgw_helper-")]
    return found


def _new_host_key(bed, node: str) -> str:
    """Reinstall: a new host key for the node's sshd (known_hosts keeps the old one). Its fingerprint."""
    key = bed[node].dir / "ssh_host_ed25519_key"
    for path in (key, key.with_suffix(".pub")):
        path.unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{node} reinstalled", "-f", str(key)],
                   check=True, capture_output=True)
    out = subprocess.run(["ssh-keygen", "-lf", str(key.with_suffix(".pub"))], check=True, capture_output=True,
                         text=True).stdout
    return out.split()[1]


@pytest.fixture
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("good", gpus=[GPU.h100()], mem_gb=64),
                          NodeSpec("tampered", gpus=[GPU.h100()], mem_gb=64),
                          NodeSpec("rekeyed", gpus=[GPU.h100()], mem_gb=64)])
    yield tb
    tb.close()


def test_hostile_nodes_run_nothing_and_say_why(bed, tmp_path):
    profiles = {"h100": {"engine": "vllm", "gpus": 1, "gpu_class": "h100-80gb", "start_timeout": "60s"}}
    models = [{"name": "chat", "profile": "h100", "scaling": {"min": 3}}]
    inventory = write_inventory(bed, tmp_path / "inventory.yaml", models=models, profiles=profiles)
    gateway = GatewayProcess(inventory, tmp_path / "state").start()
    try:
        ctl = Ctl(gateway)

        def replicas_by_node():
            return {r["shards"][0]["node"]: r for r in ctl.json("replicas")["replicas"]
                    if r["serving"] and not r["retired"]}

        key = gateway.create_key("hostile")
        wait_for(lambda: len(replicas_by_node()) == 3, 90, f"three replicas serving\n{gateway.log()[-3000:]}")
        before = replicas_by_node()
        # Keys are reloaded off the request path every couple of seconds: wait until this one is in.
        wait_for(lambda: openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0).models.list(), 30,
                 "the new API key to be accepted")

        with Traffic(gateway.url, key, "chat") as traffic:
            # A. Tampered between connects: replaced, and the engine there carries on.
            engine_pids = sorted(bed.engine_pids("tampered"))
            helper = _helper_file(bed, "tampered")
            data = bytearray(helper.read_bytes())
            data[len(data) // 2] ^= 0x01
            helper.write_bytes(bytes(data))
            deployed = gateway.log().count("tampered: deploying helper")
            kill_pids(helper_session_pids(bed, "tampered"))
            wait_for(lambda: gateway.log().count("tampered: deploying helper") > deployed, 30,
                     "the tampered helper to be replaced")
            wait_for(lambda: helper_session_pids(bed, "tampered"), 30, "a helper session on tampered again")
            repaired = hashlib.sha256(helper.read_bytes()).hexdigest()
            wait_for(lambda: replicas_by_node().get("tampered", {}).get("id") == before["tampered"]["id"], 30,
                     "tampered's replica still serving")
            print(f"\nA. tampered helper: replaced ({helper.name[:26]}... hashes to its name: "
                  f"{helper.name == f'llmgw_helper-{repaired}.py'}); engine pids {engine_pids} -> "
                  f"{sorted(bed.engine_pids('tampered'))}; traffic so far: {traffic.account()}")
            assert helper.name == f"llmgw_helper-{repaired}.py"
            assert sorted(bed.engine_pids("tampered")) == engine_pids != []

            # B. What cannot be repaired: reboots into a helper directory open to others, and a
            # reinstall with a new host key.
            for node in HOSTILE:
                bed.crash(node)
            os.chmod(helper.parent, 0o755)
            fingerprint = _new_host_key(bed, "rekeyed")
            for node in HOSTILE:
                bed.restart_node(node)

            def reported():
                nodes = {n["name"]: n for n in ctl.json("nodes")["nodes"]}
                return all(nodes[n]["state"] == "unhealthy" for n in HOSTILE) and nodes

            nodes = wait_for(reported, 60, f"both hostile nodes reported unhealthy\n{gateway.log()[-3000:]}")
            def given_up():
                # Failed, and kept (retiring) until their node can be told to stop them.
                hostile = [r for r in ctl.json("replicas")["replicas"] if r["shards"][0]["node"] in HOSTILE]
                return set(replicas_by_node()) == {"good"} and all(r["state"] == "failed" for r in hostile) and hostile

            given = wait_for(given_up, 60, "the hostile nodes' replicas to be given up")
            # Watch them for a while: nothing may start there, however often the links retry.
            engines_seen: dict[str, set[int]] = {n: set() for n in HOSTILE}
            sessions_on_rekeyed: set[int] = set()
            deadline = time.monotonic() + OBSERVE
            while time.monotonic() < deadline:
                for node in HOSTILE:
                    engines_seen[node].update(bed.engine_pids(node))
                sessions_on_rekeyed.update(helper_session_pids(bed, "rekeyed"))
                time.sleep(0.2)  # sampling pace over a fixed observation window, not a wait
            table = ctl.ok("nodes").stdout
            models = {m["name"]: m for m in ctl.json("models")["models"]}
            verdicts = {v["node"]: v for v in ctl.json("explain-placement", "chat")["verdicts"]}
            after = replicas_by_node()
        rows = {line.split()[0]: line for line in table.splitlines() if line.split() and line.split()[0] in bed.nodes}

        print(f"B. after {OBSERVE:.0f}s of watching: engines on tampered {sorted(engines_seen['tampered'])}, "
              f"on rekeyed {sorted(engines_seen['rekeyed'])}; helper sessions on rekeyed {sorted(sessions_on_rekeyed)}")
        for node in ("good", *HOSTILE):
            print(f"   ctl nodes | {'  '.join(re.split(r' {2,}', rows[node])[:2])}")
        for replica in given:
            print(f"   replica on {replica['shards'][0]['node']}: {replica['state']}: {replica['reason']}")
        print(f"   chat: {models['chat']['state']}, {models['chat']['replicas']['serving']} serving; "
              f"why not more: {models['chat']['unplaceable']}")
        print(f"traffic to chat: {traffic.account()}")

        tampered, rekeyed = nodes["tampered"], nodes["rekeyed"]
        assert "is mode 0755, open to group or others" in tampered["state_reason"], tampered["state_reason"]
        assert rekeyed["state_reason"].startswith("host key for rekeyed"), rekeyed["state_reason"]
        assert "changed" in rekeyed["state_reason"] and fingerprint in rekeyed["state_reason"]
        assert "unhealthy" in rows["tampered"] and "is mode 0755" in rows["tampered"]
        assert "unhealthy" in rows["rekeyed"] and fingerprint in rows["rekeyed"]
        assert rows["good"].split()[1] == "ready"
        # Nothing runs on either hostile node; the good one serves on.
        assert engines_seen == {"tampered": set(), "rekeyed": set()}
        assert sessions_on_rekeyed == set()
        assert not verdicts["tampered"]["fits"] and not verdicts["rekeyed"]["fits"]
        assert any(r.startswith("unhealthy: ") for r in verdicts["rekeyed"]["reasons"])
        assert all(r["reason"].startswith(f"node {r['shards'][0]['node']} unhealthy since") for r in given), given
        assert list(after) == ["good"] and after["good"]["id"] == before["good"]["id"]
        assert traffic.failures == [] and traffic.ok == traffic.sent > 0
    finally:
        gateway.stop()
        try:
            os.chmod(_helper_dir(bed, "tampered"), 0o700)
        except OSError:
            pass


@pytest.fixture
def filer_bed(testbed_factory):
    tb = testbed_factory([NodeSpec("n1", gpus=None, mem_gb=32), NodeSpec("n2", gpus=None, mem_gb=32)])
    yield tb
    tb.close()


def test_a_shared_filer_serves_what_the_fleet_fetched_and_never_what_was_planted(filer_bed, tmp_path):
    """C. Two nodes cache onto one scratch filer anyone can write (R-5.2, R-2.6). Weights one node
    fetched are taken by the other without a second download (the fleet secret seals them);
    a directory another user planted under a model's cache name is never held or served."""
    bed = filer_bed
    url = bed.weights.add("filer/model.gguf", size=2 << 20)
    planted_url = bed.weights.add("planted/model.gguf", size=4096)
    shared = bed.shared_dir
    os.chmod(shared, 0o1777)
    planted = shared / parse_weights(planted_url).cache_name
    planted.mkdir()
    (planted / "model.gguf").write_bytes(b"poisoned" * 512)
    (planted / ".llmgw-complete").write_text(json.dumps({"name": planted.name, "bytes": 4096, "files": 1}))
    for path in (planted, planted / "model.gguf", planted / ".llmgw-complete"):
        os.chown(path, 4242, 4242)
    document = {"gateway": dict(SCENARIO_GATEWAY),
                **bed.inventory(models=[], profiles={"cpu": {"engine": "llama-server", "start_timeout": "60s"}})}
    for node in document["nodes"]:
        node["cache_dir"] = str(shared)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(document, sort_keys=False))
    gateway = GatewayProcess(inventory, tmp_path / "state").start()
    try:
        ctl = Ctl(gateway)

        def serving(model):
            return sorted(r["shards"][0]["node"] for r in ctl.json("replicas")["replicas"]
                          if r["model"] == model and r["serving"] and not r["retired"])

        wait_for(lambda: all(n["state"] == "ready" for n in ctl.json("nodes")["nodes"]), 60, "both nodes ready")
        (tmp_path / "chat.yaml").write_text(f"name: chat\nprofile: cpu\nweights: {url}\nscaling: {{min: 1}}\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "chat.yaml"))
        [first] = wait_for(lambda: serving("chat"), 120, f"chat to serve\n{gateway.log()[-3000:]}")
        other = "n2" if first == "n1" else "n1"
        ctl.ok("cordon", first)  # the second replica must go to the other node
        ctl.ok("scale", "chat", "--min", "2")
        wait_for(lambda: other in serving("chat"), 120, f"chat to serve on {other}\n{gateway.log()[-3000:]}")
        fetched = bed.weights.hits(url)

        (tmp_path / "planted.yaml").write_text(f"name: planted\nprofile: cpu\nweights: {planted_url}\n"
                                               "scaling: {min: 1}\n")
        ctl.ok("model", "add", "-f", str(tmp_path / "planted.yaml"))

        def refused():
            return [r for r in ctl.json("replicas")["replicas"] if r["model"] == "planted" and r["state"] == "failed"]

        failures = wait_for(refused, 60, f"the planted model's fetch to be refused\n{gateway.log()[-3000:]}")
        storage = {n["node"]: sorted(h["model"] for h in n["holdings"] or []) for n in ctl.json("storage")["nodes"]}
        reason = failures[0]["shards"][0]["reason"] or failures[0]["reason"]
        print(f"\nC. chat served by {serving('chat')}; GETs of its weights: {fetched}; holdings {storage}")
        print(f"   planted: {len(failures)} failed replica(s): {reason}; GETs of its source: "
              f"{bed.weights.hits(planted_url)}")
        assert fetched == 1, "the second node took the entry the first one fetched"
        assert storage == {"n1": ["chat"], "n2": ["chat"]}
        assert "not llmgw's" in reason and "uid 4242" in reason, reason
        assert serving("planted") == [] and bed.weights.hits(planted_url) == 0
        assert (planted / "model.gguf").read_bytes() == b"poisoned" * 512

        # D. Rewritten in place by a node of the fleet: refused at the next start.
        weights = shared / parse_weights(url).cache_name / "model.gguf"
        before = weights.stat()
        with open(weights, "r+b") as handle:
            handle.seek(before.st_size // 2)
            handle.write(b"\0" * 64)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        kill_pids(bed.engine_pids(other))  # the engine there ends; its replacement starts from the filer

        def tampered_refused():
            return [reason for r in ctl.json("replicas")["replicas"] if r["model"] == "chat" and r["state"] == "failed"
                    for reason in [r["shards"][0]["reason"] or r["reason"] or ""] if str(weights) in reason]

        [refusal, *_] = wait_for(tampered_refused, 120, f"the rewritten weights refused\n{gateway.log()[-3000:]}")
        print(f"D. rewritten in place on the filer: {refusal}")
        assert "SHA-256" in refusal and "was changed after the fetch" in refusal, refusal
        assert weights.stat().st_size == before.st_size, "nothing removed"
        assert bed.weights.hits(url) == 1, "not downloaded again"
    finally:
        gateway.stop()
