"""The read-only dashboard (R-9.6): server-rendered pages from templates shipped in the package.

Pages are `string.Template` files under templates/ filled with HTML fragments built here; every
value from the gateway goes through `html.escape` on its way in (`esc`, `table`), stripped of
control characters first (a node's reasons may carry terminal escapes). One
stylesheet, no JavaScript: the Content-Security-Policy forbids scripts outright, and nothing on
a page changes state or mints a credential (those stay in `llmgw ctl`).
"""

from __future__ import annotations

import html
import importlib.resources
import time
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from string import Template
from typing import Any

from aiohttp import web

from llmgw.admin import text
from llmgw.admin.dependencies import AdminDependencies
from llmgw.admin.usage import usage_report
from llmgw.admin.views import Listings, explanation_json, listings
from llmgw.contracts.refusals import ServiceError
from llmgw.units import format_bytes, parse_duration

STYLESHEET_PATH = "/static/style.css"
REFRESH_SECONDS = 15
PAGES = {  # path -> navigation title, in navigation order
    "/": "Overview",
    "/nodes": "Nodes",
    "/models": "Models",
    "/replicas": "Replicas",
    "/engines": "Engines",
    "/placement": "Placement failures",
    "/usage": "Usage",
}
USAGE_PERIODS = ("1h", "24h", "7d", "30d")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self' data:; "
                               "form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class Markup(str):
    """A fragment that is already HTML: `esc` and `table` leave it alone."""


def esc(value: Any) -> Markup:
    """Escaped text without control characters; None is unknown and shows as `-` (R-2.7)."""
    if isinstance(value, Markup):
        return value
    return Markup(text.UNKNOWN if value is None else html.escape(text.printable(str(value))))


def tag(name: str, content: Any = "", cls: str | None = None) -> Markup:
    attr = f' class="{html.escape(cls)}"' if cls else ""
    return Markup(f"<{name}{attr}>{esc(content)}</{name}>")


def lines(items: Iterable[Any], cls: str | None = None) -> Markup:
    """Several values in one cell, one per line."""
    return Markup("".join(tag("div", item, cls) for item in items))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], empty: str = "nothing to show",
          cls: str | None = None) -> Markup:
    rows = list(rows)
    if not rows:
        return tag("p", empty, "empty")
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    attr = f' class="{html.escape(cls)}"' if cls else ""
    return Markup(f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def bar(used: int, free: int, unhealthy: int) -> Markup:
    cells = text.bar_cells(used, free, unhealthy)
    spans = "".join(f'<span class="cell {cls}"></span>' * count
                    for cls, count in zip(("used", "free", "unhealthy"), cells))
    return Markup(f'<span class="bar">{spans}</span>')


@lru_cache(maxsize=None)
def template(name: str) -> Template:
    return Template(importlib.resources.files("llmgw.admin").joinpath(f"templates/{name}").read_text())


@lru_cache(maxsize=1)
def stylesheet() -> bytes:
    return importlib.resources.files("llmgw.admin").joinpath("static/style.css").read_bytes()


def _link(href: str, title: str, here: bool) -> str:
    cls = ' class="here"' if here else ""
    return f'<a href="{html.escape(href)}"{cls}>{esc(title)}</a>'


def page(path: str, content: Markup, now: float, status: int = 200) -> web.Response:
    nav = "".join(_link(p, title, p == path) for p, title in PAGES.items())
    body = template("layout.html").substitute(
        title=esc(PAGES.get(path, "llmgw")), nav=Markup(nav), content=content, refresh=REFRESH_SECONDS,
        generated=esc(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))), stylesheet=STYLESHEET_PATH)
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8",
                        headers=SECURITY_HEADERS)


def refused() -> web.Response:
    # No stylesheet link: without the token the stylesheet is refused too.
    body = template("refused.html").substitute()
    return web.Response(text=body, status=401, content_type="text/html", charset="utf-8",
                        headers=SECURITY_HEADERS)


# -- pages ---------------------------------------------------------------------------------------


