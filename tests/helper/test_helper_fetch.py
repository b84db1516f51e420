"""fetch through a real helper from a local HTTPS server (R-5.1-R-5.4), by hand and typed."""

import hashlib
import json
import os
import threading

import pytest

from llmgw.config import NodeConfig
from llmgw.fleet.errors import SourceHTTPError
from llmgw.fleet.link import LocalLink
from llmgw.fleet.ops import FetchProgress, FetchRequest, HoldingsRequest
from llmgw.fleet.secret import fleet_secret
from tests.helper.client import wait_until
from tests.helper.conftest import PROXY_VARIABLES, Route

NAME = "llmgw-" + hashlib.sha256(b"https://example.test/model.gguf").hexdigest()[:32]


def _fetch_args(server, cache_dir, paths, name=NAME, token=None):
    return {
        "source": {"kind": "https", "urls": [server.url(p) for p in paths]},
        "cache_dir": str(cache_dir),
        "name": name,
        "token": token,
    }


def _progress(events):
    return [data for event, data in events if event == "progress"]


def _leftovers(cache_dir):
    return sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []


@pytest.mark.parametrize("with_length", [pytest.param(True, id="content-length"), pytest.param(False, id="no-length")])
def test_fetch_writes_a_complete_entry_with_progress(start_helper, tls_env, https_server, tmp_path, with_length):
    body = os.urandom(3 * 1024 * 1024 + 17)
    https_server.routes["/model.gguf"] = Route(body, length=with_length)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    request_id = helper.send("fetch", _fetch_args(https_server, cache, ["/model.gguf"]))
    answer = helper.answer(request_id, timeout=60)
    assert answer["ok"], answer
    final = cache / NAME
    assert answer["result"] == {"path": str(final), "bytes": len(body), "file": str(final / "model.gguf")}
    assert (final / "model.gguf").read_bytes() == body
    assert (final / ".llmgw-complete").is_file()
    assert _leftovers(cache) == [NAME], "no temp dir left behind"
    progress = _progress(helper.events_of(request_id))
    assert progress, "progress events are streamed"
    assert progress[-1]["bytes"] == len(body)
    byte_counts = [p["bytes"] for p in progress]
    assert byte_counts == sorted(byte_counts)
    if with_length:
        assert progress[-1]["total"] == len(body)
        assert {p["total"] for p in progress} <= {None, len(body)}
    else:
        # No length from the server: "so far" only, never an invented total.
        assert all(p["total"] is None for p in progress)
    marker = json.loads((final / ".llmgw-complete").read_text())
    assert marker["bytes"] == len(body)


@pytest.mark.parametrize("path,saved_as", [
    pytest.param("/m/model.gguf", "model.gguf", id="plain"),
    pytest.param("/m/a%2Fb.gguf", "a/b.gguf", id="quoted-slash"),
    pytest.param("/m/model.gguf?x=1&sig=s", "model.gguf", id="query"),
    pytest.param("/m/models/", "download", id="trailing-slash"),
    pytest.param("/m/%2E%2E", "download", id="quoted-dot-dot"),
    pytest.param("/m/..%2F..%2Fescape.gguf", "download", id="quoted-traversal"),
    pytest.param("/m/a%2F%2Fb.gguf", "download", id="empty-part"),
    pytest.param("/m/sp%20ace%20caf%C3%A9.gguf", "sp ace caf\u00e9.gguf", id="space-and-utf8"),
])
def test_a_single_url_fetch_reports_the_file_it_saved(start_helper, tls_env, https_server, tmp_path, path, saved_as):
    """Whatever the URL's name, the answer and the holdings say where the one file is: the
    control plane hands that path to the engine instead of guessing the helper's naming."""
    body = os.urandom(4096)
    https_server.routes[path.split("?", 1)[0]] = Route(body)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    result = helper.call("fetch", _fetch_args(https_server, cache, [path]))
    final = cache / NAME
    assert result["path"] == str(final)
    assert result["file"] == str(final / saved_as)
    assert os.path.isfile(result["file"]) and open(result["file"], "rb").read() == body
    assert os.path.realpath(result["file"]).startswith(str(final) + os.sep), "inside the entry"
    held = helper.call("holdings", {"candidates": {"m": [str(final)]}})["held"]
    assert held == {"m": {"path": str(final), "bytes": len(body), "file": result["file"], "verified": True}}
    assert helper.call("fetch", _fetch_args(https_server, cache, [path]))["file"] == result["file"], \
        "answered from the disk, the same file"


