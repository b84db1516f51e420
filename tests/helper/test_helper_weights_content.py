"""Weights are checked by content, not by seal alone (R-5.6): a fetch hashes every file as it
streams in and checks a hub file against the hash the hub publishes; the sealed marker carries
the hashes; a launch hashes what it is about to load and refuses what was changed or planted.
Real helpers over their protocol, a local HTTPS server for the source and the hub."""

import hashlib
import json
import os

import pytest

from tests.helper.client import HelperClient, install_helper, load_helper, write_sealed_marker
from tests.helper.conftest import Route, keep_fleet_secret

NAME = "llmgw-" + "c0de" * 8
BIG = load_helper().ALWAYS_VERIFIED_BYTES + 4096  # re-hashed only when it changed


def _git_blob(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub(server, files, lie=None):
    """Publish org/m at main as the hub does with ?blobs=true: config files kept in git (their
    blob id), weights in LFS (their SHA-256). lie: {name: hash} published instead of the truth."""
    siblings = []
    for name, body in files.items():
        sibling = {"rfilename": name, "size": len(body)}
        if name.endswith(".safetensors"):
            sibling["blobId"] = hashlib.sha1(name.encode()).hexdigest()  # the pointer's, never checked
            sibling["lfs"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body), "pointerSize": 134}
        else:
            sibling["blobId"] = _git_blob(body)
        if lie and name in lie:
            if "lfs" in sibling:
                sibling["lfs"]["sha256"] = lie[name]
            else:
                sibling["blobId"] = lie[name]
        siblings.append(sibling)
    server.routes["/api/models/org/m/revision/main"] = Route(json.dumps({"siblings": siblings}).encode())
    for name, body in files.items():
        server.routes["/org/m/resolve/main/" + name] = Route(body)
    return {"kind": "hf", "repo": "org/m", "revision": "main", "endpoint": server.url("")}


def _other_node(tmp_path, label, secret, env):
    """Another node's helper of the same fleet: its own root, the same secret."""
    root = tmp_path / label
    path, sha = install_helper(root)
    os.chmod(root, 0o700)
    keep_fleet_secret(root, secret)
    client = HelperClient(path, sha, root, env=env)
    client.wait_hello()
    return client


def _launch(helper, engines, shard_id, weights):
    return helper.request("launch", {"shard_id": shard_id, "argv": engines.argv("sleep_engine.py", "--model", weights)},
                          timeout=60)


def test_hub_hashes_are_checked_and_sealed_in_the_marker(start_helper, tls_env, https_server, tmp_path):
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(64 * 1024)}
    source = _hub(https_server, files)
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    assert helper.call("fetch", {"source": source, "cache_dir": str(cache), "name": NAME})["bytes"] == sum(
        len(body) for body in files.values())
    marker = json.loads((cache / NAME / ".llmgw-complete").read_text())
    assert marker["format"] == 3
    assert marker["sha256"] == {name: hashlib.sha256(body).hexdigest() for name, body in files.items()}


@pytest.mark.parametrize("liar", [pytest.param("model.safetensors", id="lfs-sha256"),
                                  pytest.param("config.json", id="git-blob-id")])
def test_an_hf_file_that_does_not_match_the_hubs_hash_fails_the_fetch(start_helper, tls_env, https_server, tmp_path,
                                                                       liar):
    files = {"config.json": b"{}", "model.safetensors": os.urandom(32 * 1024)}
    published = "ab" * 32 if liar.endswith(".safetensors") else "cd" * 20
    source = _hub(https_server, files, lie={liar: published})
    helper = start_helper(env=tls_env)
    cache = tmp_path / "cache"
    answer = helper.request("fetch", {"source": source, "cache_dir": str(cache), "name": NAME})
    assert answer["ok"] is False and answer["error"]["kind"] == "weights_integrity", answer
    message = answer["error"]["message"]
    actual = hashlib.sha256(files[liar]).hexdigest() if liar.endswith(".safetensors") else _git_blob(files[liar])
    assert liar in message and published in message and actual in message, message
    assert os.listdir(cache) == [], "no entry, sealed or not, and no temp dir"


