"""Token usage per key or per model over a period, read from the store's hourly counters (R-6.9).

`prompt_tokens` and `completion_tokens` include what was estimated for streams cut before their
usage arrived; `estimated_tokens` is that part (R-6.9a). `unmetered` counts requests whose tokens
nobody knows (no usage, nothing relayed to estimate from): a row made only of those has None
tokens, not 0.

By key, each row also carries the key's limits as they are now (R-6.16): `rpm`, `tpm`,
`concurrency` (None where it has none) and `model_limits` (model -> the same three); all None
for a row whose key is gone from the store, since then nobody knows them."""

from __future__ import annotations

import time

import sqlite_utils

from llmgw.contracts.feed import LIMIT_FIELDS, Limits
from llmgw.keys import ApiKey
from llmgw.contracts.feed import USAGE_BUCKET_SECONDS  # the routers count per hour

BY = ("model", "key")


def usage_report(db: sqlite_utils.Database, by: str, since_seconds: float, now: float | None = None) -> dict:
    """Requests and tokens grouped by model or key since `since_seconds` ago.

    Counters are kept per hour, so the period starts at the beginning of the hour that holds
    `now - since_seconds`; the answer says where it actually starts (`from`).
    """
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}")
    now = time.time() if now is None else now
    start = int(now - since_seconds) // USAGE_BUCKET_SECONDS * USAGE_BUCKET_SECONDS
    if by == "model":
        sql = ("SELECT model AS name, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens), "
               "SUM(estimated_tokens), SUM(unmetered) FROM usage "
               "WHERE bucket >= ? GROUP BY model ORDER BY SUM(prompt_tokens + completion_tokens) DESC, model")
    else:
        # A key's name, even once revoked: usage stays attributable. A row whose key is gone
        # entirely shows the stored id.
        sql = ("SELECT COALESCE(k.name, u.key_id) AS name, SUM(u.requests), SUM(u.prompt_tokens), "
               "SUM(u.completion_tokens), SUM(u.estimated_tokens), SUM(u.unmetered), u.key_id "
               "FROM usage u LEFT JOIN api_keys k ON k.id = u.key_id "
               "WHERE u.bucket >= ? GROUP BY u.key_id "
               "ORDER BY SUM(u.prompt_tokens + u.completion_tokens) DESC, name")
    found = db.execute(sql, [start]).fetchall()
    rows = [_row(name, requests or 0, prompt or 0, completion or 0, estimated or 0, unmetered or 0)
            for name, requests, prompt, completion, estimated, unmetered, *_ in found]
    if by == "key":
        keys = _keys(db, [row[6] for row in found])
        for row, (*_, key_id) in zip(rows, found):
            row.update(_limits(keys.get(key_id)))
    else:  # the requests each model served through an alias, by the alias the client used
        via: dict[str, dict[str, int]] = {}
        for model, alias, requests in db.execute(
                "SELECT model, via, SUM(requests) FROM usage WHERE bucket >= ? AND via != '' GROUP BY model, via "
                "ORDER BY via", [start]).fetchall():
            via.setdefault(model, {})[alias] = requests
        for row in rows:
            row["via"] = via.get(row["name"], {})
    totals = _row(None, *(sum(r[key] for r in rows) for key in ("requests", "_prompt", "_completion",
                                                                 "estimated_tokens", "unmetered")))
    del totals["name"]
    for row in (*rows, totals):
        del row["_prompt"], row["_completion"]
    return {"by": by, "since_seconds": since_seconds, "from": start, "to": now, "rows": rows, "totals": totals}


def _row(name: str | None, requests: int, prompt: int, completion: int, estimated: int, unmetered: int) -> dict:
    """One row of counts; its tokens None when every request in it is unmetered (unknown, not 0)."""
    known = requests > unmetered or prompt or completion
    return {"name": name, "requests": requests,
            "prompt_tokens": prompt if known else None, "completion_tokens": completion if known else None,
            "total_tokens": prompt + completion if known else None,
            "estimated_tokens": estimated, "unmetered": unmetered, "_prompt": prompt, "_completion": completion}


def _keys(db: sqlite_utils.Database, ids: list[str]) -> dict[str, ApiKey]:
    if not ids:
        return {}
    marks = ",".join("?" * len(ids))
    cursor = db.execute(f"SELECT * FROM api_keys WHERE id IN ({marks})", ids)
    columns = [c[0] for c in cursor.description]
    return {key.id: key for key in (ApiKey.from_row(dict(zip(columns, r))) for r in cursor.fetchall())}


def _limit_fields(limits: Limits | None) -> dict:
    return {name: None if limits is None else getattr(limits, name) for name in LIMIT_FIELDS}


def _limits(key: ApiKey | None) -> dict:
    """A key's limits for its usage row; None throughout when the key is not known."""
    if key is None:
        return {**_limit_fields(None), "model_limits": None}
    return {**_limit_fields(key.limits),
            "model_limits": {model: _limit_fields(lim) for model, lim in sorted(key.model_limits.items())}}