def overview(snapshot: Listings) -> Markup:
    status = snapshot.status()
    capacity = table(["GPU class", "nodes", "used / free / unhealthy", "used", "free", "unhealthy"],
                     [[text.gpu_class_name(c["gpu_class"]), c["nodes"], bar(c["used"], c["free"], c["unhealthy"]),
                       c["used"], c["free"], c["unhealthy"]] for c in status["capacity"]],
                     empty="no GPUs reported")
    if status["gpus_unknown"]:
        capacity = Markup(capacity + tag("p", "GPUs not reported yet: " + ", ".join(status["gpus_unknown"]),
                                         "note"))
    whole = table(["fabric", "free whole nodes"], sorted(status["free_whole_nodes"].items()),
                  empty="no node belongs to a fabric")
    counts = table(["", "total", "by state"], [
        ["nodes", status["nodes"]["total"], _counts(status["nodes"]["by_state"])],
        ["node admin", "", _counts(status["nodes"]["by_admin"])],
        ["replicas", status["replicas"]["total"], _counts(status["replicas"]["by_state"])],
        ["models", status["models"]["total"], _counts(status["models"]["by_state"])],
    ])
    unplaceable = table(["model", "why it cannot be placed"],
                        [[u["model"], u["reason"]] for u in status["unplaceable"]],
                        empty=text.ALL_PLACEABLE)
    idle = table(["replica", "model", "nodes", "unasked-for"],
                 [[i["replica"], i["model"], ", ".join(i["nodes"]), text.idle_for(i)] for i in status["idle"]],
                 empty="no serving replica")
    fabrics = table(["fabric", "nodes", "models held (no cross-fabric copy)", "shared filers (counted once)",
                     "local free"],
                    [[text.fabric_name(f["fabric"]), ", ".join(f["nodes"]),
                      lines(text.held_in_fabric(m) for m in f["models"]) if f["models"] else "-",
                      lines(text.filer_free(fs) for fs in f["shared_filers"]) if f["shared_filers"] else "-",
                      format_bytes(f["local_free_bytes"])] for f in status["fabrics"]])
    return Markup(template("overview.html").substitute(capacity=capacity, whole=whole, counts=counts,
                                                       unplaceable=unplaceable, idle=idle, fabrics=fabrics))


def _counts(mapping: dict[str, int]) -> str:
    return text.counts(mapping) or text.UNKNOWN


def nodes_page(snapshot: Listings) -> Markup:
    now = snapshot.now
    rows = []
    for node in snapshot.nodes():
        used, free, unhealthy = text.gpu_counts(node["gpus"])
        disk = node["disk"]
        rows.append([
            node["name"], text.node_state(node, now), text.admin_state(node, now), node["fabric"],
            text.labels(node["labels"]), text.gpu_summary(node), used, free,
            lines([unhealthy, *text.unhealthy_reasons(node["gpus"])]),
            format_bytes(node["memory_bytes"]),
            lines(text.filesystem(fs) for fs in disk["local"]) if disk and disk["local"] else "-",
            lines(text.filesystem(fs) for fs in disk["shared"]) if disk and disk["shared"] else "-",
            ", ".join(node["replicas"]) or "-",
        ])
    listing = table(["node", "state", "admin", "fabric", "labels", "GPUs", "used", "free", "unhealthy", "MEM",
                     "disk (local)", "disk (shared)", "replicas"], rows, empty="no nodes in the inventory")
    return Markup(template("nodes.html").substitute(nodes=listing))


def models_page(snapshot: Listings) -> Markup:
    rows = [[m["name"], m["state"], f"{m['replicas']['serving']} / {m['replicas']['total']}",
             text.revision_listed(m), text.scaling_listed(m["scaling"]), text.last_scale(m, snapshot.now), m["routing"], m["profile"], m["engine"],
             m["weights"], m["fallback"], text.declared(m), text.model_problem(m)] for m in snapshot.models()]
    listing = table(["model", "state", "serving / replicas", "revision", "scaling", "last scaled", "routing", "profile", "engine",
                     "weights", "fallback", "declared", "problem"], rows, empty="the catalog has no models")
    return Markup(template("models.html").substitute(models=listing))


def replicas_page(snapshot: Listings) -> Markup:
    now = snapshot.now
    rows = []
    for replica in snapshot.replicas():
        shards = []
        for shard in replica["shards"]:
            shards.append(tag("div", text.shard_line(shard)))
            if shard["progress"] is not None:
                shards.append(tag("div", shard["progress"]["line"], "progress"))
            if shard["log_tail"]:
                shards.append(tag("pre", "\n".join(shard["log_tail"][-20:]), "log"))
        number = replica.get("revision_number")
        rows.append([replica["id"], replica["model"], f"#{number}" if number is not None else "-",
                     text.replica_adapters(replica), text.replica_state(replica), Markup("".join(shards)),
                     text.ago(replica["serving_since"], now) if replica["serving_since"] else "-",
                     text.idle_for(replica), "-" if replica.get("in_flight") is None else replica["in_flight"],
                     text.engine_load(replica), replica["reason"]])
    listing = table(["replica", "model", "revision", "adapters", "state", "shards", "serving since", "unasked-for", "in flight",
                     "engine load", "reason"], rows,
                    empty=text.NO_REPLICAS, cls="replicas")
    return Markup(template("replicas.html").substitute(replicas=listing))


