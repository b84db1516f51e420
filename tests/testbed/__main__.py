"""Bring up a testbed by hand, or clean up after crashed runs.

    python -m tests.testbed up --nodes 4 [--gpus 8] [--state DIR]
        builds the hosts, prints the inventory path and content, and waits until Ctrl-C;
        then `llmgw serve -i <that path>` in another shell.
    python -m tests.testbed cleanup
        removes namespaces, links, mounts and files of testbed runs whose process is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

from .network import TestbedError, cleanup_stale
from .testbed import Testbed, default_specs, requirements_missing


def up(args) -> int:
    reason = requirements_missing()
    if reason:
        print(f"cannot build a testbed here: {reason}", file=sys.stderr)
        return 1

    def stop(signum, frame):
        raise KeyboardInterrupt

    # Set SIGINT too: a shell starts background jobs with it ignored.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    specs = default_specs(args.nodes, args.gpus)
    if args.real_engines:
        specs = [dataclasses.replace(spec, engines="real") for spec in specs]
    tb = Testbed(specs, state_dir=args.state)
    try:
        tb.start()
        weights = tb.weights
        path = tb.write_inventory()
        print(f"# {len(tb.nodes)} nodes up in {tb.startup_seconds:.2f}s (run {tb.run_id})")
        print(f"# inventory: {path}")
        print(path.read_text(), end="")
        print(f"# weights server: {weights.url} (CA: {tb.ca_path})")
        first = next(iter(tb.nodes.values()))
        print(f"# log in:  {' '.join(tb.ssh_argv(first, '')).strip()}")
        print("# Ctrl-C tears everything down.", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("\n# tearing down", file=sys.stderr)
    except TestbedError as exc:
        print(f"testbed failed: {exc}", file=sys.stderr)
        return 1
    finally:
        tb.close()
    return 0


def cleanup(args) -> int:
    removed = cleanup_stale()
    print(f"removed {len(removed)} stale run(s){': ' + ', '.join(removed) if removed else ''}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="bring up a testbed and wait for Ctrl-C")
    p_up.add_argument("--nodes", type=int, default=4)
    p_up.add_argument("--gpus", type=int, default=8, help="H100s per node; 0 for CPU nodes")
    p_up.add_argument("--state", default=None, help="folder for inventory.yaml (kept after teardown)")
    p_up.add_argument("--real-engines", action="store_true",
                      help="the real vLLM and llama-server (built by scripts/engines) instead of the engine double")
    p_up.set_defaults(func=up)
    p_clean = sub.add_parser("cleanup", help="remove leftovers of testbed runs that died")
    p_clean.set_defaults(func=cleanup)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
