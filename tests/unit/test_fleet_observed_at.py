"""When a node's report counts from (llmgw/fleet/fleet.py): the moment it was asked for.

The observe step judges a starting shard gone only by a status report newer than its launch
(control/observe.py). A status question already on its way when a launch completes can come back
without the new engine; dated by its answer, it looked newer than the launch and failed the replica
with "engine not found on the node"."""

from __future__ import annotations

import time

from llmgw.config import load_configuration
from llmgw.fleet.fleet import Fleet


async def test_a_status_report_is_dated_when_it_was_asked_not_when_it_came_back(tmp_path):
    inventory, _, _ = load_configuration(None)
    fleet = Fleet(inventory, tmp_path)
    name = next(iter(fleet.facts))
    launched = {}

    async def answer():
        launched["at"] = time.time()  # a launch completes while the question is on its way
        return {}

    await fleet._fact(name, "status", answer(), {}, lambda result: result)
    assert fleet.facts[name].observed_at["status"] <= launched["at"]  # so it is not newer than that launch
