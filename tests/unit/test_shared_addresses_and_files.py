"""What the control plane and the router read and write alike (llmgw.contracts.addresses and
.privatefiles): one reading of HOST:PORT and loopback, one way to replace a private file."""

from __future__ import annotations

import os
import stat

import pytest

from llmgw.admin.tokens import write_token_file
from llmgw.contracts.addresses import is_loopback, split_address
from llmgw.contracts.privatefiles import write_private
from llmgw.router.feedclient import FeedClientError, parse_control
from llmgw.router.supervisor import SupervisorError, split_listen, write_private_json

# -- addresses -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)), ("[::1]:8081", ("::1", 8081)), (":9000", ("0.0.0.0", 9000)),
    ("gw.example:0", ("gw.example", 0)), ("[::]:65535", ("::", 65535)),
])
def test_host_port_is_split(value, expected):
    assert split_address(value) == expected


@pytest.mark.parametrize("value", ["8080", "host:", "host:http", "host:65536", "host:-1", ""])
def test_what_is_not_host_port_is_refused_by_both_sides_in_their_words(value):
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        split_address(value)
    with pytest.raises(SupervisorError, match="--listen .* is not HOST:PORT"):
        split_listen(value)


@pytest.mark.parametrize(("host", "loopback"), [
    pytest.param("::ffff:127.0.0.1", True, id="ipv4-mapped-loopback"),
    pytest.param("[::ffff:127.0.0.9]", True, id="ipv4-mapped-loopback-bracketed"),
    pytest.param("::ffff:10.0.0.7", False, id="ipv4-mapped-elsewhere"),
    pytest.param("::1%lo", True, id="zone"),
    pytest.param("localhost", True, id="localhost"),
    pytest.param("localhost.example", False, id="a-name"),
    pytest.param("0.0.0.0", False, id="wildcard"),
])
def test_loopback_is_one_rule(host, loopback):
    assert is_loopback(host) is loopback


def test_the_router_dials_plain_http_to_ipv4_loopback_written_as_ipv6():
    # The router's copy of the rule refused this address while serve's took it as loopback.
    assert parse_control("http://[::ffff:127.0.0.1]:8081").base_url == "http://[::ffff:127.0.0.1]:8081"
    with pytest.raises(FeedClientError, match="in clear"):
        parse_control("http://[::ffff:10.0.0.7]:8081")


# -- private files -------------------------------------------------------------------------------


@pytest.fixture
def synced(monkeypatch):
    """What os.fsync was called on: 'file' or 'directory', in order."""
    calls: list[str] = []
    real = os.fsync

    def fsync(fd):
        calls.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_a_private_file_is_replaced_whole_0600_and_durable(tmp_path, synced):
    path = tmp_path / "snapshot.json"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    write_private(path, b"new")
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert synced == ["file", "directory"]  # the bytes, then the rename
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot.json"], "no temporary file left"


@pytest.mark.parametrize("write", [
    pytest.param(lambda path: write_token_file(path, "token"), id="admin-token"),
    pytest.param(lambda path: write_private_json(path, {"workers": 2}), id="router-status"),
])
def test_every_private_file_gets_the_same_guarantee(tmp_path, synced, write):
    # The admin token file was fsynced without its directory, the router's status file not at all.
    write(tmp_path / "file")
    assert synced == ["file", "directory"]
    assert stat.S_IMODE(os.stat(tmp_path / "file").st_mode) == 0o600


def test_a_failed_write_leaves_the_file_as_it_was_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "admin-token"
    path.write_bytes(b"old\n")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_private(path, b"new\n")
    assert path.read_bytes() == b"old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["admin-token"]


def test_a_private_file_is_written_through_no_link(tmp_path):
    # The file's own name may hold a link: it is replaced, and what the link pointed to is untouched.
    target = tmp_path / "elsewhere"
    target.write_bytes(b"theirs")
    path = tmp_path / "credential"
    path.symlink_to(target)
    write_private(path, b"ours")
    assert not path.is_symlink() and path.read_bytes() == b"ours"
    assert target.read_bytes() == b"theirs"