def test_two_concurrent_fetches_of_one_name_download_once(start_helper, tls_env, https_server, tmp_path):
    gate = threading.Event()
    body = os.urandom(256 * 1024)
    https_server.routes["/w.bin"] = Route(body, gate=gate)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    first = helper.send("fetch", _fetch_args(https_server, cache, ["/w.bin"]))
    wait_until(lambda: https_server.gets("/w.bin") == 1, message="the download started")
    second = helper.send("fetch", _fetch_args(https_server, cache, ["/w.bin"]))
    helper.wait_events(second, lambda events: _progress(events))  # attached to the running job
    assert helper.request("ping")["ok"], "a download does not block other requests"
    gate.set()
    answers = [helper.answer(first, timeout=60), helper.answer(second, timeout=60)]
    assert answers[0]["ok"] and answers[1]["ok"]
    assert answers[0]["result"] == answers[1]["result"] == {"path": str(cache / NAME), "bytes": len(body),
                                                            "file": str(cache / NAME / "w.bin")}
    assert https_server.gets("/w.bin") == 1, "exactly one download"
    assert _progress(helper.events_of(second))[-1] == {"bytes": len(body), "total": len(body)}
    # Already complete: answered from the disk, no new download.
    assert helper.call("fetch", _fetch_args(https_server, cache, ["/w.bin"]))["bytes"] == len(body)
    assert https_server.gets("/w.bin") == 1


def test_http_error_leaves_nothing_behind(start_helper, tls_env, https_server, tmp_path):
    https_server.routes["/present.bin"] = Route(b"x" * 1000)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    answer = helper.request("fetch", _fetch_args(https_server, cache, ["/present.bin", "/missing.bin"]), timeout=60)
    assert answer["ok"] is False
    assert answer["error"]["kind"] == "http"
    assert "404" in answer["error"]["message"]
    assert https_server.url("/missing.bin") in answer["error"]["message"]
    assert _leftovers(cache) == [], "no marker, no temp dir"


def test_a_signed_urls_query_is_redacted_in_errors(start_helper, tls_env, https_server, tmp_path):
    """The query of a signed URL is a credential: reasons are shown and stored, the query never is."""
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    answer = helper.request("fetch", _fetch_args(https_server, cache, ["/missing.bin?X-Amz-Signature=s3cr3t"]),
                            timeout=60)
    assert answer["ok"] is False and "404" in answer["error"]["message"]
    assert https_server.url("/missing.bin?<redacted>") in answer["error"]["message"]
    assert "s3cr3t" not in json.dumps(answer)
    assert https_server.gets("/missing.bin") == 1, "the real URL, query and all, was fetched"


def test_disk_full_is_reported_and_cleaned_up(start_helper, tls_env, https_server, small_tmpfs):
    body = os.urandom(3 * 1024 * 1024)
    https_server.routes["/big.bin"] = Route(body)
    helper = start_helper(env=tls_env)
    answer = helper.request("fetch", _fetch_args(https_server, small_tmpfs, ["/big.bin"]), timeout=60)
    assert answer["ok"] is False
    assert answer["error"]["kind"] == "disk_full"
    message = answer["error"]["message"]
    assert str(small_tmpfs) in message and "bytes" in message
    assert _leftovers(small_tmpfs) == [], "no marker, temp dir removed"


def test_cancelling_the_only_waiter_abandons_the_download(start_helper, tls_env, https_server, tmp_path):
    gate = threading.Event()
    https_server.routes["/slow.bin"] = Route(os.urandom(64 * 1024), gate=gate)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    request_id = helper.send("fetch", _fetch_args(https_server, cache, ["/slow.bin"]))
    wait_until(lambda: https_server.gets("/slow.bin") == 1, message="the download started")
    assert any(name.startswith(".tmp-" + NAME) for name in _leftovers(cache))
    assert helper.call("cancel", {"target": request_id}) == {"cancelled": True}
    answer = helper.answer(request_id)
    assert answer["ok"] is False and answer["error"]["kind"] == "cancelled"
    gate.set()
    wait_until(lambda: _leftovers(cache) == [], message="temp dir removed")


