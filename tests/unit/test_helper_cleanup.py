"""The node side of the clean-up at a low-water mark (R-5.5): `reclaim` with `until_free` removes
sealed entries of this fleet in the order given and stops once the filesystem has the mark's
bytes free; it refuses everything `reclaim --collect` refuses, and more. Entries' last use is
their completion marker's mtime, which a launch sets."""

import json
import os
import time

import pytest

from tests.helper.client import load_helper, write_sealed_marker

helper = load_helper()
SECRET = "cd" * 32
OLD, MID, NEW = ("llmgw-" + c * 32 for c in "abc")


def _entry(cache, name, size=1000, secret=SECRET, last_used=None):
    entry = cache / name
    entry.mkdir(parents=True)
    (entry / "model.gguf").write_bytes(b"w" * size)
    write_sealed_marker(entry, secret)
    if last_used is not None:
        os.utime(entry / ".llmgw-complete", (last_used, last_used))
    return entry


class Disk:
    """statvfs of the cache as the helper reads it: free bytes grow by what was removed."""

    def __init__(self, cache, free):
        self.cache, self.base, self.sizes = cache, free, {}

    def add(self, name, size):
        self.sizes[name] = size

    def free(self, cache_dir):
        assert cache_dir == str(self.cache)
        return self.base + sum(size for name, size in self.sizes.items() if not (self.cache / name).exists())


