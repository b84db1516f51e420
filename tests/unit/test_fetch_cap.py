"""The cap the control plane gives every download (R-5.1, R-5.2): the declared or learned size
plus a margin, else the configured limit."""

from llmgw.config import GatewayConfig
from llmgw.control.actions import FETCH_MARGIN_MIN, fetch_cap


def test_a_declared_size_wins_over_a_learned_one():
    assert fetch_cap(24.0, 5 * 1000**3, 10**15) == int(24 * 1000**3 * 1.10)


def test_a_learned_size_is_used_when_none_is_declared():
    assert fetch_cap(None, 5 * 1000**3, 10**15) == int(5 * 1000**3 * 1.10)


def test_small_sources_get_the_minimum_margin():
    assert fetch_cap(None, 1000, 10**15) == 1000 + FETCH_MARGIN_MIN


def test_an_unknown_size_gets_the_configured_limit():
    gateway = GatewayConfig(fetch_limit="500GB", fetch_stall="30s")
    assert gateway.fetch_limit == 500 * 1000**3 and gateway.fetch_stall == 30.0
    assert fetch_cap(None, None, gateway.fetch_limit) == 500 * 1000**3
    assert GatewayConfig().fetch_limit == 2 * 1000**4
