"""How `llmgw ctl` finds the admin listener and its token (R-9.3).

Locally it uses the state directory's Unix socket, never the TCP port: a process that bound
that port while the gateway was down would be handed the token. The token need not be on the
command line, where every user of the machine can read it.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from aiohttp import web
from typer.testing import CliRunner

from llmgw.admin.app import build_admin_app
from llmgw.admin.client import AdminClient, AdminError
from llmgw.cli.main import app
from tests.unit.admin_gateway import TOKEN, make_gateway

CLEAN_ENV = {"COLUMNS": "400", "LLMGW_ADMIN_TOKEN": None, "LLMGW_ADMIN": None, "LLMGW_STATE_DIR": None,
             "LLMGW_ADMIN_TOKEN_FILE": None}


class PortGrabber:
    """A listener on the admin port that is not the gateway: it records what it is sent."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 500 Nope\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


def stopped_gateway_state(tmp_path, port: int):
    """What a stopped `llmgw serve` leaves: its token and the TCP address it had, no socket."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "admin-token").write_text(TOKEN + "\n")
    (state / "admin-address").write_text(f"127.0.0.1:{port}\n")
    return state


def test_local_ctl_never_hands_the_token_to_whoever_holds_the_tcp_port(tmp_path):
    grabber = PortGrabber()
    try:
        state = stopped_gateway_state(tmp_path, grabber.port)
        result = CliRunner(env=CLEAN_ENV).invoke(app, ["ctl", "--state-dir", str(state), "status"])
    finally:
        grabber.close()
    assert TOKEN.encode() not in grabber.received and grabber.connections == 0
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: no admin socket at {state / 'admin.sock'}: is `llmgw serve` running")
    assert "--admin HOST:PORT" in result.stderr


def test_a_stale_socket_is_reported_as_nothing_answering(tmp_path):
    state = stopped_gateway_state(tmp_path, 1)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(state / "admin.sock"))
    stale.close()  # bound, never listening: what a killed gateway leaves
    with pytest.raises(AdminError, match="nothing answers on the admin socket"):
        AdminClient.discover(state_dir=state).get("/api/status")


@pytest.fixture
async def admin_on_socket(tmp_path):
    """The real admin app on a Unix socket of a state directory, as `llmgw serve` runs it."""
    gateway = make_gateway(tmp_path)
    state = stopped_gateway_state(tmp_path, 1)
    gateway.bound = {"admin": ("127.0.0.1", 18081)}
    gateway.admin_socket = state / "admin.sock"
    runner = web.AppRunner(build_admin_app(gateway.admin_dependencies()))
    await runner.setup()
    await web.UnixSite(runner, str(state / "admin.sock")).start()
    try:
        yield state
    finally:
        await runner.cleanup()
        gateway.store.close()


async def test_ctl_talks_to_the_socket_of_the_state_directory(admin_on_socket):
    state = admin_on_socket
    runner = CliRunner(env=CLEAN_ENV)
    result = await asyncio.to_thread(runner.invoke, app, ["ctl", "--state-dir", str(state), "nodes"])
    assert result.exit_code == 0, result.output
    assert "gpu1" in result.stdout
    client = AdminClient.discover(state_dir=state)
    assert client.socket_path == state / "admin.sock" and TOKEN not in repr(client)
    # The dashboard address is the one the running gateway reports, not a file's.
    url = await asyncio.to_thread(client.dashboard_url)
    assert url == f"http://127.0.0.1:18081/?token={TOKEN}"
    with pytest.raises(AdminError) as refused:
        await asyncio.to_thread(AdminClient.discover(state_dir=state, token="wrong").get, "/api/status")
    assert refused.value.status == 401


async def test_the_token_can_come_from_a_file_or_the_environment(admin_on_socket, tmp_path, monkeypatch):
    state = admin_on_socket
    (state / "admin-token").write_text("not-the-token\n")
    copy = tmp_path / "token-copy"
    copy.write_text(TOKEN + "\n")
    runner = CliRunner(env=CLEAN_ENV)
    for args, env in ((["--token-file", str(copy)], {}), ([], {"LLMGW_ADMIN_TOKEN_FILE": str(copy)}),
                      ([], {"LLMGW_ADMIN_TOKEN": TOKEN})):
        result = await asyncio.to_thread(runner.invoke, app, ["ctl", "--state-dir", str(state), *args, "nodes"],
                                         env={**CLEAN_ENV, **env})
        assert result.exit_code == 0, (args, env, result.output)
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(AdminError, match="is empty"):
        AdminClient.discover(state_dir=state, token_file=str(empty))


def test_token_help_says_why_it_should_not_be_on_the_command_line():
    out = CliRunner(env={**CLEAN_ENV, "COLUMNS": "200"}).invoke(app, ["ctl", "--help"]).stdout
    assert "--token-file" in out and "LLMGW_ADMIN_TOKEN" in out
    assert "visible to every user" in " ".join(out.split())



def test_a_token_file_of_another_user_is_a_clear_refusal(tmp_path, monkeypatch):
    state = stopped_gateway_state(tmp_path, 1)

    def denied(self, *args, **kwargs):  # what a 0700 directory of another user answers (root reads anything)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(state), "read_text", denied)
    with pytest.raises(AdminError, match="permission denied; run as the user that runs `llmgw serve`"):
        AdminClient.discover(state_dir=state)
    monkeypatch.undo()
    with pytest.raises(AdminError, match=f"no admin token at {tmp_path / 'absent' / 'admin-token'}"):
        AdminClient.discover(state_dir=tmp_path / "absent")