def test_a_fetch_after_an_abandoned_one_starts_afresh(start_helper, tls_env, https_server, tmp_path):
    gate = threading.Event()
    body = os.urandom(32 * 1024)
    https_server.routes["/again.bin"] = Route(body, gate=gate)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    first = helper.send("fetch", _fetch_args(https_server, cache, ["/again.bin"]))
    wait_until(lambda: https_server.gets("/again.bin") == 1, message="the first download started")
    helper.call("cancel", {"target": first})
    assert helper.answer(first)["error"]["kind"] == "cancelled"
    second = helper.send("fetch", _fetch_args(https_server, cache, ["/again.bin"]))
    wait_until(lambda: https_server.gets("/again.bin") == 2, message="a fresh download started")
    gate.set()
    answer = helper.answer(second, timeout=60)
    assert answer["ok"], answer
    assert (cache / NAME / "again.bin").read_bytes() == body
    wait_until(lambda: _leftovers(cache) == [NAME], message="the abandoned temp dir removed")


@pytest.mark.parametrize(
    "change, fragment",
    [
        pytest.param({"name": "models-1234567890abcdef"}, "name", id="name-without-prefix"),
        pytest.param({"name": "llmgw-../../etc"}, "name", id="name-traversal"),
        pytest.param({"name": "llmgw-ABCDEF1234567890"}, "name", id="name-uppercase"),
        pytest.param({"name": "llmgw-1234"}, "name", id="name-too-short"),
        pytest.param({"source": {"kind": "https", "urls": ["http://127.0.0.1/x"]}}, "https", id="plain-http"),
        pytest.param({"source": {"kind": "https", "urls": []}}, "URL", id="no-urls"),
        pytest.param({"source": {"kind": "ftp", "urls": ["ftp://x/y"]}}, "kind", id="unknown-kind"),
        pytest.param({"source": {"kind": "hf", "repo": "../etc"}}, "repo", id="hf-bad-repo"),
        pytest.param({"source": {"kind": "hf", "repo": "o/m", "endpoint": "http://hub"}}, "https", id="hf-http-endpoint"),
        pytest.param({"cache_dir": "relative/cache"}, "absolute", id="relative-cache"),
    ],
)
def test_bad_fetch_requests_are_refused(helper, tmp_path, change, fragment):
    cache = tmp_path / "cache"
    cache.mkdir()
    args = {"source": {"kind": "https", "urls": ["https://127.0.0.1/x"]}, "cache_dir": str(cache), "name": NAME}
    args.update(change)
    answer = helper.request("fetch", args)
    assert answer["ok"] is False and answer["error"]["kind"] == "bad_args"
    assert fragment in answer["error"]["message"]
    assert os.listdir(cache) == []


def test_hugging_face_source_with_token(start_helper, tls_env, https_server, tmp_path):
    token = "hf_%s" % os.urandom(12).hex()
    config = b'{"model_type": "llama"}'
    weights = os.urandom(300 * 1024)
    https_server.routes["/api/models/org/model/revision/main"] = Route(
        json.dumps({"siblings": [{"rfilename": "config.json"}, {"rfilename": "weights/model.safetensors"}]}).encode()
    )
    https_server.routes["/org/model/resolve/main/config.json"] = Route(config)
    # The hub sends big files elsewhere (a CDN, another host): the token must not follow.
    cdn_path = "/cdn/blob-123"
    https_server.routes["/org/model/resolve/main/weights/model.safetensors"] = Route(
        redirect=https_server.url(cdn_path, host="localhost")
    )
    https_server.routes[cdn_path] = Route(weights)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    args = {
        "source": {"kind": "hf", "repo": "org/model", "revision": "main", "endpoint": https_server.url("")},
        "cache_dir": str(cache),
        "name": NAME,
        "token": token,
    }
    request_id = helper.send("fetch", args)
    answer = helper.answer(request_id, timeout=60)
    assert answer["ok"], answer
    total = len(config) + len(weights)
    assert answer["result"] == {"path": str(cache / NAME), "bytes": total, "file": None}  # two files
    assert (cache / NAME / "config.json").read_bytes() == config
    assert (cache / NAME / "weights" / "model.safetensors").read_bytes() == weights
    # Every file's length was known beforehand, so the total is too.
    assert _progress(helper.events_of(request_id))[-1] == {"bytes": total, "total": total}
    bearer = "Bearer " + token
    assert set(https_server.auth["/api/models/org/model/revision/main"]) == {bearer}
    assert set(https_server.auth["/org/model/resolve/main/config.json"]) == {bearer}
    assert set(https_server.auth[cdn_path]) == {None}
    assert helper.close() == 0
    everything = json.dumps(helper.lines) + "".join(helper.stderr_lines)
    assert token not in everything
    assert token not in (cache / NAME / ".llmgw-complete").read_text()


