"""The fleet secret (R-5.2): made once in the state directory, 0600, handed to every helper in
the session only."""

import logging
import os
import threading
from pathlib import Path

import pytest

from llmgw.config import NodeConfig
from llmgw.fleet.link import LocalLink
from llmgw.fleet.secret import SecretError, fleet_secret, response_secret


def test_made_once_private_and_stable(tmp_path):
    state = tmp_path / "state"
    first = fleet_secret(state)
    assert len(first) == 64 and int(first, 16) >= 0
    assert os.stat(state / "fleet.key").st_mode & 0o777 == 0o600
    assert fleet_secret(state) == first
    assert [p.name for p in state.iterdir()] == ["fleet.key"], "no temp file left"


def test_r6_14_the_response_id_secret_is_made_once_private_and_apart_from_the_fleet_secret(tmp_path):
    first = response_secret(tmp_path)
    assert len(first) == 64 and os.stat(tmp_path / "responses.key").st_mode & 0o777 == 0o600
    assert response_secret(tmp_path) == first != fleet_secret(tmp_path)  # a restart seals and opens alike
    (tmp_path / "responses.key").write_text("not a secret")
    with pytest.raises(SecretError, match="does not hold the response-id secret"):
        response_secret(tmp_path)


def test_concurrent_first_uses_agree(tmp_path):
    state = tmp_path / "state"
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(fleet_secret(state))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and len(set(seen)) == 1


def test_a_file_open_to_others_is_closed_again(tmp_path):
    value = fleet_secret(tmp_path)
    os.chmod(tmp_path / "fleet.key", 0o644)
    assert fleet_secret(tmp_path) == value
    assert os.stat(tmp_path / "fleet.key").st_mode & 0o777 == 0o600


@pytest.mark.parametrize("how", ["link", "garbage"])
def test_a_file_that_is_not_a_secret_is_refused_with_the_path(tmp_path, how):
    if how == "link":
        (tmp_path / "elsewhere").write_text("ab" * 32)
        os.symlink(tmp_path / "elsewhere", tmp_path / "fleet.key")
    else:
        (tmp_path / "fleet.key").write_text("not a secret")
    with pytest.raises(SecretError, match=str(tmp_path / "fleet.key")):
        fleet_secret(tmp_path)


async def test_a_link_hands_the_secret_to_its_helper_in_the_session_only(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    secret = fleet_secret(tmp_path / "state")
    root = tmp_path / "node"
    link = LocalLink(NodeConfig(name="local", connection="local"), root, fleet_secret=secret)
    link.start()
    try:
        assert await link.wait_ready(60), link.reason
        kept = root / "fleet.key"
        assert kept.read_text().strip() == secret
        assert os.stat(kept).st_mode & 0o777 == 0o600
        proc = Path(f"/proc/{link._proc.pid}")
        assert secret.encode() not in (proc / "cmdline").read_bytes()
        assert secret.encode() not in (proc / "environ").read_bytes()
    finally:
        await link.close()
    assert secret not in caplog.text
