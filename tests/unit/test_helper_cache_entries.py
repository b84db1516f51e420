"""Which cache entries count as fetched weights (R-2.6, R-5.2): a real directory of the helper's
user, holding only that user's files, with a completion marker sealed by the fleet secret over
every file's size and SHA-256; and what a launch checks of their content (R-5.6)."""

import hashlib
import json
import os

import pytest

from tests.helper.client import load_helper, write_sealed_marker

helper = load_helper()
SECRET = "e1" * 32
NAME = "llmgw-" + "0123456789abcdef" * 2
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root")


def _files(entry):
    (entry / "sub").mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"w" * 1000)
    (entry / "sub" / "config.json").write_bytes(b"{}")
    return entry


def _marker(entry):
    return json.loads((entry / ".llmgw-complete").read_text())


def test_a_sealed_entry_counts(tmp_path):
    entry = _files(tmp_path / NAME)
    write_sealed_marker(entry, SECRET)
    assert helper.cache_entry(str(entry), SECRET) == (1002, None)
    assert helper.weights_bytes(str(entry), SECRET) == 1002


def test_a_seal_made_with_another_secret_does_not(tmp_path):
    entry = _files(tmp_path / NAME)
    write_sealed_marker(entry, "0f" * 32)
    size, why = helper.cache_entry(str(entry), SECRET)
    assert size is None and "not sealed by this fleet" in why


def test_a_seal_names_the_entry(tmp_path):
    other = _files(tmp_path / ("llmgw-" + "f" * 32))
    write_sealed_marker(other, SECRET)
    os.rename(other, tmp_path / NAME)  # a sealed entry of another source, renamed
    assert helper.cache_entry(str(tmp_path / NAME), SECRET)[0] is None


def test_files_changed_after_the_seal_do_not_count(tmp_path):
    entry = _files(tmp_path / NAME)
    write_sealed_marker(entry, SECRET)
    (entry / "model.safetensors").write_bytes(b"w" * 999)
    assert helper.cache_entry(str(entry), SECRET)[0] is None


def test_without_a_secret_nothing_counts(tmp_path):
    entry = _files(tmp_path / NAME)
    write_sealed_marker(entry, SECRET)
    size, why = helper.cache_entry(str(entry), None)
    assert size is None and "no fleet secret" in why


def test_a_link_to_a_sealed_entry_does_not_count(tmp_path):
    real = _files(tmp_path / "elsewhere" / NAME)
    write_sealed_marker(real, SECRET)
    (tmp_path / "cache").mkdir()
    os.symlink(real, tmp_path / "cache" / NAME)
    size, why = helper.cache_entry(str(tmp_path / "cache" / NAME), SECRET)
    assert size is None and "symbolic link" in why


@pytest.mark.parametrize("how", ["link-inside", "group-writable-file", "group-writable-dir", "entry-open"])
def test_an_entry_others_could_change_does_not_count(tmp_path, how):
    entry = _files(tmp_path / NAME)
    write_sealed_marker(entry, SECRET)
    if how == "link-inside":
        os.symlink("/etc/passwd", entry / "sub" / "extra")
    elif how == "group-writable-file":
        os.chmod(entry / "model.safetensors", 0o664)
    elif how == "group-writable-dir":
        os.chmod(entry / "sub", 0o775)
    else:
        os.chmod(entry, 0o777)
    size, why = helper.cache_entry(str(entry), SECRET)
    assert size is None and "not llmgw's" in why, why


@root_only
def test_a_directory_another_user_planted_never_counts(tmp_path):
    entry = _files(tmp_path / NAME)
    (entry / ".llmgw-complete").write_text(json.dumps({"name": NAME, "bytes": 1002, "files": 2}))
    for path in (entry, entry / "sub", entry / "model.safetensors", entry / "sub" / "config.json",
                 entry / ".llmgw-complete"):
        os.chown(path, 4242, 4242)
    size, why = helper.cache_entry(str(entry), SECRET)
    assert size is None and "uid 4242" in why
    assert "seal" not in _marker(entry), "never sealed on someone else's behalf"