@pytest.fixture
def disk(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    disk = Disk(cache, free=100)
    monkeypatch.setattr(helper, "cache_free_bytes", disk.free)
    return disk


def _cleanup(cache, names, until_free, busy=frozenset()):
    return helper.reclaim_entries(str(cache), names, collect=True, busy=busy, secret=SECRET, until_free=until_free)


def test_removes_in_the_order_given_and_stops_at_the_mark(disk):
    for name in (OLD, MID, NEW):
        _entry(disk.cache, name)
        disk.add(name, 1000)
    entries = _cleanup(disk.cache, [OLD, MID, NEW], until_free=1500)
    assert [(e["name"], e["action"]) for e in entries] == [(OLD, "removed"), (MID, "removed"), (NEW, "kept")]
    assert "at or above the mark (1500)" in entries[2]["reason"]
    assert sorted(os.listdir(disk.cache)) == [NEW]


def test_nothing_is_removed_when_the_filesystem_is_already_at_the_mark(disk):
    _entry(disk.cache, OLD)
    [entry] = _cleanup(disk.cache, [OLD], until_free=100)
    assert entry["action"] == "kept" and (disk.cache / OLD).is_dir()


@pytest.mark.parametrize("where,reason", [("outside", "resolves outside the cache"), ("inside", "symbolic link")])
def test_a_symbolic_link_is_refused_and_its_target_survives(disk, tmp_path, where, reason):
    target = _entry(tmp_path / "elsewhere" if where == "outside" else disk.cache, MID)
    os.symlink(target, disk.cache / OLD)
    [entry] = _cleanup(disk.cache, [OLD], until_free=10**9)
    assert entry["action"] == "refused" and reason in entry["reason"], entry
    assert (target / "model.gguf").exists() and os.path.islink(disk.cache / OLD)


def test_an_entry_of_another_user_is_refused(disk):
    if os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    entry_dir = _entry(disk.cache, OLD)
    for path in (entry_dir, *entry_dir.iterdir()):
        os.chown(path, 65534, 65534, follow_symlinks=False)
    [entry] = _cleanup(disk.cache, [OLD], until_free=10**9)
    assert entry["action"] == "refused" and "owned by uid 65534" in entry["reason"]
    assert (entry_dir / "model.gguf").exists()


@pytest.mark.parametrize("planted", ["no-marker", "another-fleet", "bad-seal"])
def test_a_planted_or_foreign_directory_is_refused(disk, planted):
    entry_dir = disk.cache / OLD
    if planted == "no-marker":
        entry_dir.mkdir()
        (entry_dir / "model.gguf").write_bytes(b"x" * 10)
    elif planted == "another-fleet":
        _entry(disk.cache, OLD, secret="ef" * 32)
    else:
        _entry(disk.cache, OLD)
        (entry_dir / "model.gguf").write_bytes(b"y" * 2000)  # the manifest no longer matches the seal
    [entry] = _cleanup(disk.cache, [OLD], until_free=10**9)
    assert entry["action"] == "refused" and "not a sealed entry of this fleet" in entry["reason"], entry
    assert (entry_dir / "model.gguf").exists()


def test_a_leftover_temp_dir_is_not_the_clean_ups_to_take(disk):
    temp = disk.cache / (".tmp-%s-x1" % OLD)
    temp.mkdir()
    os.utime(temp, (time.time() - 3600, time.time() - 3600))
    [entry] = _cleanup(disk.cache, [temp.name], until_free=10**9)
    assert entry["action"] == "refused" and "only sealed entries" in entry["reason"]
    assert temp.is_dir()


def test_an_entry_another_node_is_downloading_is_refused(disk):
    _entry(disk.cache, OLD)
    temp = disk.cache / (".tmp-%s-q7w8e9" % OLD)
    temp.mkdir()
    (temp / ".llmgw-lease").write_text(json.dumps({"hostname": "gpu7", "boot_id": "other", "pid": 4242}))
    [entry] = _cleanup(disk.cache, [OLD], until_free=10**9)
    assert entry["action"] == "refused" and "download on gpu7" in entry["reason"]
    assert (disk.cache / OLD / "model.gguf").exists()


def test_an_entry_this_node_is_fetching_is_refused(disk):
    _entry(disk.cache, OLD)
    [entry] = _cleanup(disk.cache, [OLD], until_free=10**9, busy={OLD})
    assert entry["action"] == "refused" and "running download" in entry["reason"]


@pytest.mark.parametrize("name", ["../cache", "..", ".", "", "llmgw-0123/../../x"])
def test_traversal_and_the_cache_root_are_refused(disk, name):
    _entry(disk.cache, OLD)
    [entry] = _cleanup(disk.cache, [name], until_free=10**9)
    assert entry["action"] == "refused"
    assert disk.cache.is_dir() and (disk.cache / OLD).is_dir()


def test_without_the_fleet_secret_nothing_is_removed(disk):
    _entry(disk.cache, OLD)
    [entry] = helper.reclaim_entries(str(disk.cache), [OLD], collect=True, secret=None, until_free=10**9)
    assert entry["action"] == "refused" and "no fleet secret" in entry["reason"]


def test_listing_reports_the_markers_mtime_as_last_use(disk):
    _entry(disk.cache, OLD, last_used=1_000_000.0)
    [listed] = helper.reclaim_entries(str(disk.cache), None, collect=False, secret=SECRET)
    assert listed["reason"] is None and listed["last_used"] == 1_000_000.0


def test_a_launch_marks_the_entry_its_argv_names_as_used(tmp_path):
    cache = tmp_path / "cache"
    used = _entry(cache, OLD, last_used=1_000_000.0)
    other = _entry(cache, MID, last_used=1_000_000.0)
    before = time.time()
    helper.note_entry_use(["llama-server", "--model", str(used / "model.gguf"), "--alias=x", "--port", "1"])
    assert os.stat(used / ".llmgw-complete").st_mtime >= before - 1
    assert os.stat(other / ".llmgw-complete").st_mtime == 1_000_000.0
    helper.note_entry_use(["vllm", "serve", "--model=" + str(other)])
    assert os.stat(other / ".llmgw-complete").st_mtime >= before - 1


def test_a_launch_never_touches_a_marker_through_a_link(tmp_path):
    real = _entry(tmp_path / "elsewhere", OLD, last_used=1_000_000.0)
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(real, cache / OLD)
    helper.note_entry_use(["llama-server", "--model", str(cache / OLD / "model.gguf")])
    assert os.stat(real / ".llmgw-complete").st_mtime == 1_000_000.0


class _RootDir:
    sha256, secret = "0" * 64, SECRET


class _Fetches:
    def busy_cache_names(self, cache_dir):
        return frozenset()


def _reclaim():
    return helper.Reclaim(_RootDir(), _Fetches(), venvs=None, containers=None)


@pytest.mark.parametrize("args", [
    {"names": [OLD], "until_free": 10},  # without collect
    {"names": [OLD], "collect": True, "until_free": -1},
    {"names": [OLD], "collect": True, "until_free": "10"},
])
def test_until_free_needs_collect_and_a_byte_count(tmp_path, args):
    with pytest.raises(helper.HelperError) as caught:
        _reclaim().op_reclaim({"cache_dir": str(tmp_path), **args}, None)
    assert caught.value.kind == "bad_args"


def test_the_answer_carries_the_free_bytes_after(disk):
    _entry(disk.cache, OLD)
    disk.add(OLD, 1000)
    answer = _reclaim().op_reclaim({"cache_dir": str(disk.cache), "names": [OLD], "collect": True, "until_free": 500}, None)
    assert [e["action"] for e in answer["entries"]] == ["removed"] and answer["free_bytes"] == 1100
