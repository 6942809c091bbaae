"""ckpt.torch: protect a PyTorch 2.x training loop with ckptd.

    import ckpt
    from ckpt import torch as ckpt_torch

    run = ckpt_torch.attach(model, optimizer, ckpt.Client(), job_id="llama-ft-7",
                            policy="layercheck", scheduler=scheduler)
    resumed = run.resume()                  # the composite checkpoint, or None
    cursor = resumed.data_position if resumed else 0
    for batch in data(cursor):
        loss = model(batch).backward()
        run.set_data_position(cursor)       # saved with this step
        optimizer.step()                    # hooks: fence before, StepDone after
        scheduler.step()

What is registered, and when. ckptd reads the tensors themselves, never a
copy made per step:
- parameters the optimizer steps, and their optimizer state (AdamW, Adam, SGD
  with momentum; foreach and fused implementations alike);
- parameters it does not step (``requires_grad=False``, or left out of the
  optimizer, as in ``AdamW(p for p in model.parameters() if p.requires_grad)``):
  frozen weights, in layers of their own marked frozen, written once and never
  again (a LoRA fine-tune writes its adapters each step, never its base);
- persistent module buffers (BatchNorm's running statistics), in the layer of
  their module.
Optimizer state is not created by ckpt.torch: the optimizer creates it at its
first step, so the rank registers in the post-step hook of that step, and the
first checkpoint is step 1, holding the weights and state after it. A
restore() before the first step lets the optimizer create its state with a
step of learning rate 0 (weights unchanged) and then overwrites everything.

CPU tensors move once, at registration, into shared memory ckptd maps (each
tensor keeps its identity and its autograd hooks: its ``.data`` is replaced).
CUDA tensors stay where they are: ckptd opens them through CUDA IPC (memory
of ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` cannot be opened
that way and is refused at registration, naming the tensor), and each
StepDone records an event on the stream the optimizer step ran on. A rank registers the tensors
of one device: a model split over CPU and GPU, or over two GPUs, is refused
naming a tensor on each.

The hooks. ``Optimizer.register_step_pre_hook`` waits until ckptd has copied
the previous step (the fence; normally done during forward and backward);
``register_step_post_hook`` reports the step with the state that is not in
tensors: the torch (and CUDA), ``random`` and numpy RNG states, learning
rates, optimizer step counts, the scheduler's state, the data position and
``extra_state``. It is saved with ``torch.save`` and read back only with
``torch.load(weights_only=True)``, PyTorch's restricted unpickler (2.6 or
newer: older releases could be made to run code); a blob in any other format
is not loaded at all. restore() writes the composite checkpoint into the live tensors and
puts all of that back, so training continues at ``target_step + 1`` exactly
as it would have.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import importlib
import io
import random
import re
import sys
import time
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ckpt

if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
    # Older releases' torch.load(weights_only=True) could be made to run code.
    raise ImportError(f"ckpt.torch needs PyTorch 2.6 or newer, not {torch.__version__}")

__all__ = ["Attached", "LayerPlan", "Plan", "Restored", "Stats", "attach", "default_layer_of"]

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "U8",  # one byte each, stored as bytes
}
_ALIGN = 64  # every host tensor starts on a cache line
_AUX_FORMAT = "ckpt.torch/2"
_MAX_SOURCE_RANKS = 4096  # restore(from_job=): old ranks probed for the old world

_BLOCK = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<kind>layers|h|blocks|block|layer)\.(?P<n>\d+)\.")
_EMBEDDING = re.compile(r"(^|\.)(\w*emb\w*|wte|wpe)$")
_NORM = re.compile(r"(^|\.)(ln_f|norm|norm_f|final_norm|final_layer_norm|final_layernorm)$")
_HEAD = re.compile(r"(^|\.)(lm_head|head|output|classifier)$")

_STATE_ROLES = {"exp_avg": "EXP_AVG", "exp_avg_sq": "EXP_AVG_SQ", "momentum_buffer": "MOMENTUM",
                "max_exp_avg_sq": "OTHER"}

LayerOf = Callable[[str], Union[str, Tuple[str, str]]]


def default_layer_of(name: str) -> Tuple[str, str]:
    """(layer name, layer kind) of a parameter or buffer under the automatic
    grouping: ``*.layers.N.*``, ``*.h.N.*``, ``*.blocks.N.*`` are blocks;
    embeddings, the final norm and the head are layers of their own."""
    m = _BLOCK.match(name)
    if m:
        return m.group("prefix") + m.group("kind") + "." + m.group("n"), "BLOCK"
    module = name.rsplit(".", 1)[0] if "." in name else name
    if _EMBEDDING.search(module):
        return module, "EMBEDDING"
    if _NORM.search(module):
        return module, "NORM"
    if _HEAD.search(module):
        return module, "HEAD"
    return module, "OTHER"


# ---- what restore() and plan() return ----

@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer of a composite plan: the step its version is from."""
    name: str
    step: int        # 0 when the layer has no version
    staleness: int   # target step - step (0 for a frozen layer)
    bytes: int
    frozen: bool


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


# ---- set-up helpers ----

def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    # AdamW first: it is not an Adam subclass in every torch release.
    if isinstance(optimizer, torch.optim.AdamW):
        return "ADAMW"
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM"
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD"
    raise TypeError(
        f"ckpt.torch supports torch.optim.AdamW, Adam and SGD, not {type(optimizer).__name__}")


def _check_mappable(name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise ValueError(f"tensor '{name}' is {t.layout}; ckptd maps only dense (strided) tensors")
    if t.device.type == "meta":
        raise ValueError(f"tensor '{name}' is a meta tensor (no data); materialize the model first")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor '{name}' is on {t.device}; ckpt.torch maps CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"tensor '{name}' is not contiguous; make it contiguous before attach")
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"tensor '{name}' has dtype {t.dtype}, which ckptd does not store")


def _instance_of(obj: Any, module: str, name: str) -> bool:
    """isinstance(obj, module.name) for a class a torch build may lack."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # pragma: no cover - torch without distributed
        return False
    return isinstance(obj, cls)


def _is_dtensor(t: Any) -> bool:
    return _instance_of(t, "torch.distributed.tensor", "DTensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard (FSDP2's
    fully_shard), else the tensor itself. The shard object is the one the
    DTensor keeps, so moving its storage moves the DTensor's."""
    return t._local_tensor if _is_dtensor(t) else t


def _fsdp_shards(model: torch.nn.Module) -> Dict[int, torch.Tensor]:
    """id(sharded parameter) -> the padded flat shard FSDP2 keeps for it
    (its all-gathers read that one; the parameter's local tensor views it)."""
    out: Dict[int, torch.Tensor] = {}
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", None) or ():
            padded = getattr(fp, "_sharded_param_data", None)
            if padded is not None:
                out[id(fp.sharded_param)] = padded
    return out


def _check_step(plan: dict, source: str, rank: int, target: int) -> None:
    if plan["target_step"] != target:
        raise ckpt.Error("FAILED_PRECONDITION",
                         f"job {source} rank {rank} has no checkpoint of step {target} (its "
                         f"newest at or below is {plan['target_step']}): its ranks do not share "
                         "that step")


