"""Shared fixtures: testbed hosts for integration tests.

    def test_something(testbed):                       # 4 default nodes, closed after the test
        ...

    @pytest.mark.testbed(nodes=[NodeSpec("gpu1", gpus=[GPU.h100()] * 8), NodeSpec("cpu1")])
    def test_other(testbed):                           # nodes from the marker
        ...

    @pytest.fixture(scope="module")
    def fleet(testbed_factory):                        # one testbed for a whole module
        tb = testbed_factory([NodeSpec("node1"), NodeSpec("node2")])
        yield tb
        tb.close()

Tests that need a testbed skip with the reason when this machine cannot build one (not root,
no sshd, no `ip`); tests carrying the `testbed` marker skip too, even without the fixtures.
"""

from __future__ import annotations

import signal

import pytest

from tests.testbed import Testbed, requirements_missing


def pytest_configure(config):
    # A run started in the background (nohup, a non-interactive shell's `&`) inherits SIGINT
    # ignored, and so would every process the tests start; the tests that end a `ctl --follow`
    # or `--watch` with SIGINT, as Ctrl-C does, need it delivered. A handled signal is reset to
    # its default across exec, so the processes the tests start get the default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("testbed") is None:
            continue
        if reason is None:
            reason = requirements_missing() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"testbed unavailable: {reason}"))


def _require_testbed() -> None:
    reason = requirements_missing()
    if reason:
        pytest.skip(f"testbed unavailable: {reason}")


@pytest.fixture(scope="session")
def testbed_factory():
    """`make(specs=4, **Testbed kwargs)` -> a started Testbed, closed at the latest when the
    session ends (close it earlier yourself when a module is done with it)."""
    _require_testbed()
    made: list[Testbed] = []

    def make(specs=4, **kwargs) -> Testbed:
        tb = Testbed(specs, **kwargs)
        made.append(tb)
        return tb.start()

    try:
        yield make
    finally:
        for tb in reversed(made):
            tb.close()


@pytest.fixture
def testbed(request, testbed_factory):
    """A Testbed for one test: `@pytest.mark.testbed(nodes=[NodeSpec...] or N, **kwargs)`."""
    marker = request.node.get_closest_marker("testbed")
    kwargs = dict(marker.kwargs) if marker else {}
    specs = kwargs.pop("nodes", 4)
    tb = testbed_factory(specs, **kwargs)
    try:
        yield tb
    finally:
        tb.close()
