"""The policy a rank registers: attach()'s `policy` and `layercheck`
arguments as the client's policy dict, and each rank's part of a LayerCheck
write budget."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer as ckptd names it; TypeError for one it does not know."""
    # AdamW first: it is not an Adam subclass in every torch release.
    if isinstance(optimizer, torch.optim.AdamW):
        return "ADAMW"
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM"
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD"
    raise TypeError(
        f"ckpt.torch supports torch.optim.AdamW, Adam and SGD, not {type(optimizer).__name__}")


def parse_policy(policy: str, kind: str, layercheck: Optional[dict], record_trace: bool) -> dict:
    """The policy dict of "all", "every_n:K", "layercheck", "explicit" or
    "none"; ValueError for anything else, or a budget without LayerCheck."""
    spec: Dict[str, Any] = {"record_trace": bool(record_trace)}
    if policy.startswith("every_n:"):
        spec["kind"] = "EVERY_N"
        spec["every_n"] = int(policy.split(":", 1)[1])
    elif policy in ("all", "none", "explicit", "layercheck"):
        spec["kind"] = policy.upper()
    else:
        raise ValueError(f"unknown policy '{policy}': all, every_n:K, layercheck, explicit or none")
    if policy == "layercheck":
        spec["optimizer"] = kind
        spec["layercheck"] = dict(layercheck or {})
        budget = spec["layercheck"].get("budget")
        if budget is not None:
            if not isinstance(budget, dict):
                raise ValueError("layercheck 'budget' must be a dict (bytes_per_s and step_s, "
                                 f"bytes_per_step, or share and step_s), not {type(budget).__name__}")
            spec["layercheck"]["budget"] = dict(budget)
    elif layercheck and layercheck.get("budget") is not None:
        raise ValueError(f"a layercheck budget was given but the policy is '{policy}'")
    return spec


def has_budget(policy: dict) -> bool:
    """True when the policy carries a LayerCheck write budget."""
    return bool((policy.get("layercheck") or {}).get("budget"))


def budget_for_rank(policy: dict, layers: Dict[str, dict], layer_bytes: Dict[str, int],
                    owners: Dict[str, int], rank: int, whole_bytes: Dict[str, int]) -> dict:
    """The policy this rank registers: a LayerCheck write budget is the job's.
    Data-parallel replicas (`owners` set) each take the part of it that their
    share of the bytes is; sharded ranks that all-reduce their drift count
    every layer at its size over all ranks (`whole_bytes`), the same on every
    rank, so that all compute the same threshold multiplier."""
    lc = policy.get("layercheck")
    budget = lc.get("budget") if lc else None
    if not budget:
        return policy
    budget = dict(budget)
    if owners:
        total = sum(layer_bytes.values())
        own = sum(b for n, b in layer_bytes.items() if owners.get(n) == rank)
        for key in ("bytes_per_step", "bytes_per_s", "share"):
            if budget.get(key):
                budget[key] = float(budget[key]) * own / max(1, total)
        if not any(budget.get(k) for k in ("bytes_per_step", "bytes_per_s", "share")):
            budget = None  # this replica writes no layer
    elif whole_bytes and "layer_bytes" not in budget:
        budget["layer_bytes"] = [max(1, int(whole_bytes.get(n, 0))) for n in layers]
    return dict(policy, layercheck=dict(lc, budget=budget))
