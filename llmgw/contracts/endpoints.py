"""Where a model can be reached: the endpoints the control plane publishes in the router feed.

The reconciler makes `Endpoint`s of serving replicas, the control plane makes those of models with
static `endpoints:` (control.feed.static_endpoints), and the router balances over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STATIC_PREFIX = "static:"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One serving replica of a model, as the router reaches it."""

    replica_id: str
    model: str  # catalog model name
    url: str  # base URL of the engine, e.g. "http://10.213.7.10:20001" (no trailing /)
    # The replica's engine key, sent upstream as Authorization: Bearer; never in a repr, so never
    # in a log line or a traceback through one.
    api_key: str | None = field(repr=False)
    draining: bool = False  # marked for a rolling move: still serving until its replacement does
    revision: str | None = None  # the model's revision the replica runs; None: not known, or static
    # Set on the replicas of a canary revision: about this percent of the model's requests
    # go to them, the rest to the model's other endpoints. None: no canary, balanced as one.
    canary: int | None = None
    # The node the replica's engine answers on, its head node for a multi-node replica: where
    # the request log says a request ran. None: not known, or a static endpoint.
    node: str | None = None
    # The LoRA adapters (their catalog names) the replica's engine holds, in the order it was given
    # them at launch, which is llama-server's `lora` id of each. (): none.
    adapters: tuple[str, ...] = ()
    # Adapters the control plane failed to load on this replica, (name, why), lately:
    # a request for one that no replica holds fails with the reason rather than waiting.
    adapter_errors: tuple[tuple[str, str], ...] = ()
