"""Which paths need a key (R-6.3), the landing page (R-6.4), and keys applied while running (R-6.2)."""

from __future__ import annotations

import json

import openai
import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app as cli
from tests.integration.test_router_support import apoll, catalog, model, raw_request, start_router  # noqa: F401

CATALOG = catalog(model("secret-model-name"))


@pytest.fixture
async def gw(start_router):  # noqa: F811
    return await start_router(CATALOG)


# Exact-path exemptions: everything else needs a key, and a path that does not exist answers 401
# without one (not 404: which paths exist is not told to strangers).
@pytest.mark.parametrize("method,path,without_key,with_key", [
    pytest.param("GET", "/", 200, 200, id="root"),
    pytest.param("GET", "/?x=1", 200, 200, id="root-with-query"),
    pytest.param("GET", "/healthz", 200, 200, id="healthz"),
    pytest.param("GET", "/healthz?verbose=1", 200, 200, id="healthz-with-query"),
    pytest.param("GET", "/v1/models", 401, 200, id="models"),
    pytest.param("GET", "//", 401, 404, id="double-slash"),
    pytest.param("GET", "/v1/", 401, 404, id="v1-dir"),
    pytest.param("GET", "/v1", 401, 404, id="v1"),
    pytest.param("GET", "/healthz/", 401, 404, id="healthz-slash"),
    pytest.param("GET", "/healthz/x", 401, 404, id="healthz-below"),
    pytest.param("GET", "/healthzx", 401, 404, id="healthz-longer"),
    pytest.param("GET", "/index.html", 401, 404, id="unknown-file"),
    pytest.param("GET", "/admin", 401, 404, id="unknown-admin"),
    pytest.param("GET", "/%2e%2e/healthz", 401, 404, id="dot-dot-encoded"),
    pytest.param("POST", "/", 401, 405, id="root-post"),
    pytest.param("POST", "/healthz", 401, 405, id="healthz-post"),
    pytest.param("POST", "/v1/chat/completions", 401, 400, id="chat-empty-body"),
])
async def test_r6_3_exemptions_are_exact_paths(gw, method, path, without_key, with_key):
    status, headers, body = await raw_request(gw.url, method, path)
    assert status == without_key
    if status == 401:
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    status, headers, body = await raw_request(gw.url, method, path, {"Authorization": f"Bearer {gw.secret}"})
    assert status == with_key
    if status >= 400:
        assert headers["content-type"].startswith("application/json")
        assert set(json.loads(body)["error"]) == {"message", "type", "code", "param", "request_id"}


async def test_r6_3_no_key_at_all_still_requires_one(start_router, tmp_path):  # noqa: F811
    gw = await start_router(CATALOG, store_path=tmp_path / "other.db")
    gw.router.keys.replace([])  # security by default: an empty key table lets nobody in
    status, _, body = await raw_request(gw.url, "GET", "/v1/models", {"Authorization": "Bearer anything"})
    assert status == 401
    status, _, body = await raw_request(gw.url, "GET", "/v1/models")
    assert status == 401
    assert "llmgw keys create" in json.loads(body)["error"]["message"]  # how to get the first key


async def test_r6_4_landing_page_has_no_data_and_uses_forwarded_address(gw):
    status, headers, body = await raw_request(gw.url, "GET", "/", {
        "Forwarded": 'for=10.0.0.1;proto=https;host="api.example.com"', "X-Forwarded-Host": "ignored.example"})
    page = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "https://api.example.com/v1" in page
    assert "secret-model-name" not in page
    assert "<script" not in page.lower()


@pytest.mark.parametrize("headers,expected", [
    pytest.param({"X-Forwarded-Host": "gw.example.org", "X-Forwarded-Proto": "https"}, "https://gw.example.org",
                 id="x-forwarded"),
    pytest.param({"X-Forwarded-Host": "a.example, b.example"}, "http://a.example", id="x-forwarded-first"),
    pytest.param({}, "http://127.0.0.1:", id="host-header"),
    pytest.param({"X-Forwarded-Proto": "javascript"}, "http://127.0.0.1:", id="odd-proto-ignored"),
])
async def test_r6_4_base_url_from_headers(gw, headers, expected):
    _, _, body = await raw_request(gw.url, "GET", "/", headers)
    assert expected in body.decode()


async def test_r6_4_forwarded_values_are_escaped_and_only_displayed(gw):
    evil = '"><script>alert(1)</script>'
    _, _, body = await raw_request(gw.url, "GET", "/", {"X-Forwarded-Host": evil, "Forwarded": f"host={evil}"})
    page = body.decode()
    assert "<script>" not in page and "alert(1)" not in page


async def test_r6_2_keys_from_the_cli_apply_to_a_running_router(start_router, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr("llmgw.control.feed.keyrefresh.KEY_REFRESH_SECONDS", 0.05)
    state = tmp_path / "state"
    gw = await start_router(CATALOG, store_path=state / "state.db")
    runner = CliRunner()
    created = runner.invoke(cli, ["keys", "create", "carol", "--models", "secret-model-name",
                                  "--state-dir", str(state)])
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip().splitlines()[0]
    assert secret.startswith("sk-llmgw-")

    async def accepted():
        async with gw.client(secret) as client:
            try:
                return [m.id async for m in client.models.list()] == ["secret-model-name"]
            except openai.AuthenticationError:
                return False
    await apoll(accepted, what="the new key to be accepted")

    listed = runner.invoke(cli, ["keys", "list", "--json", "--state-dir", str(state)])
    carol = next(k for k in json.loads(listed.stdout) if k["name"] == "carol")
    assert carol["models"] == ["secret-model-name"] and carol["revoked_at"] is None
    assert secret not in listed.stdout

    # last_used_at is written in the background, in batches
    def used():
        rows = json.loads(runner.invoke(cli, ["keys", "list", "--json", "--state-dir", str(state)]).stdout)
        return next(k for k in rows if k["name"] == "carol")["last_used_at"]
    await apoll(used, what="last_used_at of the key")

    revoked = runner.invoke(cli, ["keys", "revoke", "carol", "--state-dir", str(state)])
    assert revoked.exit_code == 0, revoked.output

    async def refused():
        async with gw.client(secret) as client:
            try:
                await client.models.list()
            except openai.AuthenticationError as exc:
                return exc.code == "invalid_api_key"  # a revoked key is no longer published
            return False
    await apoll(refused, what="the revoked key to be refused")
