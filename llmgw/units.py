"""Parsing of the human units used in configuration (durations, sizes, port ranges) and their
formatting. Standard library only: `llmgw ctl` formats with it (config.py makes the pydantic
field types of the parsers)."""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
    "p": 1000**5, "pb": 1000**5, "pib": 1024**5, "pi": 1024**5,
}


def parse_duration(value: object) -> float:
    """Seconds from `30s`, `10m`, `1.5h`, `250ms` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 10m or 1h")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return _finite(value, "a duration")
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return _finite(float(match.group(1)) * _DURATION_UNITS[match.group(2)], "a duration")
    raise ValueError(f"{value!r} is not a duration; write e.g. 30s, 10m, 1h or 250ms")


def _finite(value: float, what: str) -> float:
    """`value` as a float; YAML's .inf and .nan, and numbers past a float's range, are refused."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what} must be a finite number")
    return number


def parse_size(value: object) -> int:
    """Bytes from `24GB`, `512MiB`, `1.5TB` or a bare number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512MB or 24GB")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value if isinstance(value, int) else int(_finite(value, "a size"))
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            unit = (match.group(2) or "").lower()
            return int(_finite(float(match.group(1)) * _SIZE_UNITS[unit], "a size"))
    raise ValueError(f"{value!r} is not a size; write e.g. 512MB, 24GB or 2TiB")


def parse_port_range(value: object) -> tuple[int, int]:
    """(first, last) from `20000-20999`, `[20000, 20999]` or a single port."""
    if isinstance(value, int) and not isinstance(value, bool):
        low = high = value
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+\s*(-\s*\d+\s*)?", value):
        parts = [int(p) for p in value.split("-")]
        low, high = parts[0], parts[-1]
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(p, int) for p in value):
        low, high = value
    else:
        raise ValueError(f"{value!r} is not a port range; write e.g. 20000-20999")
    if not (1 <= low <= high <= 65535):
        raise ValueError(f"port range {low}-{high} must lie within 1-65535 with first <= last")
    return (low, high)


def format_bytes(value: int | None) -> str:
    """`-` for unknown, else a short decimal size (R-2.7: unknown is never 0)."""
    if value is None:
        return "-"
    step = 1000.0
    amount = float(value)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(amount) < step:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= step
    return f"{amount:.1f} PB"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def idle_text(seconds: float) -> str:
    """`42 s`, `42 min`, `3 h 5 min`, `2 d 4 h`: how long, to the unit an operator reads."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def duration_text(seconds: float) -> str:
    """`40 s`, `6 min`, `2 h 5 min`: an estimate, rounded up."""
    if seconds < 60:
        return f"{max(1, math.ceil(seconds))} s"
    return idle_text(math.ceil(seconds / 60) * 60)


def format_rate(bytes_per_second: float) -> str:
    """`35 MB/s`; below a MB/s, `120.0 KB/s`."""
    if bytes_per_second >= 1e6:
        return f"{bytes_per_second / 1e6:.0f} MB/s"
    return f"{format_bytes(int(bytes_per_second))}/s"
