"""Capped exponential backoff with jitter, one rule for every retry loop.

Node links reconnect with it (R-1.1), the reconciler spaces the replacements of a failing
model's replicas with it (R-4.1) and retries stopping an engine on a node that is away.
"""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """The wait before retry `attempt` (0 first): somewhere in the upper half of
    min(cap, base * 2**attempt), so retries of many callers do not line up."""
    step = min(cap, base * (2 ** min(attempt, 16)))
    return random.uniform(step / 2, step)
