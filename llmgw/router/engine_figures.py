"""Counts an engine reports (token usage, queue lengths, slots), clamped to what llmgw counts (R-10.8).

An engine is not trusted to report sane numbers: a negative token count or one above 2^63 once
made every later report of its router unwritable. Where the router reads a count from an engine
it goes through `clamp`: below 0 is 0, above `MAX_COUNT` (2^53) is `MAX_COUNT`, and the first
clamp of each kind per replica in LOG_EVERY seconds is logged, so a hostile engine cannot flood
the log either.
"""

from __future__ import annotations

import logging
import time

from llmgw.contracts.feed import MAX_COUNT

log = logging.getLogger(__name__)

LOG_EVERY = 60.0  # seconds between two log lines about one kind of clamp of one replica
_LOGGED_KEPT = 4096  # (what, replica) pairs remembered for the rate limit

_logged: dict[tuple[str, str | None], float] = {}


def clamp(value: int | float, what: str, replica: str | None = None) -> int:
    """`value` within [0, MAX_COUNT], as an integer; a value outside is logged (rate-limited) and clamped."""
    if 0 <= value <= MAX_COUNT:
        return int(value)
    clamped = 0 if value < 0 else MAX_COUNT
    now = time.monotonic()
    key = (what, replica)
    if now - _logged.get(key, -LOG_EVERY) >= LOG_EVERY:
        if len(_logged) >= _LOGGED_KEPT:
            _logged.clear()
        _logged[key] = now
        if isinstance(value, float) or abs(value) < 10**30:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
        else:
            shown = f"{'-' if value < 0 else ''}2^{abs(value).bit_length() - 1} or more"
        log.warning("engine%s reported %s = %s; counted as %d (counts are kept within 0..%d); "
                    "further ones are logged at most once a minute", f" of replica {replica}" if replica else "",
                    what, shown, clamped, MAX_COUNT)
    return clamped


def add(total: int, more: int) -> int:
    """A count plus another, saturating at MAX_COUNT: sums of clamped counts stay within it too."""
    return min(total + more, MAX_COUNT)
