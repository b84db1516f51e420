"""storage and holdings of the node helper, in-process on real directories (R-2.4-R-2.6)."""

import os
import threading

import pytest

from tests.helper.client import load_helper, write_sealed_marker

helper = load_helper()
SECRET = "ab" * 32


@pytest.fixture
def node(tmp_path):
    node = helper.Node(str(tmp_path / "root"), str(helper.__file__))
    yield node
    node.shutdown(wait=0)


def _storage(node, dirs, timeout=5):
    return node.storage.op_storage({"dirs": dirs, "timeout": timeout}, helper.Context())


def test_two_directories_on_one_disk_are_one_filesystem(node, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "cache").mkdir()
    result = _storage(node, [{"path": str(tmp_path / "models")}, {"path": str(tmp_path / "cache")}])
    assert len(result["filesystems"]) == 1
    fs = result["filesystems"][0]
    assert fs["dirs"] == [str(tmp_path / "models"), str(tmp_path / "cache")]
    info = os.stat(tmp_path)
    assert fs["device"] == "%d:%d" % (os.major(info.st_dev), os.minor(info.st_dev))
    vfs = os.statvfs(tmp_path)
    assert fs["total_bytes"] == vfs.f_blocks * vfs.f_frsize
    assert 0 <= fs["free_bytes"] <= fs["total_bytes"]
    assert fs["fstype"] and fs["mount_point"]
    assert result["missing"] == [] and result["stuck"] == []


def test_a_missing_directory_is_skipped_not_reported_empty(node, tmp_path):
    (tmp_path / "a-file").write_text("x")
    result = _storage(node, [{"path": str(tmp_path / "unmounted-filer")}, {"path": str(tmp_path / "a-file")}])
    assert result["filesystems"] == []
    assert result["missing"] == [str(tmp_path / "unmounted-filer"), str(tmp_path / "a-file")]


def test_local_storage_is_not_shared_unless_marked(node, tmp_path):
    (tmp_path / "a").mkdir()
    local = _storage(node, [{"path": str(tmp_path / "a"), "shared": False}])
    assert local["filesystems"][0]["shared"] is False
    marked = _storage(node, [{"path": str(tmp_path / "a"), "shared": True}])
    assert marked["filesystems"][0]["shared"] is True


def test_tmpfs_is_local(node):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    fs = _storage(node, [{"path": "/dev/shm"}])["filesystems"][0]
    assert fs["fstype"] == "tmpfs" and fs["shared"] is False


@pytest.mark.parametrize(
    "fstype, shared",
    [pytest.param(t, True, id=t) for t in (
        "nfs", "nfs4", "lustre", "cifs", "smb3", "gpfs", "beegfs", "ceph", "cephfs", "glusterfs",
        "fuse.glusterfs", "fuse.cephfs", "fuse.ceph-fuse", "wekafs")]
    + [pytest.param(t, False, id=t) for t in (
        "ext4", "xfs", "tmpfs", "overlay", "zfs", "btrfs", "fuse.lxcfs", "9p", "autofs", "squashfs", "vfat")]
    + [pytest.param(None, False, id="unknown")],
)
def test_shared_filesystem_types(fstype, shared):
    assert helper.is_shared_fstype(fstype) is shared


def test_a_hung_directory_is_stuck_and_skipped_afterwards(node, tmp_path, monkeypatch):
    (tmp_path / "ok").mkdir()
    hung = str(tmp_path / "hung-nfs")
    release = threading.Event()
    calls = []
    real_probe = helper._probe_directory

    def probe(path):
        calls.append(path)
        if path == hung:
            release.wait(30)  # a dead NFS server: statfs does not return
            raise FileNotFoundError(path)
        return real_probe(path)

    monkeypatch.setattr(helper, "_probe_directory", probe)
    try:
        first = _storage(node, [{"path": hung}, {"path": str(tmp_path / "ok")}], timeout=0.2)
        assert first["stuck"] == [hung]
        assert first["filesystems"][0]["dirs"] == [str(tmp_path / "ok")]
        assert hung not in first["missing"]
        second = _storage(node, [{"path": hung}], timeout=0.2)
        assert second == {"filesystems": [], "missing": [], "stuck": [hung]}
        assert calls.count(hung) == 1, "a stuck path is not probed again while its probe hangs"
    finally:
        release.set()
    # Once the probe returns, the path is looked at again.
    for thread in list(node.storage.stuck.values()):
        thread.join(5)
    third = _storage(node, [{"path": hung}], timeout=2)
    assert third["missing"] == [hung] and third["stuck"] == []
    assert calls.count(hung) == 2


