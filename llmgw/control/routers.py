"""The routers as the control plane's pass sees them: the figures it reads of them each pass, and
the endpoint table it pushes to them when the table changed (R-6.8a, R-10.1).

In `llmgw serve` each is the feed publisher's (llmgw.control.feed), which sends the table on to
every router in the feed's changes; tests and benchmarks give what they observe. Not to be taken
for `llmgw.routers`, the routers' credentials.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.contracts.endpoints import Endpoint


@dataclass(eq=False)
class Routers:
    """What the pass reads of the routers and where it pushes the endpoint table. None: not known here."""

    push_endpoints: Callable[[dict[str, list[Endpoint]]], None] | None = None
    last_used: Callable[[], Mapping[str, float]] | None = None  # replica id -> last use, since the last call
    outstanding: Callable[[str], int] | None = None  # requests in flight per replica (scaling, draining)
    abandon: Callable[[str], object] | None = None  # requests waiting on a lost replica go elsewhere
    engine_load: Callable[[str], object] | None = None  # the engine's own load per replica, as polled
    # Each router's counters as last reported (contracts.feed.RouterCounters): answers per replica
    # for a rollout's revisions side by side.
    counters: Callable[[], list] | None = None
    # LoRA adapters: replica id -> adapter -> (in flight, last use) over the routers; whether
    # every router routes with endpoint table `version` or later and has no request of the adapter
    # in flight to the replica; the version of the endpoint table pushed last.
    adapter_use: Callable[[], Mapping[str, Mapping[str, tuple[int, float]]]] | None = None
    adapter_quiet: Callable[[str, str, int | None], bool] | None = None
    version: Callable[[], int | None] | None = None
    pushed: dict[str, list[Endpoint]] | None = None

    def push(self, table: dict[str, list[Endpoint]]) -> None:
        """The endpoint table, when it differs from the one pushed last."""
        if table != self.pushed:
            self.pushed = table
            if self.push_endpoints is not None:
                self.push_endpoints(table)