def _dim0_rows(rows: int, world_size: int, rank: int) -> Tuple[int, int]:
    """[begin, end) of the rows FSDP2 gives `rank` of a dimension of `rows`
    (torch.chunk: ceil(rows / world_size) each, the last ones shorter or
    empty)."""
    c = -(-rows // world_size)
    return min(rows, rank * c), min(rows, (rank + 1) * c)


def _spread(layer_bytes: Dict[str, int], world_size: int) -> Dict[str, int]:
    """Which rank writes each layer of a replicated (data-parallel) model:
    the largest layers first, each to the rank with the fewest bytes so far
    (ties to the lowest rank), so every rank writes about 1/world_size of the
    bytes. A pure function of the layers and the world size: every replica
    computes the same answer."""
    load = [0] * world_size
    owner: Dict[str, int] = {}
    order = sorted(enumerate(layer_bytes.items()), key=lambda x: (-x[1][1], x[0]))
    for _, (name, nbytes) in order:
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += nbytes
    return owner


def _parse_policy(policy: str, kind: str, layercheck: Optional[dict], record_trace: bool) -> dict:
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


def _budget_for_rank(policy: dict, layers: Dict[str, dict], layer_bytes: Dict[str, int],
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


class _ModelTensor(NamedTuple):
    """A tensor of the model or its optimizer, whole, before registration."""
    name: str
    tensor: torch.Tensor
    layer: str
    kind: str
    frozen: bool
    spec: Dict[str, Any]  # role, optimizer group and hyper-parameters


@dataclasses.dataclass
class _Entry:
    """One registered tensor: where it lives and how ckptd sees it."""
    name: str
    tensor: torch.Tensor
    layer: str
    spec: Dict[str, Any]
    # The flat tensor whose storage `tensor` views and which must move with
    # it (FSDP2's padded shard, which its all-gathers read); None when the
    # tensor owns its storage.
    base: Optional[torch.Tensor] = None


# Live attachments, for the refusals of a second attach() and of steps by
# an optimizer that was not attached.
_LIVE: "weakref.WeakSet[Attached]" = weakref.WeakSet()
_GUARD_HANDLE = None


def _guard_other_optimizers(optimizer, args, kwargs):
    """Global step pre-hook: an optimizer that steps parameters of an attached
    model but is not the attached optimizer would change them unprotected."""
    for run in list(_LIVE):
        if optimizer is run.optimizer or run._closed:
            continue
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in run._param_ids:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} steps parameters of the model attached to "
                        f"job '{run.job_id}' rank {run.rank} through another optimizer, which "
                        "ckptd would not see: close() that run and attach() this optimizer")


def _newest_durable(client: "ckpt.Client", job: str, rank: int,
                    unknown: Optional[int]) -> int:
    """The rank's newest durable step from its ckptd (its latest plan's
    target): 0 when it has none, `unknown` when ckptd does not answer (None:
    raise)."""
    try:
        return client.plan(0, job_id=job, rank=rank)["target_step"]
    except ckpt.Error as e:
        if e.code == "NOT_FOUND":
            return 0
        if unknown is not None:
            return unknown  # any failure: the agreement goes on without a new figure
        raise


def _min_over(group: Any, value: int) -> int:
    """The smallest of every rank's `value` (all-reduce MIN over `group`)."""
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


class _Agreement:
    """What the ranks agree on, over a gloo process group, on one background
    thread (collectives in step order on every rank), overlapping the next
    forward and backward; the next optimizer step waits for it before its
    fence.

    - Multi-rank LayerCheck (`drift`): after StepDone(t), this rank's
      per-layer drift sums of step t are all-reduced and handed back to
      ckptd, so every rank selects the same layers at the same step.
    - Every `every` steps, the agreed durable step: each rank's newest
      durable step, all-reduced (MIN). The next StepDone reports it to
      ckptd (ckpt_global_durable_lag_steps).

    A rank whose ckptd cannot answer still takes part, so the others never
    wait for it: with zeros in the drift sums, and with the newest durable
    step it last heard of (its versions stay on its node's disk)."""

    def __init__(self, client: "ckpt.Client", group: Any, drift: bool, every: int,
                 job: str, rank: int):
        self._client = client
        self._job = job
        self._rank = rank
        self._group = group
        self._drift = drift
        self._every = every
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-agree")
        self._pending: Optional[concurrent.futures.Future] = None
        self._own_durable = 0
        self.drift_seconds: List[float] = []
        self.durable_seconds: List[float] = []
        self.agreed: Optional[int] = None  # the last agreed durable step

    def submit(self, step: int, layers: int) -> None:
        if self._drift or (self._every and step % self._every == 0):
            self._pending = self._pool.submit(self._run, step, layers)

    def _run(self, step: int, layers: int) -> None:
        # Every collective runs on every rank whatever fails on this one;
        # the error is raised after the last.
        error: Optional[BaseException] = None
        if self._drift:
            try:
                self._exchange(step, layers)
            except ckpt.Error as e:
                error = e
        if self._every and step % self._every == 0:
            self.agreed = self.durable_min()
        if error is not None:
            raise error

    def own_durable(self) -> int:
        """This rank's newest durable step (the last one heard of when its
        ckptd does not answer)."""
        self._own_durable = _newest_durable(self._client, self._job, self._rank,
                                            self._own_durable)
        return self._own_durable

    def durable_min(self) -> int:
        t0 = time.perf_counter()
        agreed = _min_over(self._group, self.own_durable())
        self.durable_seconds.append(time.perf_counter() - t0)
        return agreed

    def _exchange(self, step: int, layers: int) -> None:
        import torch.distributed as dist
        t0 = time.perf_counter()
        error = None
        try:
            partial = self._client.drift_partials(step)
        except ckpt.Error as e:
            partial, error = [(0.0, 0.0)] * layers, e
        flat = torch.tensor([x for pair in partial for x in pair], dtype=torch.float64)
        dist.all_reduce(flat, group=self._group)
        if error is None:
            v = flat.tolist()
            try:
                self._client.set_global_drift(step, list(zip(v[0::2], v[1::2])))
            except ckpt.Error as e:
                error = e
        # Training on unprotected (on_daemon_loss="continue") is not an error.
        if error is not None and not self._client.unprotected:
            raise error
        self.drift_seconds.append(time.perf_counter() - t0)

    def join(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.join()
        finally:
            self._pool.shutdown(wait=True)


def _agreement_group(process_group: Any, required: bool) -> Any:
    """The gloo group the ranks agree over (drift sums, the durable step);
    None when torch.distributed is not initialized and nothing requires it."""
    import torch.distributed as dist
    if process_group is not None:
        return process_group
    if not (dist.is_available() and dist.is_initialized()):
        if not required:
            return None
        raise ValueError(
            "world_size > 1 with policy 'layercheck' all-reduces each step's layer drift over the "
            "job's process group: initialize torch.distributed first (or pass process_group=)")
    # A group of its own, on gloo (CPU tensors, never the training NCCL group
    # from a background thread). new_group is collective: every rank
    # attaches in the same order.
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=5))