def engines_page(document: dict) -> Markup:
    rows, notes = [], []
    for node in document["nodes"]:
        if node["error"]:
            rows.append([node["node"], "-", "-", "-", "-", "-", f"error: {node['error']}", "-", "-"])
            continue
        for row in node["engines"]:
            what = row["what"] or row["name"]
            if row["kind"] == "image" and row["pulled"] is not None:
                what += " (pulled by llmgw)" if row["pulled"] else " (was on the node)"
            rows.append([node["node"], row["kind"], what, row["version"], format_bytes(row["bytes"]),
                         text.clock(row["last_used"]), row["state"], ", ".join(row["wanted_by"]) or "no profile",
                         ", ".join(row["used_by"]) or "-"])
        notes += [f"{node['node']}: cannot tell what profile {p} would install: {why}" for p, why in node["unknown"].items()]
    listing = table(["node", "kind", "engine", "version", "size", "last used", "state", "wanted by", "used by"], rows,
                    empty="no engine installed by llmgw on any node")
    return Markup(template("engines.html").substitute(
        engines=listing, notes=lines(notes, "note"), as_of=esc(text.clock(document.get("as_of")))))


def placement_page(snapshot: Listings, explain: Callable[[str], dict | None]) -> Markup:
    sections = []
    for entry in snapshot.status()["unplaceable"]:
        explanation = explain(entry["model"])
        if explanation is None:
            continue  # removed from the catalog since the view was published
        verdicts = table(["node", "verdict", "free GPUs", "holds weights", "reasons", "what if"],
                         [[v["node"], text.verdict(v), v["free_gpus"], text.holds(v["holds_weights"]),
                           lines(v["reasons"]), text.what_if(v)] for v in explanation["verdicts"]],
                         empty="no nodes")
        sections.append(Markup(f"<section><h2>{esc(entry['model'])}</h2>"
                               f"{tag('p', explanation['summary'], 'summary')}{verdicts}</section>"))
    content = Markup("".join(sections)) if sections else tag("p", text.ALL_PLACEABLE, "empty")
    return Markup(template("placement.html").substitute(failures=content))


def usage_page(snapshot: Listings, by_model: dict, by_key: dict, period: str) -> Markup:
    periods = "".join(_link(f"/usage?since={p}", p, p == period) for p in USAGE_PERIODS)

    def listing(report: dict, what: str) -> Markup:
        return table([what, "requests", "prompt tokens", "completion tokens", "total tokens", "estimated", "unmetered"],
                     [[r["name"], r["requests"], r["prompt_tokens"], r["completion_tokens"], r["total_tokens"],
                       r["estimated_tokens"], r["unmetered"]] for r in report["rows"]], empty=text.NO_REQUESTS)
    start = text.period_start(by_model)
    return Markup(template("usage.html").substitute(
        periods=Markup(periods), start=esc(start), by_model=listing(by_model, "model"), by_key=listing(by_key, "key")))


def add_routes(app: web.Application, admin: AdminDependencies) -> None:
    def simple(path: str, render: Callable[[Listings], Markup]):
        async def handler(request: web.Request) -> web.Response:
            snapshot = listings(admin)
            return page(path, render(snapshot), snapshot.now)
        return handler

    def placement(snapshot: Listings) -> Markup:
        def explain(model: str) -> dict | None:
            # Computed by the control plane, on the fleet as it is now.
            try:
                return explanation_json(admin.control.explain(model))
            except ServiceError:
                return None
        return placement_page(snapshot, explain)

    async def usage(request: web.Request) -> web.Response:
        period = request.query.get("since", "24h")
        try:
            seconds = parse_duration(period)
        except ValueError:
            period, seconds = "24h", parse_duration("24h")
        snapshot = listings(admin)
        by_model = await admin.store.read(lambda db: usage_report(db, "model", seconds, snapshot.now))
        by_key = await admin.store.read(lambda db: usage_report(db, "key", seconds, snapshot.now))
        return page("/usage", usage_page(snapshot, by_model, by_key, period), snapshot.now)

    async def engines(request: web.Request) -> web.Response:
        # Asked of the nodes, at most once a minute whatever the number of viewers.
        document = await admin.control.engines(max_age=60.0)
        return page("/engines", engines_page(document), time.time())

    async def style(request: web.Request) -> web.Response:
        return web.Response(body=stylesheet(), content_type="text/css", charset="utf-8",
                            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})

    app.add_routes([
        web.get("/", simple("/", overview)),
        web.get("/nodes", simple("/nodes", nodes_page)),
        web.get("/models", simple("/models", models_page)),
        web.get("/replicas", simple("/replicas", replicas_page)),
        web.get("/engines", engines),
        web.get("/placement", simple("/placement", placement)),
        web.get("/usage", usage),
        web.get(STYLESHEET_PATH, style),
    ])

