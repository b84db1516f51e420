"""What the control plane remembers between passes, composed of the memory each part keeps.

One `ControlMemory` is made when the reconciler is; the reconciler holds it and publishes from it
(llmgw.control.publish), and each part of the control plane is given the parts it reads or
writes, explicitly, never another's dict:

- `records` (state.py): the replicas, those retired lately, each model's launch record;
  written by the reconciler's pass, by `placing.carry_out` (a replica placed) and by `Actions`
  (its node tasks, a retirement, a stopped replica's record dropped);
- `nodes` (nodes.py): admin state, removals, unknown engines; written by `Nodes`;
- `placing` (placing.py): unplaceable models, evictions under way; written by `Placing`, and by
  the pass (a model with enough replicas, or gone from the catalog, is no longer unplaceable);
- `scaling` (scaling.py): each model's scaling, demand, last use; written by the pass, and the
  demand also when a request asks for an on-demand model (`Reconciler.note_demand`);
- `probes` (observe.py): failed health probes in a row; written by the pass;
- `rollouts` (rollouts.py): each model's revisions and rollout; written by the pass (a revision
  seen, a rollout begun or paused, its progress) and by the operator's rollout commands
  (pause, resume, promote, undo: `ControlPlane`);
- `adapters` (adapters.py): the LoRA adapters replicas loaded while running, and failed loads;
  written by `AdapterLoads`, which the pass tells what the engines list.

What the node tasks learned (weights' sizes, download rates, provisioning times) is theirs:
`Actions.learned`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.control.adapters import AdapterMemory
from llmgw.control.nodes import NodeMemory
from llmgw.control.observe import ProbeMemory
from llmgw.control.placing import PlacingMemory
from llmgw.control.rollouts import RolloutMemory
from llmgw.control.scaling import ScalingMemory
from llmgw.control.state import Records


@dataclass(eq=False)
class ControlMemory:
    records: Records = field(default_factory=Records)
    nodes: NodeMemory = field(default_factory=NodeMemory)
    placing: PlacingMemory = field(default_factory=PlacingMemory)
    scaling: ScalingMemory = field(default_factory=ScalingMemory)
    probes: ProbeMemory = field(default_factory=ProbeMemory)
    rollouts: RolloutMemory = field(default_factory=RolloutMemory)
    adapters: AdapterMemory = field(default_factory=AdapterMemory)

    def __post_init__(self) -> None:
        # The adapters each replica's endpoint says it holds are its revision's and those it
        # loaded since, with the loads that failed there lately.
        if self.records.revision_adapters is None:
            self.records.revision_adapters = self.rollouts.adapters
        if self.records.runtime_adapters is None:
            self.records.runtime_adapters = self.adapters.held
            self.records.adapter_errors = self.adapters.errors
