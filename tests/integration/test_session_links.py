"""The helper session over real transports: a big answer over SSH, a chatty helper's stderr (R-1.2)."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from llmgw.config import NodeConfig, load_inventory
from llmgw.fleet.link import LocalLink, SSHLink
from llmgw.fleet.session import NodeError
from tests.testbed import NodeSpec
from tests.testbed.testbed import NODE_PYTHON

BIG = 3 * 1024 * 1024  # more than an SSH channel's window (2 MiB)


@pytest.fixture(scope="module")
def bed(testbed_factory):
    tb = testbed_factory([NodeSpec("cpu1", gpus=None)])
    yield tb
    tb.close()


@pytest.fixture
def inventory(bed, tmp_path):
    inventory, _ = load_inventory(bed.write_inventory(tmp_path / "inventory.yaml"))
    return inventory


@pytest.mark.testbed
async def test_an_answer_longer_than_the_ssh_window_arrives_whole(inventory):
    """asyncssh's readline returns such a line in pieces; the call used to wait for its timeout."""
    link = SSHLink(inventory.node("cpu1"), inventory.ssh)
    link.start()
    try:
        assert await link.wait_ready(30), link.reason
        # The helper names an unknown operation in its answer: a 3 MiB name makes a 3 MiB line
        # each way, through the real sshd and the real helper.
        name = "x" * BIG
        with pytest.raises(NodeError) as info:
            await link.call(name, timeout=60)
        assert info.value.phase == "remote" and info.value.kind == "unknown_op"
        assert name in info.value.message
        print(f"answer of {len(info.value.message) / 1024**2:.1f} MiB in one piece")
        assert "time" in await link.call("ping", timeout=30)  # the session is intact
    finally:
        await link.close()


# Stands in for the python the helper runs on: it runs the real bootstrap and helper and relays
# their stdin and stdout, and once the helper has said hello it writes 1 MB to stderr, more than
# an SSH channel's window: when nobody reads it the relay blocks, and no answer gets through.
CHATTY_PYTHON = textwrap.dedent("""\
    import subprocess, sys, threading
    child = subprocess.Popen([sys.executable] + sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    def relay_stdin():
        while True:
            chunk = sys.stdin.buffer.read1(65536)
            if not chunk:
                break
            child.stdin.write(chunk)
            child.stdin.flush()
        child.stdin.close()
    threading.Thread(target=relay_stdin, daemon=True).start()
    said_hello = False
    for line in iter(child.stdout.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
        if not said_hello and line.startswith(b'{"hello"'):
            said_hello = True
            sys.stderr.buffer.write(b"chatter chatter chatter\\n" * 120000 + b"done chattering\\n")
            sys.stderr.buffer.flush()
    sys.exit(child.wait())
    """)


@pytest.mark.parametrize("kind", [pytest.param("ssh", marks=pytest.mark.testbed), "local"])
async def test_a_chatty_helper_stderr_is_drained_and_logged(kind, request, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="llmgw.fleet.session")
    if kind == "ssh":
        bed, inventory = request.getfixturevalue("bed"), request.getfixturevalue("inventory")
        python = bed["cpu1"].bin_dir / "chatty-python3"  # a directory the node sees at the same path
        python.write_text(f"#!{NODE_PYTHON}\n" + CHATTY_PYTHON)
        node = inventory.node("cpu1").model_copy(update={"python": str(python)})
        link = SSHLink(node, inventory.ssh)
    else:
        python = tmp_path / "chatty-python3"
        python.write_text(f"#!{sys.executable}\n" + CHATTY_PYTHON)
        link = LocalLink(NodeConfig(name="cpu1", connection="local"), tmp_path / "node", python=str(python))
    python.chmod(0o755)
    link.start()
    try:
        assert await link.wait_ready(30), link.reason
        assert "time" in await link.call("ping", timeout=30)
    finally:
        await link.close()
    # The first lines are logged, the flood is counted rather than logged line by line, and the
    # last line is named once the session ends (or at the next line after the second).
    assert "cpu1: helper stderr: chatter chatter chatter" in caplog.text
    assert "cpu1: helper stderr: done chattering" in caplog.text or "the last: done chattering" in caplog.text
    logged = [r for r in caplog.records if "helper stderr: chatter" in r.getMessage()]
    assert len(logged) < 120000