def test_hub_refusal_names_status_and_url_without_the_token(start_helper, tls_env, https_server, tmp_path):
    token = "hf_%s" % os.urandom(12).hex()
    https_server.routes["/api/models/org/gated/revision/main"] = Route(b"{}", status=403)
    helper = start_helper(env=tls_env)
    args = {
        "source": {"kind": "hf", "repo": "org/gated", "revision": "main", "endpoint": https_server.url("")},
        "cache_dir": str(tmp_path / "cache"),
        "name": NAME,
        "token": token,
    }
    answer = helper.request("fetch", args, timeout=60)
    assert answer["error"]["kind"] == "http"
    assert "403" in answer["error"]["message"] and "/api/models/org/gated/revision/main" in answer["error"]["message"]
    assert token not in json.dumps(answer)
    assert _leftovers(tmp_path / "cache") == []


def test_untrusted_certificate_is_refused(helper, https_server, tmp_path):
    # This helper was started without SSL_CERT_FILE pointing at the test CA.
    https_server.routes["/x.bin"] = Route(b"x")
    answer = helper.request("fetch", _fetch_args(https_server, tmp_path / "cache", ["/x.bin"]), timeout=60)
    assert answer["ok"] is False and answer["error"]["kind"] == "network"
    assert "CERTIFICATE" in answer["error"]["message"].upper()
    assert _leftovers(tmp_path / "cache") == []


def test_reclaim_refuses_an_entry_being_downloaded(start_helper, tls_env, https_server, tmp_path):
    gate = threading.Event()
    https_server.routes["/w.bin"] = Route(b"w" * 1024, gate=gate)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    request_id = helper.send("fetch", _fetch_args(https_server, cache, ["/w.bin"]))
    wait_until(lambda: https_server.gets("/w.bin") == 1, message="the download started")
    listing = helper.call("reclaim", {"cache_dir": str(cache), "names": None})
    assert listing["entries"] == [], "the running download's temp dir is not a leftover"
    temp = next(name for name in os.listdir(cache) if name.startswith(".tmp-"))
    collected = helper.call("reclaim", {"cache_dir": str(cache), "names": [NAME, temp], "collect": True})
    assert [(e["action"], e["reason"]) for e in collected["entries"]] == [
        ("refused", "in use by a running download"),
        ("refused", "in use by a running download"),
    ]
    gate.set()
    assert helper.answer(request_id, timeout=60)["ok"]
    collected = helper.call("reclaim", {"cache_dir": str(cache), "names": [NAME], "collect": True})
    assert collected["entries"][0]["action"] == "removed"
    assert _leftovers(cache) == []


async def test_a_typed_fetch_over_a_link_streams_progress_and_names_its_file(
        https_server, tls_cert, tmp_path, monkeypatch):
    """The control plane's side: NodeOps over a real link (a local helper, the SSH protocol)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_cert.cert))  # inherited by the helper the link starts
    body = os.urandom(1024 * 1024 + 3)
    https_server.routes["/m/models/"] = Route(body)
    link = LocalLink(NodeConfig(name="local", connection="local"), tmp_path / "node",
                     fleet_secret=fleet_secret(tmp_path / "state"))
    link.start()
    cache = str(tmp_path / "cache")
    try:
        assert await link.wait_ready(60), link.reason
        request = FetchRequest({"kind": "https", "urls": [https_server.url("/m/models/")]}, cache, NAME,
                               max_bytes=2 * len(body))
        async with link.ops.fetch(request) as stream:
            progress = [event async for event in stream]
        assert progress and all(isinstance(p, FetchProgress) for p in progress)
        assert progress[-1] == FetchProgress(len(body), len(body))
        fetched = stream.result
        assert (fetched.path, fetched.bytes) == (os.path.join(cache, NAME), len(body))
        assert fetched.file == os.path.join(cache, NAME, "download")  # the URL names no file
        assert open(fetched.file, "rb").read() == body
        holdings = await link.ops.holdings(HoldingsRequest({"m": [fetched.path]}))
        assert holdings.held["m"].file == fetched.file
        missing = FetchRequest({"kind": "https", "urls": [https_server.url("/m/missing.gguf")]}, cache,
                               "llmgw-" + "1" * 32)
        with pytest.raises(SourceHTTPError, match="404"):
            async with link.ops.fetch(missing) as stream:
                async for _ in stream:
                    pass
    finally:
        await link.close()
