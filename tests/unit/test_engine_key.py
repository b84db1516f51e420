"""A replica's engine key stays out of every repr and log line (R-4.6).

The key is the only thing between a node's other users and the engine; tracebacks, debug logs
and `repr()` in an operator's console are where secrets usually leak.
"""

from __future__ import annotations

import logging

from llmgw.control.state import Replica, Shard
from llmgw.engines import BUILTIN_ENGINES, LaunchSpec, ShardVars
from tests.unit.test_reconciler import build, serving, settle

KEY = "llmgw-engine-s3cr3t-key"


def test_replica_and_launch_spec_reprs_leave_the_key_out():
    replica = Replica("m-1", "m", KEY, [Shard("m-1-0", "m-1", 0, "a", (0,))])
    assert KEY not in repr(replica) and "m-1" in repr(replica)
    variables = ShardVars(model="/w", name="m", host="127.0.0.1", port=20000, gpus_per_node=1, nnodes=1,
                          node_rank=0, leader_addr="127.0.0.1", leader_port=20001)
    for engine in BUILTIN_ENGINES.values():
        spec = engine.render(variables, [], {}, KEY)
        assert isinstance(spec, LaunchSpec)
        assert KEY not in repr(spec), engine.name
        assert KEY in str(spec.env) + str(spec.files), engine.name  # it is there, only not shown


async def test_placing_and_serving_logs_no_engine_key(caplog):
    caplog.set_level(logging.DEBUG)
    reconciler, fleet, _, pushed = build([{"name": "m", "scaling": {"min": 2}}])
    await settle(reconciler, fleet)
    replicas = serving(reconciler, "m")
    assert len(replicas) == 2
    for replica in replicas:
        assert replica.api_key and replica.api_key not in caplog.text
        logging.getLogger("test").info("serving %r via %r", replica, pushed[-1]["m"])
        assert replica.api_key not in caplog.text
