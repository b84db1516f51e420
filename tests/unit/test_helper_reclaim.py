"""Reclaim safety on real files (R-5.5): llmgw removes only what it fetched, inside its own cache
directory, and never follows a symbolic link."""

import os
import time

import pytest

from tests.helper.client import load_helper, write_sealed_marker

helper = load_helper()
SECRET = "cd" * 32

NAME = "llmgw-" + "0123456789abcdef" * 2


def _entry(cache, name=NAME, complete=True):
    entry = cache / name
    (entry / "sub").mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"w" * 1000)
    (entry / "sub" / "config.json").write_bytes(b"{}")
    if complete:
        write_sealed_marker(entry, SECRET)
    return entry


def _age(path, seconds=3600):
    """Make a temp dir look as old as an interrupted download's (a young one may be starting)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def layout(tmp_path):
    """A cache directory and, beside it, files that belong to someone else."""
    cache = tmp_path / "cache"
    cache.mkdir()
    outside = tmp_path / "outside"
    (outside / "precious").mkdir(parents=True)
    (outside / "precious" / "data.bin").write_bytes(b"keep me")
    (outside / "file.txt").write_text("keep me too")
    return cache, outside


def _snapshot(path):
    found = {}
    for root, dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as handle:
                found[full] = handle.read()
    return found


def _collect(cache, names):
    return helper.reclaim_entries(str(cache), names, collect=True)


def test_a_legitimate_entry_is_removed(layout):
    cache, outside = layout
    _entry(cache)
    marker = (cache / NAME / ".llmgw-complete").stat().st_size
    before = _snapshot(outside)
    [entry] = _collect(cache, [NAME])
    assert entry["action"] == "removed" and entry["reason"] is None
    assert entry["bytes"] == 1000 + 2 + marker
    assert entry["path"] == str(cache / NAME)
    assert not (cache / NAME).exists()
    assert cache.is_dir(), "the cache root itself stays"
    assert _snapshot(outside) == before


def test_a_symlinked_entry_pointing_out_of_the_cache_is_refused(layout):
    cache, outside = layout
    os.symlink(outside / "precious", cache / NAME)
    [entry] = _collect(cache, [NAME])
    assert entry["action"] == "refused"
    assert "outside the cache" in entry["reason"]
    assert (outside / "precious" / "data.bin").read_bytes() == b"keep me"
    assert os.path.islink(cache / NAME)


def test_a_symlinked_entry_pointing_inside_the_cache_is_refused(layout):
    cache, _ = layout
    other = _entry(cache, "llmgw-" + "f" * 16)
    os.symlink(other, cache / NAME)
    [entry] = _collect(cache, [NAME])
    assert entry["action"] == "refused" and "symbolic link" in entry["reason"]
    assert (other / "model.safetensors").exists()


def test_a_link_inside_an_entry_is_removed_as_a_link_and_its_target_survives(layout):
    cache, outside = layout
    entry_dir = _entry(cache)
    os.symlink(outside / "precious", entry_dir / "linked-dir")
    os.symlink(outside / "file.txt", entry_dir / "sub" / "linked-file")
    before = _snapshot(outside)
    [entry] = _collect(cache, [NAME])
    assert entry["action"] == "removed"
    assert not entry_dir.exists()
    assert _snapshot(outside) == before


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("../outside", id="dotdot-traversal"),
        pytest.param("llmgw-0123456789abcdef/../../outside", id="traversal-after-prefix"),
        pytest.param("..", id="parent"),
        pytest.param(".", id="cache-root-dot"),
        pytest.param("", id="empty"),
        pytest.param("/tmp", id="absolute"),
        pytest.param("outside", id="no-cache-pattern"),
        pytest.param("models-0123456789abcdef", id="someone-elses-dir"),
        pytest.param("llmgw-0123", id="too-short"),
        pytest.param("llmgw-0123456789ABCDEF", id="uppercase-hex"),
        pytest.param(NAME + "\n", id="trailing-newline"),
        pytest.param("llmgw-0123456789abcdeg", id="not-hex"),
    ],
)
def test_names_outside_the_pattern_are_refused_and_nothing_is_touched(layout, tmp_path, name):
    cache, outside = layout
    _entry(cache)
    (cache / "models-0123456789abcdef").mkdir()
    (cache / "models-0123456789abcdef" / "x").write_text("operator's")
    before_outside = _snapshot(outside)
    before_cache = _snapshot(cache)
    [entry] = _collect(cache, [name])
    assert entry["action"] == "refused" and entry["reason"]
    assert _snapshot(outside) == before_outside
    assert _snapshot(cache) == before_cache
    assert cache.is_dir()


def test_the_cache_root_itself_is_never_removed(layout):
    cache, _ = layout
    _entry(cache)
    assert helper.reclaim_refusal(str(cache), ".") is not None
    assert helper.reclaim_refusal(str(cache), "") is not None
    # Even a name that resolves back to the root through a link is refused.
    os.symlink(".", cache / NAME.replace("0", "1"))
    [entry] = _collect(cache, [NAME.replace("0", "1")])
    assert entry["action"] == "refused"
    assert (cache / NAME).is_dir()


def test_a_symlinked_cache_root_is_refused(layout, tmp_path):
    cache, _ = layout
    _entry(cache)
    link = tmp_path / "cache-link"
    os.symlink(cache, link)
    [entry] = helper.reclaim_entries(str(link), [NAME], collect=True)
    assert entry["action"] == "refused" and "symbolic link" in entry["reason"]
    assert (cache / NAME / "model.safetensors").exists()


def test_a_cache_root_that_is_a_file_is_refused(tmp_path):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("x")
    [entry] = _collect(not_a_dir, [NAME])
    assert entry["action"] == "refused" and "not a directory" in entry["reason"]
    assert not_a_dir.read_text() == "x"


def test_a_missing_entry_is_refused_as_not_present(layout):
    cache, _ = layout
    [entry] = _collect(cache, [NAME])
    assert entry == {"name": NAME, "path": str(cache / NAME), "bytes": None, "action": "refused", "reason": "not present"}


def test_an_entry_in_use_is_refused(layout):
    cache, _ = layout
    _entry(cache)
    [entry] = helper.reclaim_entries(str(cache), [NAME], collect=True, busy={NAME})
    assert entry["action"] == "refused" and entry["reason"] == "in use by a running download"
    assert (cache / NAME).exists()


def test_refusals_are_per_path(layout):
    cache, outside = layout
    _entry(cache)
    entries = _collect(cache, ["../outside", NAME, "llmgw-" + "9" * 16])
    assert [e["action"] for e in entries] == ["refused", "removed", "refused"]
    assert (outside / "file.txt").exists()


def test_a_mount_point_inside_an_entry_is_not_crossed(layout, monkeypatch):
    cache, _ = layout
    entry_dir = _entry(cache)
    real_stat = os.stat
    sub_ino = os.lstat(entry_dir / "sub").st_ino

    def fake_stat(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        if info.st_ino == sub_ino:
            fields = list(info)
            fields[2] = info.st_dev + 1  # st_dev: as if another filesystem were mounted there
            return os.stat_result(fields)
        return info

    monkeypatch.setattr(helper.os, "stat", fake_stat)
    [entry] = _collect(cache, [NAME])
    assert entry["action"] == "refused" and "another filesystem" in entry["reason"]
    assert (entry_dir / "sub" / "config.json").exists()


def test_listing_shows_cache_entries_and_leftover_temp_dirs_only(layout):
    cache, outside = layout
    _entry(cache)
    _entry(cache, "llmgw-" + "a" * 16, complete=False)
    (cache / (".tmp-llmgw-" + "b" * 16 + "-x1y2z3")).mkdir()
    _age(cache / (".tmp-llmgw-" + "b" * 16 + "-x1y2z3"))
    (cache / "operator-model").mkdir()
    (cache / "README").write_text("hello")
    os.symlink(outside, cache / ("llmgw-" + "c" * 16))
    entries = helper.reclaim_entries(str(cache), None, collect=False, secret=SECRET)
    by_name = {e["name"]: e for e in entries}
    assert set(by_name) == {NAME, "llmgw-" + "a" * 16, ".tmp-llmgw-" + "b" * 16 + "-x1y2z3", "llmgw-" + "c" * 16}
    assert all(e["action"] == "listed" for e in entries)
    marker = (cache / NAME / ".llmgw-complete").stat().st_size
    assert by_name[NAME]["bytes"] == 1002 + marker and by_name[NAME]["reason"] is None
    assert "incomplete" in by_name["llmgw-" + "a" * 16]["reason"]
    assert "interrupted" in by_name[".tmp-llmgw-" + "b" * 16 + "-x1y2z3"]["reason"]
    assert by_name["llmgw-" + "c" * 16]["bytes"] is None
    assert (cache / NAME).exists(), "listing removes nothing"


def test_listing_hides_temp_dirs_a_running_fetch_owns(layout):
    cache, _ = layout
    temp = ".tmp-%s-abc123" % NAME
    (cache / temp).mkdir()
    assert helper.reclaim_entries(str(cache), None, collect=False, busy={NAME}) == []
    [entry] = helper.reclaim_entries(str(cache), [temp], collect=True, busy={NAME})
    assert entry["action"] == "refused" and entry["reason"] == "in use by a running download"
    assert (cache / temp).is_dir()


def test_listing_a_missing_cache_is_empty(tmp_path):
    assert helper.reclaim_entries(str(tmp_path / "never-created"), None, collect=False) == []


def test_leftover_temp_dirs_can_be_collected(layout):
    cache, _ = layout
    temp = cache / (".tmp-%s-k2j4h5" % NAME)
    (temp / "part").mkdir(parents=True)
    _age(temp)
    [entry] = _collect(cache, [temp.name])
    assert entry["action"] == "removed"
    assert not temp.exists()


def test_removal_never_follows_a_root_swapped_for_a_link(layout, tmp_path):
    cache, outside = layout
    _entry(cache)
    checked = os.lstat(cache)
    moved = tmp_path / "moved-cache"
    os.rename(cache, moved)
    os.symlink(moved, cache)
    with pytest.raises(OSError):
        helper.remove_tree_within(str(cache), NAME, expected=checked)
    assert (moved / NAME / "model.safetensors").exists()