@pytest.mark.parametrize("bad", [pytest.param({"dirs": "/tmp"}, id="not-a-list"),
                                 pytest.param({"dirs": [{"path": "relative"}]}, id="relative"),
                                 pytest.param({"dirs": [42]}, id="not-a-dir-spec"),
                                 pytest.param({"dirs": [], "timeout": -1}, id="negative-timeout")])
def test_bad_storage_args(node, bad):
    with pytest.raises(helper.HelperError) as caught:
        node.storage.op_storage(bad, helper.Context())
    assert caught.value.kind == "bad_args"


# --------------------------------------------------------------------------------------------
# holdings


def _write(path, data=b"w" * 100):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "build, expected",
    [
        pytest.param(lambda d: _write(d / "model.gguf"), 100, id="non-empty-file"),
        pytest.param(lambda d: _write(d / "model.gguf", b""), None, id="empty-file"),
        pytest.param(lambda d: (d / "m").mkdir(), None, id="empty-dir"),
        pytest.param(lambda d: _write(d / "m" / "a" / "b" / "w.bin"), 100, id="nested-file"),
        pytest.param(lambda d: (d / "m" / "a" / "b").mkdir(parents=True), None, id="only-empty-dirs"),
        pytest.param(lambda d: _write(d / ("llmgw-" + "1" * 16) / "w.bin"), None, id="download-without-marker"),
        pytest.param(
            lambda d: (_write(d / ("llmgw-" + "1" * 16) / "w.bin"), write_sealed_marker(d / ("llmgw-" + "1" * 16), SECRET)),
            100, id="download-with-marker",
        ),
        pytest.param(
            lambda d: (_write(d / ("llmgw-" + "1" * 16) / "w.bin"), _write(d / ("llmgw-" + "1" * 16) / ".llmgw-complete", b"{}")),
            None, id="download-with-a-marker-that-is-not-llmgw-s",
        ),
        pytest.param(lambda d: _write(d / ("llmgw-" + "1" * 16) / ".llmgw-complete", b"{}"), None, id="marker-only"),
        pytest.param(lambda d: os.symlink(d / "nowhere", d / "m"), None, id="dangling-link"),
    ],
)
def test_what_counts_as_weights(tmp_path, build, expected):
    build(tmp_path)
    names = [n for n in os.listdir(tmp_path)]
    assert len(names) == 1
    assert helper.weights_bytes(str(tmp_path / names[0]), SECRET) == expected


def test_hub_cache_snapshots_made_of_links_count(tmp_path):
    blob = _write(tmp_path / "blobs" / "abc123", b"x" * 4096)
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    os.symlink(blob, snapshot / "model.safetensors")
    assert helper.weights_bytes(str(snapshot)) == 4096


def test_linked_directories_are_not_descended(tmp_path):
    _write(tmp_path / "elsewhere" / "w.bin")
    (tmp_path / "m").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "m" / "linked")
    assert helper.weights_bytes(str(tmp_path / "m")) is None


def test_holdings_takes_the_first_candidate_that_holds_weights(node, tmp_path):
    _write(tmp_path / "dir2" / "m" / "w.bin")
    _write(tmp_path / "dir3" / "m" / "w.bin", b"z" * 7)
    (tmp_path / "dir1" / "m").mkdir(parents=True)
    result = node.storage.op_holdings(
        {"candidates": {
            "llama": [str(tmp_path / "dir1" / "m"), str(tmp_path / "dir2" / "m"), str(tmp_path / "dir3" / "m")],
            "absent": [str(tmp_path / "nope")],
        }},
        helper.Context(),
    )
    assert result == {"held": {"llama": {"path": str(tmp_path / "dir2" / "m"), "bytes": 100}}, "stuck": []}