@pytest.mark.parametrize("old", [
    pytest.param({"name": NAME, "source": {}, "bytes": 1002, "files": 2, "finished_at": 1.0}, id="unsealed"),
    pytest.param({"format": 2, "name": NAME, "bytes": 1002, "files": 2, "seal": "ab" * 32}, id="sealed-over-sizes"),
])
def test_a_marker_from_before_content_hashes_does_not_count_and_is_left_as_it_is(tmp_path, old):
    """Hashing such an entry now and sealing the result would trust whatever a node wrote into
    it before: it is fetched again instead (the fetch replaces it)."""
    entry = _files(tmp_path / NAME)
    (entry / ".llmgw-complete").write_text(json.dumps(old))
    size, why = helper.cache_entry(str(entry), SECRET)
    assert size is None and "predates content hashes" in why and "fetched again" in why
    assert _marker(entry) == old


def test_a_marker_that_leaves_a_file_without_a_hash_does_not_count(tmp_path):
    entry = _files(tmp_path / NAME)
    marker = write_sealed_marker(entry, SECRET)
    del marker["sha256"]["sub/config.json"]
    (entry / ".llmgw-complete").write_text(json.dumps(marker))
    size, why = helper.cache_entry(str(entry), SECRET)
    assert size is None and "no SHA-256 for sub/config.json" in why


def test_the_seal_covers_the_hashes(tmp_path):
    entry = _files(tmp_path / NAME)
    marker = write_sealed_marker(entry, SECRET)
    marker["sha256"]["model.safetensors"] = hashlib.sha256(b"other weights").hexdigest()
    (entry / ".llmgw-complete").write_text(json.dumps(marker))
    assert helper.cache_entry(str(entry), SECRET)[0] is None


# --------------------------------------------------------------------------------------------
# What a launch checks of an entry's content (Node.verify_weights)

BIG = helper.ALWAYS_VERIFIED_BYTES + 1


def _big_entry(cache):
    entry = cache / NAME
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"w" * BIG)
    (entry / "config.json").write_bytes(b"{}")
    (entry / "modeling_x.py").write_bytes(b"x = 1\n")
    write_sealed_marker(entry, SECRET)
    return entry


def _node(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700, exist_ok=True)
    (root / "fleet.key").write_text(SECRET + "\n")
    os.chmod(root / "fleet.key", 0o600)
    return helper.Node(str(root), str(tmp_path / "helper.py"))


def test_a_big_file_is_hashed_again_only_when_it_changed(tmp_path):
    entry = _big_entry(tmp_path / "cache")
    node = _node(tmp_path)
    argv = ["vllm", "serve", "--model=" + str(entry), "--port", "8000"]
    node.verified.verify_weights(argv)
    assert node.verified.files_hashed == 3, "every file, the first time on this node"
    record = json.loads((tmp_path / "root" / node.verified._verified_file()).read_text())
    assert list(record["files"]) == [str(entry / "model.safetensors")], "only big files are recorded"
    node.verified.verify_weights(argv)
    assert node.verified.files_hashed == 3 + 2, "code and configuration again, not the unchanged big file"
    fresh = _node(tmp_path)  # a restarted helper reads the record
    fresh.verified.verify_weights(argv)
    assert fresh.verified.files_hashed == 2
    os.utime(entry / "model.safetensors")  # a changed stamp: hashed again
    fresh.verified.verify_weights(argv)
    assert fresh.verified.files_hashed == 2 + 3


