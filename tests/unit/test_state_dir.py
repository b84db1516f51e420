"""The state directory is made private on every start; one that cannot be is a clear refusal."""

from __future__ import annotations

import os

import pytest

from llmgw.state_dir import StartupError, secure_state_dir


def test_a_state_directory_of_another_user_is_refused_with_a_message_not_a_traceback(tmp_path, monkeypatch):
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    real_chmod = os.chmod

    def chmod(path, mode, *args, **kwargs):
        if os.fspath(path) == os.fspath(state_dir):  # what a non-owner's chmod gets from the kernel
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        return real_chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod)
    with pytest.raises(StartupError) as info:
        secure_state_dir(state_dir)
    message = str(info.value)
    assert f"Operation not permitted: {state_dir}" in message, message
    assert f"owner uid {os.stat(state_dir).st_uid}" in message and "--state-dir" in message, message


def test_a_state_directory_is_made_private(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    (state_dir / "state.db").write_text("")
    os.chmod(state_dir / "state.db", 0o644)
    secure_state_dir(state_dir)
    assert os.stat(state_dir).st_mode & 0o777 == 0o700
    assert os.stat(state_dir / "state.db").st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
@pytest.mark.parametrize("name", ["state-dir", "admin-token", "state.db"])
def test_r10_9_a_state_directory_or_file_of_another_user_is_refused_even_as_root(tmp_path, name):
    # As root every chmod succeeds: closing the modes up alone would trust a token another user planted.
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "admin-token").write_text("planted\n")
    (state_dir / "state.db").write_text("")
    spoiled = state_dir if name == "state-dir" else state_dir / name
    os.chown(spoiled, 65534, 65534)
    with pytest.raises(StartupError) as info:
        secure_state_dir(state_dir)
    message = str(info.value)
    assert f"refusing the state directory: {spoiled} is owned by uid 65534, not by uid 0" in message, message