def test_a_file_rewritten_in_place_on_a_shared_cache_is_refused_at_the_next_launch(
        start_helper, installed, tls_env, https_server, tmp_path, engines):
    """Node A fetches onto the filer; node B launches from it without a second download; then
    code on some node rewrites the file in place, same size, and even puts its mtime back: the
    next launch on B refuses it, naming the file, and removes nothing."""
    body = os.urandom(BIG)
    https_server.routes["/model.gguf"] = Route(body)
    filer = tmp_path / "filer"
    node_a = start_helper(env=tls_env)
    fetch = {"source": {"kind": "https", "urls": [https_server.url("/model.gguf")]}, "cache_dir": str(filer),
             "name": NAME}
    weights = node_a.call("fetch", fetch)["file"]
    entry = os.path.dirname(weights)
    wanted = {"candidates": {"m": [entry]}}
    assert node_a.call("holdings", wanted)["held"]["m"]["verified"] is True, "hashed as it was downloaded"
    node_b = _other_node(tmp_path, "node-b", installed.secret, tls_env)
    try:
        assert node_b.call("holdings", wanted)["held"]["m"]["verified"] is False, "never hashed on node B"
        checked = node_b.send("fetch", fetch)
        assert node_b.answer(checked)["result"]["file"] == weights
        assert [event for event, _ in node_b.events_of(checked)] and \
            {event for event, _ in node_b.events_of(checked)} == {"checking"}, "checked, not downloaded"
        assert node_b.call("holdings", wanted)["held"]["m"]["verified"] is True
        launched = _launch(node_b, engines, "first", weights)
        assert launched["ok"], launched
        assert https_server.gets("/model.gguf") == 1, "node B used node A's download"
        node_b.call("stop", {"shard_id": "first", "grace": 1})

        before = os.stat(weights)
        with open(weights, "r+b") as handle:
            handle.seek(BIG // 2)
            handle.write(b"\0" * 16)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(weights).st_size == before.st_size and os.stat(weights).st_mtime_ns == before.st_mtime_ns
        assert node_b.call("holdings", wanted)["held"]["m"]["verified"] is False, "its ctime changed"
        again = node_b.request("fetch", fetch)
        assert again["ok"] is False and again["error"]["kind"] == "weights_integrity", again
        assert weights in again["error"]["message"]
        refused = _launch(node_b, engines, "second", weights)
        assert refused["ok"] is False and refused["error"]["kind"] == "weights_integrity", refused
        message = refused["error"]["message"]
        assert weights in message and hashlib.sha256(body).hexdigest() in message, message
        assert "not started" in message
        assert os.path.getsize(weights) == BIG, "nothing is removed"
        # Node A, which fetched it, refuses it too.
        assert _launch(node_a, engines, "third", weights)["error"]["kind"] == "weights_integrity"
    finally:
        node_b.kill()


@pytest.mark.parametrize("how", [pytest.param("wrong-hashes", id="sealed-with-wrong-hashes"),
                                 pytest.param("no-hashes", id="sealed-without-hashes")])
def test_a_planted_entry_sealed_with_the_fleet_secret_is_refused(helper, installed, tmp_path, engines, how):
    """Code on one node holds the fleet secret: it can seal what it likes. An entry whose marker
    has no hashes, or hashes its files do not have, is never launched."""
    entry = tmp_path / "filer" / NAME
    entry.mkdir(parents=True)
    (entry / "model.gguf").write_bytes(b"poisoned" * 1024)
    (entry / "chat_template.py").write_text("import os  # runs as the engine's user\n")
    if how == "wrong-hashes":
        write_sealed_marker(entry, installed.secret,
                            hashes={"model.gguf": hashlib.sha256(b"the real weights").hexdigest()})
    else:
        module = load_helper()
        files, total, _ = module.entry_manifest(str(entry), os.getuid())
        # What a helper without content hashes wrote: its seal covers names and sizes only.
        manifest = "\n".join("%s\t%d" % item for item in files)
        seal = module.hmac.new(installed.secret.encode(), b"llmgw cache entry v2\n" + NAME.encode() + b"\n"
                               + manifest.encode(), hashlib.sha256).hexdigest()
        (entry / ".llmgw-complete").write_text(json.dumps({"format": 2, "name": NAME, "bytes": total, "files": 2,
                                                           "seal": seal}))
    answer = _launch(helper, engines, "planted", str(entry / "model.gguf"))
    assert answer["ok"] is False and answer["error"]["kind"] == "weights_integrity", answer
    message = answer["error"]["message"]
    if how == "wrong-hashes":
        assert str(entry / "model.gguf") in message and hashlib.sha256(b"poisoned" * 1024).hexdigest() in message
    else:
        assert "predates content hashes" in message and str(entry) in message
        assert helper.call("holdings", {"candidates": {"m": [str(entry)]}})["held"] == {}
    assert (entry / "model.gguf").read_bytes() == b"poisoned" * 1024, "refused, not removed"
