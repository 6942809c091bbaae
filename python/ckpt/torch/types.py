"""What ckpt.torch returns: composite plans, restores and per-step costs
(frozen dataclasses), and their construction from the client's replies."""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Tuple


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer of a composite plan: the step its version is from."""
    name: str
    step: int        # 0 when the layer has no version
    staleness: int   # target step - step (0 for a frozen layer)
    bytes: int
    frozen: bool
    source: str = ""  # after a restore: "memory" (ckptd's memory tier) or "disk"
    lost_step: int = 0  # non-zero: this step's version was lost; `step` is older (older_within)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A composite checkpoint: which version of each layer a restore uses."""
    target_step: int
    complete: bool
    total_bytes: int
    max_staleness: int
    size_weighted_staleness: float
    layers: Tuple[LayerPlan, ...]


@dataclasses.dataclass(frozen=True)
class Restored(Plan):
    """What restore() wrote back, and the data position saved with it."""
    data_position: Any = None
    bytes_restored: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Stats:
    """Trainer-visible cost per step, in seconds."""
    fence_wait_s: Tuple[float, ...]
    step_done_s: Tuple[float, ...]
    # Multi-rank LayerCheck: each step's drift exchange (partials, the
    # all-reduce, the global sums back), run beside the next forward/backward.
    drift_exchange_s: Tuple[float, ...] = ()
    # Several ranks: each agreement on the durable step (every agree_every
    # steps: this rank's durable step, the MIN all-reduce), off the step.
    durable_agreement_s: Tuple[float, ...] = ()


def plan_of(reply: dict, frozen: Collection[str]) -> Plan:
    """A Plan from the client's plan (or restore) reply; `frozen` names the
    frozen layers."""
    return Plan(target_step=reply["target_step"], complete=reply["complete"],
                total_bytes=reply["total_bytes"], max_staleness=reply["max_staleness"],
                size_weighted_staleness=reply["size_weighted_staleness"],
                layers=tuple(LayerPlan(name=l["name"], step=l["step"], staleness=l["staleness"],
                                       bytes=l["bytes"], frozen=l["name"] in frozen,
                                       source=l.get("source", ""),
                                       lost_step=l.get("lost_step", 0))
                             for l in reply["layers"]))


def restored_of(plan: Plan, data_position: Any, bytes_restored: int, seconds: float) -> Restored:
    """`plan` as a Restored, with what the restore gave back."""
    return Restored(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)},
                    data_position=data_position, bytes_restored=bytes_restored, seconds=seconds)


def composite_of(target: int, steps: dict, layer_bytes: dict, names: Collection[str],
                 frozen: Collection[str]) -> Plan:
    """The plan of a restore assembled here (restore(from_job=)): layer `n`
    from step steps[n] (0: none) of `layer_bytes[n]` bytes, in `names`
    order."""
    layers = tuple(LayerPlan(name=n, step=steps.get(n, 0), staleness=target - steps.get(n, 0),
                             bytes=layer_bytes[n], frozen=n in frozen)
                   for n in names)
    worst = max((l.staleness for l in layers if not l.frozen), default=0)
    total = sum(layer_bytes.values())
    return Plan(target_step=target, complete=all(l.step for l in layers), total_bytes=total,
                max_staleness=worst,
                size_weighted_staleness=sum(l.staleness * l.bytes for l in layers) / max(total, 1),
                layers=layers)
