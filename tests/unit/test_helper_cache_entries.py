"""Which cache entries count as fetched weights (R-2.6, R-5.2): a real directory of the helper's
user, holding only that user's files, with a completion marker sealed by the fleet secret."""

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
    size, why = helper.cache_entry(str(entry), SECRET, remark=True)
    assert size is None and "uid 4242" in why
    assert "seal" not in _marker(entry), "never sealed on someone else's behalf"


def test_an_old_marker_is_sealed_once_when_the_entry_passes_the_checks(tmp_path):
    entry = _files(tmp_path / NAME)
    old = {"name": NAME, "source": {"kind": "https", "urls": ["https://x/m"]}, "bytes": 1002, "files": 2,
           "finished_at": 1.0}
    (entry / ".llmgw-complete").write_text(json.dumps(old))
    assert helper.cache_entry(str(entry), SECRET, remark=False)[0] is None, "a one-shot look writes nothing"
    assert "seal" not in _marker(entry)
    assert helper.cache_entry(str(entry), SECRET, remark=True) == (1002, None)
    sealed = _marker(entry)
    assert sealed["seal"] and sealed["source"] == old["source"] and sealed["format"] == 2
    assert helper.cache_entry(str(entry), SECRET) == (1002, None)


@pytest.mark.parametrize("old", [{}, {"name": NAME, "bytes": 5}, {"name": "llmgw-" + "9" * 32, "bytes": 1002}])
def test_an_old_marker_that_does_not_match_is_not_sealed(tmp_path, old):
    entry = _files(tmp_path / NAME)
    (entry / ".llmgw-complete").write_text(json.dumps(old))
    assert helper.cache_entry(str(entry), SECRET, remark=True)[0] is None
    assert "seal" not in _marker(entry)
