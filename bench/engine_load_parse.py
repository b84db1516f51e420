"""Cost of reading an engine's load from its /metrics page, on the router's event loop.

The router parses each endpoint's page about once a second (llmgw.router.engineload); vLLM's is
about 50 KB. This times `parse_metrics` on the pages captured from the real engines
(tests/unit/fixtures/engine_load) and prints microseconds per parse, best of five rounds, against
a baseline in the same run: the page split into lines and every sample line's name looked up.

    .venv/bin/python bench/engine_load_parse.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw.router.engineload import _METRICS, parse_metrics  # noqa: E402

FIXTURES = ROOT / "tests" / "unit" / "fixtures" / "engine_load"
PAGES = ("vllm_metrics.txt", "vllm_metrics_busy.txt", "llama_server_metrics.txt")


def every_line(text: str) -> dict[str, float]:
    """The baseline: every line of the page split off and its metric name looked up."""
    found: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        spec = _METRICS.get(line.split("{", 1)[0].split(" ", 1)[0])
        if spec is not None:
            found[spec[0]] = found.get(spec[0], 0.0) + float(line.rsplit(None, 1)[-1])
    return found


def per_parse(parse, text: str, rounds: int = 5, count: int = 200) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(count):
            parse(text)
        best = min(best, (time.perf_counter() - started) / count)
    return best * 1e6


def main() -> None:
    print(f"{'page':28} {'size':>9} {'lines':>6} {'parse_metrics':>14} {'every line':>11} {'ratio':>6}")
    for name in PAGES:
        text = (FIXTURES / name).read_text()
        ours, baseline = per_parse(parse_metrics, text), per_parse(every_line, text)
        print(f"{name:28} {len(text) / 1024:6.1f} KB {text.count(chr(10)):6d} {ours:11.1f} us {baseline:8.1f} us "
              f"{ours / baseline:5.2f}x")
    print("(us per parse, best of 5 rounds of 200)")


if __name__ == "__main__":
    main()
