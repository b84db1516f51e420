"""Token usage per key or per model over a period, read from the store's hourly counters (R-6.9)."""

from __future__ import annotations

import time

import sqlite_utils

from llmgw.router.usage import BUCKET_SECONDS  # the router counts per hour

BY = ("model", "key")


def usage_report(db: sqlite_utils.Database, by: str, since_seconds: float, now: float | None = None) -> dict:
    """Requests and tokens grouped by model or key since `since_seconds` ago.

    Counters are kept per hour, so the period starts at the beginning of the hour that holds
    `now - since_seconds`; the answer says where it actually starts (`from`).
    """
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}")
    now = time.time() if now is None else now
    start = int(now - since_seconds) // BUCKET_SECONDS * BUCKET_SECONDS
    if by == "model":
        sql = ("SELECT model AS name, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) FROM usage "
               "WHERE bucket >= ? GROUP BY model ORDER BY SUM(prompt_tokens + completion_tokens) DESC, model")
    else:
        # A key's name, even once revoked: usage stays attributable. A row whose key is gone
        # entirely shows the stored id.
        sql = ("SELECT COALESCE(k.name, u.key_id) AS name, SUM(u.requests), SUM(u.prompt_tokens), "
               "SUM(u.completion_tokens) FROM usage u LEFT JOIN api_keys k ON k.id = u.key_id "
               "WHERE u.bucket >= ? GROUP BY u.key_id "
               "ORDER BY SUM(u.prompt_tokens + u.completion_tokens) DESC, name")
    rows = [{"name": name, "requests": requests or 0, "prompt_tokens": prompt or 0,
             "completion_tokens": completion or 0, "total_tokens": (prompt or 0) + (completion or 0)}
            for name, requests, prompt, completion in db.execute(sql, [start]).fetchall()]
    totals = {key: sum(r[key] for r in rows) for key in ("requests", "prompt_tokens", "completion_tokens",
                                                        "total_tokens")}
    return {"by": by, "since_seconds": since_seconds, "from": start, "to": now, "rows": rows, "totals": totals}