def test_a_file_rewritten_with_the_same_size_is_refused_and_kept(tmp_path):
    entry = _big_entry(tmp_path / "cache")
    node = _node(tmp_path)
    argv = ["llama-server", "--model", str(entry / "model.safetensors")]
    node.verified.verify_weights(argv)
    before = os.stat(entry / "model.safetensors")
    with open(entry / "model.safetensors", "r+b") as handle:
        handle.write(b"poison")
    os.utime(entry / "model.safetensors", ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back
    with pytest.raises(helper.HelperError) as refused:
        node.verified.verify_weights(argv)
    assert refused.value.kind == "weights_integrity"
    assert str(entry / "model.safetensors") in refused.value.message
    assert hashlib.sha256(b"w" * BIG).hexdigest() in refused.value.message
    assert (entry / "model.safetensors").stat().st_size == BIG
    record = json.loads((tmp_path / "root" / node.verified._verified_file()).read_text())
    assert record["files"] == {}, "a file that failed is not remembered as verified"


def test_a_launch_naming_no_cache_entry_hashes_nothing(tmp_path):
    node = _node(tmp_path)
    (tmp_path / "models").mkdir()
    node.verified.verify_weights(["vllm", "serve", str(tmp_path / "models"), "--served-model-name", "llmgw-" + "0" * 16])
    assert node.verified.files_hashed == 0


def test_files_whose_walked_stamp_was_verified_are_not_opened_and_a_changed_one_is(tmp_path, monkeypatch):
    """An environment's launch check (R-4.11): the manifest walk's lstat stamps stand for opening
    each file when they are the ones recorded; a rewritten file (a new ctime) is opened and hashed."""
    entry = _files(tmp_path / NAME)
    files = [("model.safetensors", 1000), ("sub/config.json", 2)]
    hashes = {rel: hashlib.sha256((entry / rel).read_bytes()).hexdigest() for rel, _ in files}

    def walked():
        stamps = {}
        assert helper.entry_manifest(str(entry), os.getuid(), stamps=stamps)[0] == files
        return {"files": files, "hashes": hashes, "stamps": stamps}

    verified = {}
    assert helper.verify_entry_content(str(entry), walked(), verified, always=helper.never_rehashed) == (
        None, ["model.safetensors", "sub/config.json"])
    opened = []
    real_open_below = helper.open_below
    monkeypatch.setattr(helper, "open_below", lambda top, parts, *a, **kw: opened.append(parts) or
                        real_open_below(top, parts, *a, **kw))
    assert helper.verify_entry_content(str(entry), walked(), verified, always=helper.never_rehashed) == (None, [])
    assert opened == [], "nothing opened: every walked stamp is the recorded one"
    (entry / "sub" / "config.json").write_bytes(b"[]")  # the same size, a new ctime
    problem, hashed = helper.verify_entry_content(str(entry), walked(), verified, always=helper.never_rehashed)
    assert opened == [["sub", "config.json"]] and hashed == ["sub/config.json"]
    assert "sub/config.json has SHA-256" in problem and hashes["sub/config.json"] in problem


def test_provision_answers_a_seal_it_found_unchanged_without_walking_the_environment(tmp_path, monkeypatch):
    """R-4.11: an environment this helper found sealed, its seal file in the same state, is
    answered from the seal file; once the seal file changed (a launch touches it), it is walked."""
    import types

    node = _node(tmp_path)
    recipe = {"python": "/usr/bin/python3", "version": "3.11.0", "packages": ["probe==1"]}
    recipe_id = hashlib.sha256(helper.canonical_json(recipe).encode("utf-8")).hexdigest()
    path = os.path.join(node.venvs.envs_dir(), helper.env_name(recipe_id))
    os.makedirs(os.path.join(path, "bin"), mode=0o700)
    os.chmod(node.venvs.envs_dir(), 0o700)
    with open(os.path.join(path, "bin", "engine"), "w") as handle:
        handle.write("#!/bin/sh\n")
    with open(os.path.join(path, helper.ENV_BUILDING_MARKER), "w") as handle:
        handle.write("{}")
    job = types.SimpleNamespace(path=path, name=os.path.basename(path), key=recipe_id, recipe=recipe,
                                abort=types.SimpleNamespace(is_set=lambda: False))
    node.venvs._seal_env(job, "pip")
    assert helper.env_state(path, SECRET)[0] == "sealed"
    assert node.venvs.env_built(path) is True  # walked once, remembered for this state of the seal file

    def no_walk(*_):
        raise AssertionError("walked")

    monkeypatch.setattr(helper, "env_state", no_walk)
    state, found = node.venvs.env_found(path)
    assert state == "sealed" and found["marker"]["id"] == recipe_id and found["bytes"] == 10
    helper._touch_marker(path)  # what a launch does: the seal file's state changed
    with pytest.raises(AssertionError, match="walked"):
        node.venvs.env_found(path)
