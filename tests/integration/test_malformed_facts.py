"""A node whose helper answers malformed facts is unhealthy with the reason; the rest of the fleet
is reconciled as before (R-1.3, R-4.1).

Two `connection: local` nodes run real helpers over the real protocol (R-1.7). The one named
`bad` runs a variant of the shipped helper whose first few `status` answers are not in the
protocol's shape; the link deploys and verifies that variant like any helper (its own hash).
The reconciler's loop runs as in `llmgw serve`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import llmgw.fleet.fleet as fleet_module
from llmgw.admin.views import Listings
from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, Inventory, NodeConfig
from llmgw.control.reconciler import Reconciler
from llmgw.fleet.fleet import Fleet
from llmgw.fleet.link import READY, UNHEALTHY, HelperCode, helper_code

MALFORMED_ANSWERS = 3
# Appended to the helper before its `if __name__ == "__main__":` line.
MALFORMED_STATUS = f"""
_sound_status = Engines.op_status
_status_answers = [0]


def _malformed_status(self, args, ctx):
    answer = _sound_status(self, args, ctx)
    _status_answers[0] += 1
    if _status_answers[0] <= {MALFORMED_ANSWERS}:
        answer["shards"] = [{{"pid": "twelve"}}]
    return answer


Engines.op_status = _malformed_status

"""


def malformed_helper() -> HelperCode:
    text = helper_code().text.decode()
    main = '\nif __name__ == "__main__":'
    assert text.count(main) == 1
    text = text.replace(main, MALFORMED_STATUS + main).encode()
    return HelperCode(text=text, sha256=hashlib.sha256(text).hexdigest())


async def until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_malformed_facts_make_only_that_node_unhealthy(tmp_path, monkeypatch):
    bad_code = malformed_helper()
    make_link = fleet_module.make_link

    def make_bad_link(node, ssh, **kw):
        if node.name == "bad":
            kw["code"] = bad_code
        return make_link(node, ssh, **kw)

    monkeypatch.setattr(fleet_module, "make_link", make_bad_link)
    inventory = Inventory(nodes=[NodeConfig(name="bad", connection="local"),
                                 NodeConfig(name="good", connection="local")])
    holder = CatalogHolder(Catalog.build(file_models=[], profiles={}))
    fleet = Fleet(inventory, tmp_path)
    reconciler = Reconciler(holder, fleet, None, GatewayConfig(tick=0.1))
    bad, good = None, None
    await fleet.start()
    try:
        bad, good = fleet.links["bad"], fleet.links["good"]
        await until(lambda: bad.connects and good.connects, 30, "both helpers to start")
        reconciler.start()
        await until(lambda: bad.state == UNHEALTHY, 10, f"bad to be unhealthy (it is {bad.state}: {bad.reason})")
        unhealthy_at = (reconciler.passes, good.connects, fleet.facts["good"].observed_at.get("status"))

        reason = "malformed status answer: shards[0].shard_id is missing"
        assert bad.reason == reason
        listed = {n["name"]: n for n in Listings(reconciler.view.get()).nodes()}
        assert (listed["bad"]["state"], listed["bad"]["state_reason"]) == (UNHEALTHY, reason)
        assert listed["good"]["state"] == READY
        assert reconciler.nodes.view("bad").state == UNHEALTHY  # what placement goes by
        assert bad.answering and bad.connects == 1  # the session stays: only its answers are doubted

        # The passes go on for the others meanwhile, and the bad node is ready again once its
        # answers are sound (after MALFORMED_ANSWERS of them).
        await until(lambda: bad.state == READY, 10, f"bad to be ready again ({bad.state}: {bad.reason})")
        assert reconciler.passes > unhealthy_at[0]
        assert fleet.facts["good"].observed_at["status"] > (unhealthy_at[2] or 0)
        assert good.state == READY and good.connects == unhealthy_at[1] == 1
        assert fleet.facts["bad"].shards == {} and bad.reason is None
        print(f"\nbad node unhealthy then ready again; {reconciler.passes} reconcile passes")
    finally:
        await reconciler.close()
        await fleet.close()