class Attached:
    """A model and optimizer attached to ckptd (see attach())."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 client: "ckpt.Client", job_id: str, rank: int, world_size: int, policy: str,
                 layercheck: Optional[dict], layers: Optional[LayerOf],
                 scheduler: Any, record_trace: bool, process_group: Any = None,
                 scheduler_step: str = "optimizer", replicated: Optional[bool] = None,
                 agree_every: int = 10):
        global _GUARD_HANDLE
        if not isinstance(client, ckpt.Client):
            raise TypeError("client must be a ckpt.Client")
        if scheduler_step not in ("optimizer", "manual"):
            raise ValueError("scheduler_step must be 'optimizer' or 'manual'")
        if agree_every < 0:
            raise ValueError("agree_every must be >= 0 (0: no periodic agreement)")
        self.client = client
        self.job_id = job_id
        self.rank = rank
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scheduler_step = scheduler_step
        self.extra_state: Dict[str, Any] = {}
        # The scheduler state restore() found, before any replay (ckpt.hf
        # loads it into the Trainer's own scheduler).
        self.restored_scheduler_state: Optional[dict] = None
        self._world_size = world_size
        # Data-parallel replicas: each layer is written by one rank.
        ddp = _instance_of(model, "torch.nn.parallel", "DistributedDataParallel")
        self._replicated = world_size > 1 and (ddp if replicated is None else bool(replicated))
        self._kind = _optimizer_kind(optimizer)
        self._policy = _parse_policy(policy, self._kind, layercheck, record_trace)
        if self._replicated and "layercheck" in self._policy:
            # Each rank decides the layers it writes, from identical replicas.
            self._policy["layercheck"]["local_drift"] = True
        self._owners: Dict[str, int] = {}  # replicated: layer -> the rank writing it
        # After registration: every entry of each layer, and each layer's bytes.
        self._by_layer: Dict[str, List[_Entry]] = {}
        self._layer_bytes: Dict[str, int] = {}
        self._layer_of = layers
        self._data_position: Any = None
        self._step = 0
        self._registered = False
        self._closed = False
        self._internal = False  # the state-creating step of restore()
        self._aux_checked: Any = None  # the shape of the last state checked loadable
        self._read_only_below = 0  # restore() of an older step: no training after it
        # The first step this job reports to ckptd (restore(from_job=) starts
        # a job at the old job's step + 1).
        self._first_reported = 1
        self._entries: List[_Entry] = []
        self._frozen_layers: List[str] = []
        self._layer_names: List[str] = []
        self._frozen_in_optimizer: List[Tuple[str, torch.nn.Parameter]] = []
        self._trained_params: List[Tuple[str, torch.nn.Parameter, int]] = []
        self._step_counts: List[int] = []
        self._fence_wait_s: List[float] = []
        self._step_done_s: List[float] = []

        self._params = self._collect_params()
        self._param_ids = {id(p) for _, p, _ in self._params}
        self._sharded = any(_is_dtensor(p) for _, p, _ in self._params)  # FSDP2
        self._buffers = self._collect_buffers()
        self._device = self._one_device()
        for run in list(_LIVE):
            if not run._closed and (run.optimizer is optimizer or run._param_ids & self._param_ids):
                raise RuntimeError(
                    f"this model or optimizer is already attached to job '{run.job_id}' rank "
                    f"{run.rank}; call close() on that run before attaching again")
        if client.generation != 0 or any(run.client is client for run in _LIVE):
            # A client keeps its regions and step count across registrations.
            raise ValueError("this ckpt.Client was used by an earlier attach(); give each "
                             "attach() a new ckpt.Client")
        self._agreement: Optional[_Agreement] = None
        self._group = None
        if world_size > 1:
            layercheck_policy = self._policy["kind"] == "LAYERCHECK"
            self._group = _agreement_group(
                process_group, required=layercheck_policy or self._replicated)
            if self._group is not None:
                import torch.distributed as dist
                if dist.get_rank(self._group) != rank or dist.get_world_size(self._group) != world_size:
                    raise ValueError(
                        f"rank {rank} of {world_size} does not match the process group (rank "
                        f"{dist.get_rank(self._group)} of {dist.get_world_size(self._group)})")
            if self._group is not None:
                self._agreement = _Agreement(client, self._group,
                                             drift=layercheck_policy and not self._replicated,
                                             every=agree_every, job=job_id, rank=rank)
        self._hooks = [optimizer.register_step_pre_hook(self._pre_step),
                       optimizer.register_step_post_hook(self._post_step)]
        if _GUARD_HANDLE is None:
            _GUARD_HANDLE = register_optimizer_step_pre_hook(_guard_other_optimizers)
        _LIVE.add(self)

    # ---- set-up ----

    def _collect_params(self) -> List[Tuple[str, torch.nn.Parameter, Optional[int]]]:
        """(name, parameter, optimizer group or None) in model order."""
        group_of: Dict[int, int] = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        params = list(self.model.named_parameters())
        names = {id(p) for _, p in params}
        if any(i not in names for i in group_of):
            raise ValueError("the optimizer holds a parameter that is not in the model")
        out = []
        for name, p in params:
            _check_mappable(name, _local(p))
            out.append((name, p, group_of.get(id(p))))
        return out

    def _trained(self) -> List[Tuple[str, torch.nn.Parameter, int]]:
        """Parameters the optimizer steps: in it and requiring grad (decided
        at registration; see _check_frozen)."""
        return [(n, p, gi) for n, p, gi in self._params if gi is not None and p.requires_grad]

    def _collect_buffers(self) -> List[Tuple[str, torch.Tensor]]:
        """Persistent buffers (those a state_dict holds)."""
        persistent = set(self.model.state_dict(keep_vars=True))
        out = []
        for name, b in self.model.named_buffers():
            if b is None or name not in persistent:
                continue
            _check_mappable(name, b)
            out.append((name, b))
        return out

    def _one_device(self) -> torch.device:
        seen: Dict[torch.device, str] = {}
        for name, t in [(n, p) for n, p, _ in self._params] + self._buffers:
            seen.setdefault(t.device, name)
        if len(seen) > 1:
            where = ", ".join(f"'{n}' on {d}" for d, n in seen.items())
            raise ValueError(
                "ckpt.torch registers the tensors of one device per rank; this model has "
                f"tensors on {len(seen)} devices ({where}): move it to one device, or give each "
                "device its own rank")
        return next(iter(seen)) if seen else torch.device("cpu")

    def _layer(self, name: str) -> Tuple[str, str]:
        if self._layer_of is None:
            return default_layer_of(name)
        got = self._layer_of(name)
        return got if isinstance(got, tuple) else (got, "OTHER")

    def _layout(self) -> Tuple[List[_Entry], Dict[str, dict]]:
        """Every tensor to register (this rank's part of each), and the
        layers in first-appearance order."""
        layers: Dict[str, dict] = {}
        entries: List[_Entry] = []
        shards = _fsdp_shards(self.model)
        for m in self._model_tensors():
            layer = layers.setdefault(m.layer, {"name": m.layer, "kind": m.kind,
                                                "frozen": m.frozen, "tensors": []})
            local = _local(m.tensor)
            if local.numel() == 0:
                continue  # an empty shard (a dimension smaller than the world)
            _check_mappable(m.name, local)
            base = shards.get(id(m.tensor))
            if base is not None and base.untyped_storage().data_ptr() != \
                    local.untyped_storage().data_ptr():
                base = None  # the shard owns its storage
            spec = dict(m.spec, name=m.name, dtype=_DTYPE_NAMES[local.dtype],
                        shape=list(local.shape) or [1])
            entries.append(_Entry(m.name, local, m.layer, spec, base))
            layer["tensors"].append(spec)
        for lname, layer in layers.items():
            if not layer["tensors"]:
                # Every tensor of the layer is an empty shard on this rank.
                # The layer stays (every rank registers the same layers, in
                # the same order, for the drift all-reduce) with one byte.
                entries.append(self._pad_entry(lname, layer, lname + ".pad"))
        return entries, layers

    def _pad_entry(self, lname: str, layer: dict, name: str) -> _Entry:
        spec = {"name": name, "dtype": "U8", "shape": [1], "role": "OTHER"}
        layer["tensors"].append(spec)
        return _Entry(name, torch.zeros(1, dtype=torch.uint8, device=self._device), lname, spec)

    def _register(self) -> None:
        # Every trained parameter gets its state now, also one that had no
        # gradient yet (a branch not taken, an expert not routed to): the
        # layout must not change once registered.
        self._create_missing_state()
        self._frozen_in_optimizer = [(n, p) for n, p, gi in self._params
                                     if gi is not None and not p.requires_grad]
        self._trained_params = self._trained()
        self._read_step_counts()
        entries, layers = self._layout()
        by_layer: Dict[str, List[_Entry]] = {name: [] for name in layers}
        for e in entries:
            by_layer[e.layer].append(e)
        layer_bytes = {name: sum(e.tensor.numel() * e.tensor.element_size() for e in es)
                       for name, es in by_layer.items()}
        own_entries, own_layers = entries, layers
        if self._replicated:
            self._owners = _spread(layer_bytes, self._world_size)
            own_layers = {n: l for n, l in layers.items() if self._owners[n] == self.rank}
            own_entries = [e for e in entries if self._owners[e.layer] == self.rank]
            if not own_layers:
                # More replicas than layers: this rank writes no layer, only
                # the state saved with each step (its RNG, data position).
                lname = f"rank{self.rank}.state"
                layer = {"name": lname, "kind": "OTHER", "frozen": True, "tensors": []}
                own_layers, own_entries = {lname: layer}, [self._pad_entry(lname, layer, lname)]
        if self._device.type == "cpu":
            self._share_host_memory(own_entries)
        else:
            self._place_gpu_tensors(own_entries)
        whole: Dict[str, int] = {}
        budget = (self._policy.get("layercheck") or {}).get("budget")
        if budget and self._world_size > 1 and self._sharded and not self._replicated:
            for m in self._model_tensors():  # DTensors: their global sizes
                whole[m.layer] = whole.get(m.layer, 0) + m.tensor.numel() * m.tensor.element_size()
        policy = _budget_for_rank(self._policy, own_layers, layer_bytes,
                                  self._owners if self._replicated else {}, self.rank, whole)
        spec = {"job_id": self.job_id, "rank": self.rank, "world_size": self._world_size,
                "policy": policy, "layers": list(own_layers.values())}
        self.client.register(spec)
        self._entries = entries
        self._by_layer = by_layer
        self._layer_bytes = layer_bytes
        self._layer_names = list(layers)
        self._frozen_layers = [n for n, l in layers.items() if l["frozen"]]
        self._registered = True

    def _share_host_memory(self, entries: List[_Entry]) -> None:
        """Moves every tensor into one region ckptd maps: the tensor keeps its
        identity, its values and its hooks; only its storage changes (`.data =`)."""
        def moved(e: _Entry) -> torch.Tensor:
            return e.tensor if e.base is None else e.base

        offset = 0
        for e in entries:
            offset = _aligned(offset) + moved(e).numel() * moved(e).element_size()
        region = self.client.allocate_region(max(offset, 1))
        offset = 0
        with torch.no_grad():
            for e in entries:
                t = moved(e)
                offset = _aligned(offset)
                view = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=offset)
                view = view.view(t.shape)
                view.copy_(t)
                shift = 0
                if e.base is not None:
                    # The shard views the padded base: both move, the view
                    # keeping its place in the base.
                    v = e.tensor
                    shift = (v.storage_offset() - t.storage_offset()) * v.element_size()
                    t.data = view
                    v.data = torch.empty(0, dtype=v.dtype).set_(
                        view.untyped_storage(), view.storage_offset() + shift // v.element_size(),
                        v.shape, v.stride())
                else:
                    # `.data =`, not Tensor.set_: set_ gives a parameter a new
                    # gradient accumulator, and the hooks on the old one
                    # (DistributedDataParallel's, post-accumulate-grad hooks)
                    # would never run again.
                    t.data = view
                e.spec.update(region=region.index, offset=offset + shift)
                offset += t.numel() * t.element_size()
        self._region = region

    def _place_gpu_tensors(self, entries: List[_Entry]) -> None:
        """Hands ckptd each CUDA tensor where it is (no copy)."""
        for e in entries:
            t = e.tensor
            region, offset = self.client.add_gpu_tensor(t.data_ptr(), t.numel() * t.element_size(),
                                                        e.name)
            e.spec.update(region=region, offset=offset)

    def _create_missing_state(self) -> None:
        """Lets the optimizer make the state of every trained parameter that
        has none yet, exactly as its first step would leave it: one step
        over those parameters alone, with zero gradients, learning rate 0 and
        weight decay 0 (their weights do not move and their moments stay 0),
        after which their step counts are set back to 0."""
        missing = [p for _, p, _ in self._trained() if len(self.optimizer.state.get(p, {})) == 0]
        if not missing:
            return
        ids = {id(p) for p in missing}
        groups = self.optimizer.param_groups
        grads = [(p, p.grad) for g in groups for p in g["params"]]
        saved = [(g["lr"], g.get("weight_decay")) for g in groups]
        try:
            for p, _ in grads:
                p.grad = torch.zeros_like(p) if id(p) in ids else None
            for g in groups:
                g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
                if "weight_decay" in g:
                    g["weight_decay"] = 0.0
            self._internal = True
            self.optimizer.step()
        finally:
            self._internal = False
            for g, (lr, wd) in zip(groups, saved):
                g["lr"] = lr
                if wd is not None:
                    g["weight_decay"] = wd
            for p, grad in grads:
                p.grad = grad
        for p in missing:
            step = self.optimizer.state[p].get("step")
            if torch.is_tensor(step):
                step.zero_()
            elif step is not None:
                self.optimizer.state[p]["step"] = 0

    def _check_frozen(self) -> None:
        """Before a step: a parameter registered as frozen that the optimizer
        would now change (unfrozen after registration) is refused before it
        changes: ckptd would keep its bytes from when it was written."""
        for name, p in self._frozen_in_optimizer:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter '{name}' was frozen (requires_grad=False) when the rank "
                    f"registered with ckptd and now requires grad: ckptd keeps frozen weights "
                    "from when they were written. Unfreeze before the first optimizer step, or "
                    "close() and attach() the model to a new job")

    # ---- hooks ----

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self._internal or self._closed or not self._registered:
            return
        if self._step < self._read_only_below:
            raise RuntimeError(
                f"job '{self.job_id}' was restored to step {self._step}, older than its step "
                f"{self._read_only_below}: ckptd keeps a job's steps in order, so training cannot "
                "go on from an older step under the same job id (restore() the latest step, or "
                "attach to a new job)")
        self._check_frozen()
        if self._step < self._first_reported:
            return  # no step reported to ckptd yet: nothing to fence
        t0 = time.perf_counter()
        if self._agreement is not None:
            self._agreement.join()
        self.client.wait_snapshot(self._step)  # the fence: step t-1 is copied
        self._fence_wait_s.append(time.perf_counter() - t0)

    def _post_step(self, optimizer, args, kwargs) -> None:
        if self._internal or self._closed:
            return
        if not self._registered:
            self._register()  # the optimizer state exists now, counting this step
        else:
            self._count_step()
        t = self._step + 1
        aux = self._aux(t)
        blob = self._aux_blob(aux, t)
        if self._device.type == "cuda":
            self.client.set_cuda_stream(torch.cuda.current_stream(self._device).cuda_stream)
        t0 = time.perf_counter()
        agreed = self._agreement.agreed if self._agreement is not None else None
        if agreed is not None:
            agreed = min(agreed, t)
        self.client.step_done(t, float(self.optimizer.param_groups[0]["lr"]), blob, [],
                              aux["group_steps"], global_durable_step=agreed)
        self._step_done_s.append(time.perf_counter() - t0)
        self._step = t
        if self._agreement is not None:
            self._agreement.submit(t, len(self._layer_names))

    # ---- the state saved with each step ----

    def _read_step_counts(self) -> None:
        """Each trained parameter's step count from the optimizer state (-1:
        the optimizer keeps none, like SGD). Read once, at registration:
        a fused or capturable optimizer keeps them on the device, and
        reading them every step would wait for the step to finish."""
        counts = []
        for _, p, _ in self._trained_params:
            s = self.optimizer.state.get(p, {}).get("step")
            counts.append(-1 if s is None else int(s.item() if torch.is_tensor(s) else s))
        self._step_counts = counts

    def _count_step(self) -> None:
        """After an optimizer step: the optimizers count a parameter's step
        exactly when it had a gradient."""
        for i, (_, p, _) in enumerate(self._trained_params):
            if self._step_counts[i] >= 0 and p.grad is not None:
                self._step_counts[i] += 1

    def _group_steps(self) -> List[Tuple[int, int]]:
        """(group, step count) from the first parameter of each group that
        has one (a parameter that never stepped has none)."""
        steps: Dict[int, int] = {}
        for (_, _, gi), count in zip(self._trained_params, self._step_counts):
            if count >= 0 and gi not in steps:
                steps[gi] = count
        return sorted(steps.items())

    def _param_steps(self) -> List[int]:
        """Each trained parameter's own step count (Adam keeps one per
        parameter; one that had no gradient at a step did not count it)."""
        return list(self._step_counts)

    def _aux(self, step: int) -> dict:
        rng: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self._device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self._device)
        if "numpy" in sys.modules:
            np = sys.modules["numpy"]
            name, keys, pos, has_gauss, cached = np.random.get_state()
            rng["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                            int(has_gauss), float(cached)]
        return {"format": _AUX_FORMAT, "step": step, "rng": rng,
                "lrs": [float(g["lr"]) for g in self.optimizer.param_groups],
                "group_steps": self._group_steps(), "param_steps": self._param_steps(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "data_position": self._data_position, "extra": self.extra_state,
                "world_size": self._world_size, "replicated": self._replicated,
                "sharded": self._sharded}

    def _aux_blob(self, aux: dict, step: int) -> bytes:
        buf = io.BytesIO()
        torch.save(aux, buf)
        blob = buf.getvalue()
        shape = _type_shape([aux["data_position"], aux["extra"], aux["scheduler"]])
        if shape != self._aux_checked:
            # Whenever the kinds of values saved change: what cannot be read
            # back safely is refused now, not at restore time.
            try:
                _load_aux(blob, step)
            except ckpt.Error as e:
                raise TypeError(
                    "the state saved with each step must be tensors, numbers, strings, None, "
                    "lists, tuples and dicts (check set_data_position(), extra_state and the "
                    f"scheduler's state_dict()): {e.message}") from None
            self._aux_checked = shape
        return blob

    def _apply_aux(self, aux: dict) -> None:
        rng = aux["rng"]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self._device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self._device)
        random.setstate(_as_tuple(rng["python"]))
        if "numpy" in rng and "numpy" in sys.modules:
            np = sys.modules["numpy"]
            name, keys, pos, has_gauss, cached = rng["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        for g, lr in zip(self.optimizer.param_groups, aux["lrs"]):
            if torch.is_tensor(g["lr"]):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        trained = self._trained_params
        steps = aux["param_steps"]
        if len(steps) != len(trained):
            raise ckpt.Error("FAILED_PRECONDITION",
                             f"the checkpoint has step counts of {len(steps)} trained parameters, "
                             f"the model {len(trained)}")
        for (_, p, _), s in zip(trained, steps):
            st = self.optimizer.state.get(p, {}).get("step")
            if s < 0 or st is None:
                continue
            if torch.is_tensor(st):
                st.fill_(s)
            else:
                self.optimizer.state[p]["step"] = s
        self._read_step_counts()
        self.restored_scheduler_state = aux.get("scheduler")
        if self.scheduler is not None and self.restored_scheduler_state is not None:
            self.scheduler.load_state_dict(self.restored_scheduler_state)
            if self.scheduler_step == "optimizer" and not isinstance(
                    self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                # Saved after optimizer.step() and before the loop's
                # scheduler.step(); replay that one.
                self.scheduler.step()
        self._data_position = aux["data_position"]
        self.extra_state = aux["extra"]

    # ---- public ----

    @property
    def step(self) -> int:
        """The last step reported to ckptd (0 before the first)."""
        return self._step

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def registered(self) -> bool:
        """True once the rank is registered (after the first step or restore())."""
        return self._registered

    @property
    def layer_names(self) -> List[str]:
        return list(self._layer_names)

    @property
    def frozen_layers(self) -> List[str]:
        """Layers of weights the optimizer does not step: written once."""
        return list(self._frozen_layers)

    def tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """The registered tensors by layer: (name, the live tensor)."""
        return {layer: [(e.name, e.tensor) for e in es] for layer, es in self._by_layer.items()}

    def set_data_position(self, position: Any) -> None:
        """Where the data loader is (numbers, strings, lists, dicts or
        tensors); saved with the next step and given back by restore()."""
        self._data_position = position

    def plan(self, step: Optional[int] = None) -> Plan:
        """The composite plan for `step` (None = the latest durable one).
        Raises ckpt.Error NOT_FOUND when the job has no checkpoint."""
        return self._plan_of(self.client.plan(step or 0, job_id=self.job_id, rank=self.rank))

    def global_durable_step(self) -> int:
        """The newest step durable on every rank of the job: each rank's
        newest durable step, all-reduced (MIN) over the ranks' gloo group.
        Collective: every rank calls it at the same point. With one rank (or
        no torch.distributed), this rank's newest durable step; 0 for none."""
        own = _newest_durable(self.client, self.job_id, self.rank, unknown=None)
        if self._group is None:
            return own
        if self._agreement is not None:
            self._agreement.join()  # its collectives come first, on every rank
        return _min_over(self._group, own)

    @property
    def agreed_durable_step(self) -> Optional[int]:
        """The newest step durable on every rank, as the ranks last agreed
        (every agree_every steps, in the background); None before the first
        agreement or with one rank."""
        return self._agreement.agreed if self._agreement is not None else None

    def restore(self, step: Optional[int] = None, from_job: Optional[str] = None) -> Restored:
        """Restores the composite checkpoint for `step` (None = the latest
        durable one) into the live tensors, and the RNG states, learning
        rates, optimizer step counts, scheduler and data position saved with
        it. Raises ckpt.Error NOT_FOUND when the job has no checkpoint (and
        then changes nothing).

        With several ranks (torch.distributed initialized), `step` None is
        the newest step durable on every rank (global_durable_step();
        collective), and a rank whose ckptd holds later steps has them
        deleted, so that every rank goes on from the same step.

        `from_job`: restore another job's checkpoint into this (new) job,
        also onto another world size: each rank reads the old ranks' layers
        its node's ckptd holds and hands them to the others over the
        process group (no shared file system). A replicated (DDP)
        checkpoint restores onto any number of ranks, one rank's onto any,
        FSDP2 dim-0 shards onto any number of FSDP2 ranks (re-sliced); other
        layouts are refused naming a layer. The RNG states and
        data position are old rank 0's; this job's first step is then
        `target_step + 1`."""
        if self._agreement is not None:
            self._agreement.join()  # its collectives first, on every rank
            self._agreement.agreed = None  # agreed before the restore: no longer true
        if from_job is not None:
            return self._restore_from(from_job, step)
        agreed = step is None and self._group is not None
        if agreed:
            step = self.global_durable_step()
            if step == 0:
                raise ckpt.Error("NOT_FOUND", f"job {self.job_id} has no step durable on every "
                                 "rank")
        # The plan first: NOT_FOUND before anything is created, and the saved
        # state checked before any tensor is written.
        plan = self.client.plan(step or 0, job_id=self.job_id, rank=self.rank)
        target = plan["target_step"]
        aux = _load_aux(plan["aux"], target)
        if aux is not None:
            self._check_layout(aux, plan)
        latest = target if step is None else self.plan().target_step
        if not self._registered:
            self._register()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # no queued kernel writes after the restore
        reply = self.client.restore(target, discard_later=agreed)
        if self._replicated:
            self._broadcast_layers()
        if aux is not None:
            self._apply_aux(aux)
        behind = not agreed and target < max(latest, self._step)
        self._read_only_below = max(latest, self._step) if behind else 0
        self._step = target
        plan = self._plan_of(reply)
        return Restored(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)},
                        data_position=self._data_position,
                        bytes_restored=reply["bytes_restored"], seconds=reply["seconds"])

    def _check_layout(self, aux: dict, plan: dict) -> None:
        """Refuses, before anything is written, a checkpoint whose ranks held
        other parts of the model than this world's ranks do."""
        if "world_size" not in aux:
            return  # saved before ckpt.torch recorded the layout: as before, not checked
        saved = aux["world_size"]
        if saved == self._world_size and aux.get("replicated", False) == self._replicated:
            return
        layer = plan["layers"][0]["name"] if plan["layers"] else "?"
        how = "replicated (each layer written by one rank)" if aux.get("replicated") else \
            "held rank by rank (sharded or per-rank)"
        raise ckpt.Error(
            "FAILED_PRECONDITION",
            f"job '{self.job_id}' step {plan['target_step']} was saved by {saved} ranks, its "
            f"layers {how}; this run has {self._world_size} ranks"
            f"{', replicated' if self._replicated else ''}, so layer '{layer}' of rank "
            f"{self.rank} cannot be put back as saved (restore(from_job='{self.job_id}') in a "
            "new job restores a replicated checkpoint onto another world size)")

    def _broadcast_layers(self, owners: Optional[Dict[str, int]] = None) -> None:
        """After each rank restored what its own ckptd holds: each layer goes
        from the rank that read it (`owners`; default: the replicated
        layers' writers) to every other rank, over the ranks' gloo group (no
        shared file system: each rank read only its own ckptd)."""
        import torch.distributed as dist
        owners = self._owners if owners is None else owners
        with torch.no_grad():
            for lname, es in self._by_layer.items():
                owner = owners[lname]
                sizes = [e.tensor.numel() * e.tensor.element_size() for e in es]
                if owner == self.rank:
                    flat = torch.cat([e.tensor.detach().reshape(-1).view(torch.uint8).cpu()
                                      for e in es])
                else:
                    flat = torch.empty(sum(sizes), dtype=torch.uint8)
                dist.broadcast(flat, src=dist.get_global_rank(self._group, owner),
                               group=self._group)
                if owner == self.rank:
                    continue
                off = 0
                for e, n in zip(es, sizes):
                    e.tensor.reshape(-1).view(torch.uint8).copy_(flat[off:off + n])
                    off += n
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _all_gather(self, obj: Any) -> List[Any]:
        if self._group is None:
            return [obj]
        import torch.distributed as dist
        out: List[Any] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _restore_from(self, source: str, step: Optional[int]) -> Restored:
        """restore(from_job=source): see restore()."""
        t0 = time.perf_counter()
        if source == self.job_id:
            raise ValueError("from_job names this job; restore() it without from_job")
        if self._world_size > 1 and self._group is None:
            raise ValueError("restore(from_job=) with several ranks exchanges what each read over "
                             "the process group: initialize torch.distributed first (or pass "
                             "process_group=)")
        if self._registered and self._step > 0:
            raise RuntimeError(f"job '{self.job_id}' has trained steps already: restore from "
                               f"'{source}' into a new job, before its first step")
        # The source's world: the aux of any of its ranks this node holds.
        found: Optional[dict] = None
        for k in range(_MAX_SOURCE_RANKS):
            try:
                found = self.client.plan(step or 0, job_id=source, rank=k)
                break
            except ckpt.Error as e:
                if e.code != "NOT_FOUND":
                    raise
        aux0 = _load_aux(found["aux"], found["target_step"]) if found else None
        worlds = {a for a in self._all_gather(
            None if aux0 is None else (aux0.get("world_size", 1), aux0.get("replicated", False),
                                       aux0.get("sharded", False))) if a is not None}
        if not worlds:
            raise ckpt.Error("NOT_FOUND", f"job {source} has no checkpoint on any rank's ckptd")
        if len(worlds) > 1:
            raise ckpt.Error("FAILED_PRECONDITION", f"the ranks of job {source} disagree on its "
                             f"world: {sorted(worlds)}")
        old_world, replicated, sharded = worlds.pop()
        names = self._layer_names_unregistered()
        if sharded:
            self._check_reslicable(source, old_world)
        elif self._sharded:
            raise ckpt.Error(
                "FAILED_PRECONDITION",
                f"layer '{names[0]}' of job {source} holds whole tensors and this model is "
                "sharded (fully_shard): restore it into an unsharded model")
        elif old_world > 1 and not replicated:
            raise ckpt.Error(
                "FAILED_PRECONDITION",
                f"layer '{names[0]}' of job {source} was saved by each of {old_world} ranks "
                "separately; only replicated (DDP) checkpoints, FSDP2 dim-0 shards or one "
                f"rank's restore onto another world ({self._world_size} ranks)")
        # Which old ranks this node holds, and their newest durable steps.
        local: Dict[int, int] = {}
        for k in range(old_world):
            try:
                local[k] = self.client.plan(step or 0, job_id=source, rank=k)["target_step"]
            except ckpt.Error as e:
                if e.code != "NOT_FOUND":
                    raise
        held = self._all_gather(local)
        reader: Dict[int, int] = {}
        newest: Dict[int, int] = {}
        for r, d in enumerate(held):
            for k, t in d.items():
                # Spread the reading: old rank k to the new rank k % world
                # when it holds it, else to the first that does.
                if k not in reader or r == k % self._world_size:
                    reader[k] = r
                newest[k] = t
        missing = [k for k in range(old_world) if k not in reader]
        if missing:
            raise ckpt.Error("NOT_FOUND", f"job {source}: the checkpoint of rank {missing[0]} is "
                             "on no node of this job's ranks")
        # The newest step every old rank has (at or below `step`): each
        # rank's plan for it must be of exactly that step, checked below.
        target = min(newest.values())
        if not self._registered:
            self._register()
        if sharded:
            steps, aux_blob, read = self._reslice(source, old_world, reader, target)
        else:
            steps, aux_blob, read = self._read_replicated(source, old_world, reader, target)
        if self._group is not None:
            import torch.distributed as dist
            box = [aux_blob]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, reader[0]),
                                       group=self._group)
            aux_blob = box[0]
        steps = {n: s for d in self._all_gather(steps) for n, s in d.items()}
        aux = _load_aux(aux_blob, target)
        if aux is not None:
            self._apply_aux(aux)
        self._step = target
        self._first_reported = target + 1
        # This job's first StepDone is target + 1 (it has no steps: ckptd
        # takes any first step, and persists every layer at it).
        nbytes = self._layer_bytes
        layers = tuple(LayerPlan(name=n, step=steps.get(n, 0), staleness=target - steps.get(n, 0),
                                 bytes=nbytes[n], frozen=n in self._frozen_layers)
                       for n in self._layer_names)
        worst = max((l.staleness for l in layers if not l.frozen), default=0)
        total = sum(nbytes.values())
        return Restored(target_step=target, complete=all(l.step for l in layers),
                        total_bytes=total, max_staleness=worst,
                        size_weighted_staleness=sum(l.staleness * l.bytes for l in layers) /
                        max(total, 1), layers=layers, data_position=self._data_position,
                        bytes_restored=read,
                        seconds=time.perf_counter() - t0)

    def _read_replicated(self, source: str, old_world: int, reader: Dict[int, int],
                         target: int) -> Tuple[Dict[str, int], bytes, int]:
        """Replicated layers (or one rank's) onto this world: each reader
        takes the layers its old ranks wrote straight into the registered
        tensors, then each layer goes from its reader to every rank. Returns
        the layers' steps, old rank 0's saved state and the bytes read here."""
        # The old layout's writers: the ranks were replicas of this model.
        writer = (_spread(self._layer_bytes, old_world) if old_world > 1
                  else {n: 0 for n in self._layer_names})
        steps: Dict[str, int] = {}
        aux_blob = b""
        read = 0
        with torch.no_grad():
            for k in sorted(k for k, r in reader.items() if r == self.rank):
                mine = [n for n in self._layer_names if writer[n] == k]
                dests: Dict[str, Any] = {}
                staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
                for e in (e for n in mine for e in self._by_layer[n]):
                    t = e.tensor
                    if t.device.type != "cpu":
                        host = torch.empty(t.numel(), dtype=t.dtype)
                        staged.append((host, t))
                        t = host
                    dests[e.name] = t.detach().reshape(-1).view(torch.uint8).numpy()
                if not mine:
                    dests[f"rank{k}.state"] = bytearray(1)  # an owner of no layer
                plan = self.client.export_into(source, k, target, dests)
                _check_step(plan, source, k, target)
                for host, t in staged:
                    t.copy_(host.view(t.shape))
                steps.update({l["name"]: l["step"] for l in plan["layers"]})
                read += sum(self._layer_bytes[n] for n in mine)
                if k == 0:
                    aux_blob = plan["aux"]
        if self._group is not None:
            self._broadcast_layers({n: reader[writer[n]] for n in self._layer_names})
        return steps, aux_blob, read

    def _model_tensors(self) -> List["_ModelTensor"]:
        """Every tensor the rank registers, in registration order, each whole
        (a DTensor, of its global shape, for FSDP2 parameters and their
        optimizer state), with its layer and what ckptd is told about it. A
        frozen parameter goes to '<layer>.frozen'."""
        groups = self.optimizer.param_groups
        base_lr = float(groups[0]["lr"]) or 1.0
        out: List[_ModelTensor] = []
        for name, p, gi in self._params:
            if p.numel() == 0:
                continue  # nothing to keep
            lname, kind = self._layer(name)
            if gi is None or not p.requires_grad:
                out.append(_ModelTensor(name, p, lname + ".frozen", kind, True, {"role": "PARAM"}))
                continue
            g = groups[gi]
            betas = g.get("betas", (0.0, 0.0))
            out.append(_ModelTensor(name, p, lname, kind, False, {
                "role": "PARAM", "group": gi, "lr_scale": float(g["lr"]) / base_lr,
                "weight_decay": g.get("weight_decay", 0.0), "beta1": float(betas[0]),
                "beta2": float(betas[1]), "eps": g.get("eps", 0.0)}))
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if key != "step" and torch.is_tensor(v) and v.shape == p.shape:
                    out.append(_ModelTensor(f"{name}.{key}", v, lname, kind, False, {
                        "role": _STATE_ROLES.get(key, "OTHER"), "group": gi, "param": name}))
        for name, b in self._buffers:
            if b.numel() > 0:
                lname, kind = self._layer(name)
                out.append(_ModelTensor(name, b, lname, kind, False, {"role": "OTHER"}))
        return out

    def _check_reslicable(self, source: str, old_world: int) -> None:
        """Before anything is registered or written: FSDP2 shards restore
        onto another world when this model is sharded too, on dim 0."""
        for name, p, _ in self._params:
            layer = self._layer(name)[0]
            if not _is_dtensor(p):
                raise ckpt.Error(
                    "FAILED_PRECONDITION",
                    f"layer '{layer}' of job {source} was saved as shards of {old_world} ranks and "
                    f"'{name}' is not sharded here: fully_shard the model first")
            if any(not (pl.is_shard() and pl.dim == 0) for pl in p.placements):
                raise ckpt.Error(
                    "FAILED_PRECONDITION",
                    f"layer '{layer}' tensor '{name}' is placed {p.placements}: only dim-0 "
                    "shards re-slice onto another number of ranks")

    def _reslice(self, source: str, old_world: int, reader: Dict[int, int],
                 target: int) -> Tuple[Dict[str, int], bytes, int]:
        """FSDP2 shards of `old_world` ranks onto this world: each reader
        takes its old ranks' shards from its node's ckptd; then, tensor by
        tensor, every old shard goes to every rank (one whole tensor in
        memory at a time) and each rank keeps its new dim-0 rows. Returns the
        layers' steps, old rank 0's saved state and the bytes read here."""
        import torch.distributed as dist
        tensors = self._model_tensors()
        scratch: Dict[Tuple[int, str], torch.Tensor] = {}
        steps: Dict[str, int] = {}
        aux_blob = b""
        read = 0
        for k in sorted(k for k, r in reader.items() if r == self.rank):
            dests: Dict[str, Any] = {}
            filled: Dict[str, bool] = {}
            for name, t, layer, *_ in tensors:
                filled.setdefault(layer, False)
                shape = tuple(t.shape)
                if _is_dtensor(t):
                    a, b = _dim0_rows(shape[0], old_world, k)
                    if a == b:
                        continue  # an empty shard: not registered
                    shape = (b - a,) + shape[1:]
                buf = torch.empty(shape, dtype=t.dtype)
                if _is_dtensor(t) or k == 0:  # buffers: rank 0's
                    scratch[(k, name)] = buf
                dests[name] = buf.reshape(-1).view(torch.uint8).numpy()
                filled[layer] = True
                read += buf.numel() * buf.element_size()
            for layer, nonempty in filled.items():
                if not nonempty:
                    dests[layer + ".pad"] = bytearray(1)
            plan = self.client.export_into(source, k, target, dests)
            _check_step(plan, source, k, target)
            steps.update({l["name"]: l["step"] for l in plan["layers"]})
            if k == 0:
                aux_blob = plan["aux"]
        entries = {e.name: e for e in self._entries}
        with torch.no_grad():
            for name, t, *_ in tensors:
                e = entries.get(name)
                shape = tuple(t.shape)
                parts = ([(k,) + _dim0_rows(shape[0], old_world, k) for k in range(old_world)]
                         if _is_dtensor(t) else [(0, 0, 0)])
                whole = torch.empty(shape, dtype=t.dtype) if _is_dtensor(t) else None
                for k, a, b in parts:
                    if whole is not None and a == b:
                        continue
                    part = scratch.pop((k, name), None)
                    if part is None:
                        part = torch.empty((b - a,) + shape[1:] if whole is not None else shape,
                                           dtype=t.dtype)
                    if self._group is not None:
                        dist.broadcast(part, src=dist.get_global_rank(self._group, reader[k]),
                                       group=self._group)
                    if whole is None:
                        whole = part
                    else:
                        whole[a:b].copy_(part)
                if e is None:
                    continue  # this rank's new shard of it is empty
                if _is_dtensor(t):
                    a, b = _dim0_rows(shape[0], self._world_size, self.rank)
                    whole = whole[a:b]
                e.tensor.copy_(whole.reshape(e.tensor.shape))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return steps, aux_blob, read

    def _layer_names_unregistered(self) -> List[str]:
        return self._layer_names or [self._layer(n)[0] for n, _, _ in self._params] or ["?"]

    @property
    def owned_layers(self) -> List[str]:
        """The layers this rank writes: all of them, except with replicated
        (data-parallel) ranks, which each write about 1/world_size."""
        if not self._replicated:
            return list(self._layer_names)
        return [n for n in self._layer_names if self._owners.get(n) == self.rank]

    def resume(self) -> Optional[Restored]:
        """restore() when the job has a checkpoint; None (nothing changed)
        when it has none."""
        try:
            return self.restore()
        except ckpt.Error as e:
            if e.code == "NOT_FOUND":
                return None
            raise

    def wait_durable(self, tier: str = "local") -> int:
        """Waits until everything reported so far is durable; returns that step.
        tier="remote": until it is in ckptd's remote tier too (docs/remote.md)."""
        if self._agreement is not None:
            self._agreement.join()
        return self.client.wait_durable(self._step, tier)

    def stats(self) -> Stats:
        a = self._agreement
        return Stats(tuple(self._fence_wait_s), tuple(self._step_done_s),
                     tuple(a.drift_seconds) if a is not None else (),
                     tuple(a.durable_seconds) if a is not None else ())

    def close(self, drain: bool = True) -> None:
        """Removes the hooks and unregisters (after the staged steps are
        durable when `drain`). CPU tensors stay in the shared memory."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        _LIVE.discard(self)
        if self._agreement is not None:
            self._agreement.close()
        if self._registered:
            self.client.unregister(drain)

    def _plan_of(self, d: dict) -> Plan:
        frozen = set(self._frozen_layers)
        return Plan(target_step=d["target_step"], complete=d["complete"],
                    total_bytes=d["total_bytes"], max_staleness=d["max_staleness"],
                    size_weighted_staleness=d["size_weighted_staleness"],
                    layers=tuple(LayerPlan(name=l["name"], step=l["step"],
                                           staleness=l["staleness"], bytes=l["bytes"],
                                           frozen=l["name"] in frozen)
                                 for l in d["layers"]))


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _type_shape(x: Any, depth: int = 0) -> Any:
    """The kinds of values in `x` (types, dict keys, nesting), not the values:
    what decides whether torch.load(weights_only=True) can read it back."""
    if depth > 8:
        return type(x)
    if isinstance(x, dict):
        return (dict, tuple((k, _type_shape(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_type_shape(v, depth + 1) for v in x))
    if torch.is_tensor(x):
        return (torch.Tensor, x.dtype)
    return type(x)


def _load_aux(blob: bytes, step: int) -> Optional[dict]:
    """The state saved with `step`, read with PyTorch's restricted unpickler
    (weights_only): only tensors and plain containers and values."""
    if not blob:
        return None
    if not blob.startswith(b"PK\x03\x04"):  # torch.save's zip format
        raise ckpt.Error("FAILED_PRECONDITION",
                         f"the state saved with step {step} is not ckpt.torch's (a pickle from an "
                         "older ckpt.torch, or anything else); it is not loaded, since unpickling "
                         "can run code")
    try:
        aux = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means a damaged blob
        raise ckpt.Error("DATA_LOSS", f"the state saved with step {step} cannot be read "
                         f"({type(e).__name__}: {e}); it is damaged or not from ckpt.torch") from None
    if not isinstance(aux, dict) or aux.get("format") != _AUX_FORMAT:
        raise ckpt.Error("DATA_LOSS", f"the state saved with step {step} is not ckpt.torch's "
                         f"(format {aux.get('format') if isinstance(aux, dict) else type(aux)})")
    return aux


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, client: "ckpt.Client",
           job_id: str, rank: int = 0, world_size: int = 1, policy: str = "all",
           layercheck: Optional[dict] = None, layers: Optional[LayerOf] = None,
           scheduler: Any = None, record_trace: bool = False,
           process_group: Any = None, scheduler_step: str = "optimizer",
           replicated: Optional[bool] = None, agree_every: int = 10) -> Attached:
    """Attaches `model` and `optimizer` to ckptd through `client` and returns
    an Attached; the rank registers at the first optimizer step (or at
    restore()). `policy`: "all", "every_n:K", "layercheck", "explicit" or
    "none"; `layercheck`: its parameters (k0, k0_embedding, k_floor, s_max,
    warmup, warmup_interval, full_every, budget); `budget` is a write budget
    for the job, a dict with bytes_per_s and step_s (the declared seconds per
    step), or bytes_per_step, or share (of ckptd's configured device
    bandwidth) and step_s, and optionally k_min, k_max, horizon, layer_bytes
    (docs/layercheck.md); `layers`: None for the automatic grouping, or a
    callable name -> layer name (or (name, kind)).
    With world_size > 1 and policy "layercheck", each step's layer drift is
    all-reduced over `process_group` (default: a gloo group of the whole
    world, made here, so every rank must attach in the same order) and every
    rank selects the same layers.
    `replicated`: the ranks are data-parallel replicas with identical
    parameters and optimizer state (default: True when `model` is a
    DistributedDataParallel): each layer is written by one rank, the layers
    spread so that each rank writes about 1/world_size of the bytes, and
    restore() hands each layer from its writer to the others over the
    process group. FSDP2 (fully_shard) models register each rank's local
    shards (DTensor local tensors) and need no flag.
    `agree_every`: with several ranks, every that many steps the ranks agree
    (in the background, MIN all-reduce) on the newest step durable on all of
    them; `agreed_durable_step` holds it and ckptd exports how far each rank
    is ahead of it (ckpt_global_durable_lag_steps). 0 turns it off.
    `scheduler_step`: "optimizer" when the loop calls scheduler.step() after
    every optimizer.step() (restore replays the one after the restored step),
    "manual" when it steps the scheduler elsewhere (per epoch;
    ReduceLROnPlateau is never replayed).
    Raises ValueError naming the tensor for tensors ckptd cannot map (sparse,
    meta, non-contiguous, another device than the rest), RuntimeError when
    the model or optimizer is attached already, and ckpt.Error for refusals
    by ckptd."""
    return Attached(model, optimizer, client, job_id, rank, world_size, policy, layercheck,
                    layers, scheduler, record_trace, process_group, scheduler_step, replicated,
                    agree_every)
