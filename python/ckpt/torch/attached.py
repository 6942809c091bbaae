"""attach() and Attached: a model and optimizer attached to ckptd.

Attached is the facade the training loop sees. It owns one component per
concern and drives them: the Layout of the rank's tensors (layout.py), its
memory, host or GPU (host_memory.py, gpu.py), the checks that the tensors
stay where ckptd reads them (guard.py), the buffer mirrors (buffers.py), the
optimizer hooks and step counts (hooks.py), a GradScaler (scaler.py), the
state saved with each step (state.py), the agreement between ranks
(agreement.py), and restores (restore.py, reshard.py). It is
used by one thread, the training loop's; only the agreement runs on a
thread of its own."""

from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

import ckpt

from . import gpu, hooks
from .agreement import Agreement, agreement_group, job_nodes, min_over, newest_durable
from .buffers import BufferMirror
from .gpu import GpuMemory
from .guard import StorageGuard
from .host_memory import HostMemory
from .layout import Layout, LayerOf, instance_of
from .policy import budget_for_rank, has_budget, optimizer_kind, parse_policy
from .reshard import Exchange
from .restore import Restorer
from .scaler import ScalerLink
from .state import SavedState, load_aux
from .types import Plan, Restored, Stats, composite_of, plan_of, restored_of


class Attached:
    """A model and optimizer attached to ckptd (see attach())."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 client: "ckpt.Client", job_id: str, rank: int, world_size: int, policy: str,
                 layercheck: Optional[dict], layers: Optional[LayerOf],
                 scheduler: Any, record_trace: bool, process_group: Any = None,
                 scheduler_step: str = "optimizer", replicated: Optional[bool] = None,
                 agree_every: int = 10, scaler: Any = None):
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
        # Data-parallel replicas: each layer is written by one rank.
        ddp = instance_of(model, "torch.nn.parallel", "DistributedDataParallel")
        replicated = world_size > 1 and (ddp if replicated is None else bool(replicated))
        self._policy = parse_policy(policy, optimizer_kind(optimizer), layercheck, record_trace)
        if replicated and "layercheck" in self._policy:
            # Each rank decides the layers it writes, from identical replicas.
            self._policy["layercheck"]["local_drift"] = True
        self._layout = Layout(model, optimizer, layers, world_size, rank, replicated)
        hooks.check_unclaimed(optimizer, self._layout.param_ids, client)
        self._group, self._agreement = self._agree(process_group, agree_every)
        # Where each rank runs, for ckptd's placement of the job's copies
        # (over the group the ranks agree on; without one, this rank's node
        # alone: a new group would be a collective of the whole world).
        self._job_nodes = job_nodes(client, self._group, world_size)
        device = self._layout.device
        self._memory = HostMemory(client) if device.type == "cpu" else GpuMemory(client, device)
        self._state = SavedState(optimizer, scheduler, scheduler_step, device,
                                 (world_size, replicated, self._layout.sharded))
        self._counter = hooks.StepCounter(optimizer)
        self._frozen = hooks.FrozenGuard([])
        self._guard = StorageGuard(model, optimizer, job_id, self._memory)
        self._buffers = BufferMirror(model, job_id)
        self._scaler = ScalerLink(scaler, self._scaler_updated) if scaler is not None else None
        self._state.scaler = self._scaler
        # With a scaler: the step taken and not yet reported (its report
        # waits for scaler.update()): (step, its saved state, its lr).
        self._pending: Optional[Tuple[int, dict, float]] = None
        self._warned_update = False
        self._hold = False  # hold_reports
        exchange = Exchange(client, self._group, self._layout, self._memory)
        self._restorer = Restorer(client, job_id, self._layout, self._memory, exchange)
        self._step = 0
        self._registered = False
        self._closed = False
        self._read_only_below = 0  # restore() of an older step: no training after it
        # The first step this job reports to ckptd (restore(from_job=) starts
        # a job at the old job's step + 1).
        self._first_reported = 1
        self._fence_wait_s: List[float] = []
        self._step_done_s: List[float] = []
        self._hooks = hooks.StepHooks(optimizer, self._pre_step, self._post_step)
        hooks.claim(self, model, optimizer, self._layout.param_ids, client, job_id, rank)

    def _agree(self, process_group: Any, every: int) -> Tuple[Any, Optional[Agreement]]:
        """The ranks' gloo group and the agreement over it (None, None with
        one rank, or without torch.distributed when nothing requires it)."""
        world_size, replicated = self._layout.world_size, self._layout.replicated
        if world_size <= 1:
            return None, None
        layercheck = self._policy["kind"] == "LAYERCHECK"
        group = agreement_group(process_group, required=layercheck or replicated)
        if group is None:
            return None, None
        import torch.distributed as dist
        if dist.get_rank(group) != self.rank or dist.get_world_size(group) != world_size:
            raise ValueError(
                f"rank {self.rank} of {world_size} does not match the process group (rank "
                f"{dist.get_rank(group)} of {dist.get_world_size(group)})")
        return group, Agreement(self.client, group, drift=layercheck and not replicated,
                                every=every, job=self.job_id, rank=self.rank)

    # ---- registration ----

    def _register(self) -> None:
        """Registers the rank: the optimizer state completed, the layout
        built, its tensors placed where ckptd reads them, the policy with
        this rank's part of the budget."""
        layout = self._layout
        # Every trained parameter gets its state now, also one that had no
        # gradient yet (a branch not taken, an expert not routed to): the
        # layout must not change once registered.
        hooks.create_missing_state(self.optimizer, layout.trained(), self._hooks)
        self._frozen = hooks.FrozenGuard(layout.frozen_in_optimizer())
        self._counter.read(layout.trained())
        built = layout.build()
        self._buffers.mirror(built.entries)
        self._memory.place(built.own_entries)
        self._guard.watch(built.entries, [n for n, l in built.layers.items() if l["frozen"]])
        whole: Dict[str, int] = {}
        if has_budget(self._policy) and layout.world_size > 1 and layout.sharded and \
                not layout.replicated:
            whole = layout.whole_bytes()  # DTensors: their global sizes
        policy = budget_for_rank(self._policy, built.own_layers, built.layer_bytes,
                                 built.owners if layout.replicated else {}, self.rank, whole)
        self.client.register({"job_id": self.job_id, "rank": self.rank,
                              "world_size": layout.world_size, "policy": policy,
                              "layers": list(built.own_layers.values()),
                              "job_nodes": self._job_nodes})
        layout.adopt(built)
        self._registered = True

    # ---- hooks ----

    def _pre_step(self) -> None:
        self._refuse_capture()
        self._send_pending(missed_update=True)  # update() was not called
        if not self._registered:
            return
        if self._step < self._read_only_below:
            raise RuntimeError(
                f"job '{self.job_id}' was restored to step {self._step}, older than its step "
                f"{self._read_only_below}: ckptd keeps a job's steps in order, so training cannot "
                "go on from an older step under the same job id (restore() the latest step, or "
                "attach to a new job)")
        self._frozen.check()
        if self._step >= self._first_reported:  # a step was reported: fence it
            t0 = time.perf_counter()
            if self._agreement is not None:
                self._agreement.join()
            self.client.wait_snapshot(self._step)  # the fence: step t-1 is copied
            self._fence_wait_s.append(time.perf_counter() - t0)
        # ckptd has finished reading: move back what moved (guard.py). Step
        # counts follow replaced optimizer state by themselves (hooks.py).
        self._guard.check()

    def _refuse_capture(self) -> None:
        if gpu.capturing():
            raise RuntimeError(
                f"optimizer.step() of the model attached to job '{self.job_id}' is being "
                "captured into a CUDA graph: ckpt.torch's hooks would run once, at capture, and "
                "no replay would be checkpointed. Keep the optimizer step out of the graph "
                "(capture the forward and backward only), or do not attach this run")

    def _post_step(self) -> None:
        # (A captured step was refused by the pre-step hook already.)
        if not self._registered:
            self._register()  # the optimizer state exists now, counting this step
            self._check_continues_job()
        else:
            self._counter.count()
        # Everything of the step is taken now, before the loop goes on (the
        # next forward writes the buffers, draws from the RNG, the scheduler
        # steps); with a scaler only its state and the report wait for its
        # update() (scaler.py).
        t = self._step + 1
        self._buffers.capture()
        self._pending = (t, self._state.capture(t, self._counter),
                         float(self.optimizer.param_groups[0]["lr"]))
        if self._scaler is None and not self._hold:
            self._send_pending()

    def _check_continues_job(self) -> None:
        """The first step of an attachment that did not restore must come
        after the job's history in ckptd, which keeps a job's steps in order."""
        latest = self.client.latest_durable_step_at_register
        if latest > self._step:
            raise RuntimeError(
                f"job '{self.job_id}' rank {self.rank} already has checkpoints in ckptd (its last "
                f"durable step is {latest}) and this attachment did not restore, so its first "
                f"step would be step {self._step + 1}: call run.resume() after attach() to go "
                f"on with the job, or attach to a new job id to start over")

    def _scaler_updated(self) -> None:
        if not self._hold:
            self._send_pending()

    def _send_pending(self, missed_update: bool = False) -> None:
        """Reports the step taken (see _post_step)."""
        if self._pending is None:
            return
        t, aux, lr = self._pending
        self._pending = None
        if self._scaler is not None:
            if missed_update and not self._warned_update:
                self._warned_update = True
                warnings.warn(
                    f"ckpt.torch: the GradScaler attached to job '{self.job_id}' was not "
                    "updated between two optimizer steps; each step is reported at the next "
                    "one, with the scaler's state as it is then (pass attach(scaler=) the "
                    "scaler the loop calls update() on)", stacklevel=3)
            # After update(): the scaler's state, and step counts kept on a
            # device (state_dict() waits for the step anyway).
            if self._counter.on_device:
                self._counter.count(read_device=True)
                aux["group_steps"] = self._counter.group_steps()
                aux["param_steps"] = self._counter.param_steps()
            aux["scaler"] = self._scaler.state()
        blob = self._aux_blob(aux, t)
        self._memory.before_step_done()
        t0 = time.perf_counter()
        agreed = self._agreement.agreed if self._agreement is not None else None
        if agreed is not None:
            agreed = min(agreed, t)
        self.client.step_done(t, lr, blob, [], aux["group_steps"], global_durable_step=agreed)
        self._step_done_s.append(time.perf_counter() - t0)
        self._step = t
        if self._agreement is not None:
            self._agreement.submit(t, len(self._layout.layer_names))

    def _aux_blob(self, aux: dict, step: int) -> bytes:
        return self._state.blob(aux, step)

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
        return list(self._layout.layer_names)

    @property
    def frozen_layers(self) -> List[str]:
        """Layers of weights the optimizer does not step: written once."""
        return list(self._layout.frozen_layers)

    @property
    def owned_layers(self) -> List[str]:
        """The layers this rank writes: all of them, except with replicated
        (data-parallel) ranks, which each write about 1/world_size."""
        return self._layout.owned_layers()

    @property
    def scheduler(self) -> Any:
        """The LR scheduler whose state is saved with each step (settable)."""
        return self._state.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self._state.scheduler = scheduler

    @property
    def scheduler_step(self) -> str:
        """"optimizer" or "manual" (see attach())."""
        return self._state.scheduler_step

    @scheduler_step.setter
    def scheduler_step(self, how: str) -> None:
        self._state.scheduler_step = how

    @property
    def extra_state(self) -> Dict[str, Any]:
        """More state saved with each step (tensors and plain values)."""
        return self._state.extra_state

    @extra_state.setter
    def extra_state(self, state: Dict[str, Any]) -> None:
        self._state.extra_state = state

    @property
    def restored_scheduler_state(self) -> Optional[dict]:
        """The scheduler state restore() found, before any replay (None
        before a restore)."""
        return self._state.restored_scheduler_state

    @restored_scheduler_state.setter
    def restored_scheduler_state(self, state: Optional[dict]) -> None:
        self._state.restored_scheduler_state = state

    def tensors(self) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
        """The registered tensors by layer: (name, the tensor ckptd reads:
        the live tensor, or a buffer's mirror, buffers.py)."""
        return self._layout.tensors()

    @property
    def hold_reports(self) -> bool:
        """False (the default): each step is reported to ckptd by its
        optimizer step's post-hook. True: the step is taken there (tensors,
        buffers, optimizer and scheduler state) but reported only by
        report(), with the RNG states as they are then; for loops that draw
        from the RNG between steps in ways that belong to the step just
        taken (an evaluation: ckpt.hf). A step still held at the next
        optimizer step, wait_durable() or close() is reported then, with
        the RNG states of its post-hook."""
        return self._hold

    @hold_reports.setter
    def hold_reports(self, hold: bool) -> None:
        self._hold = bool(hold)

    def report(self) -> None:
        """Reports the step held since its optimizer step (hold_reports),
        its RNG states taken now; nothing when none is held."""
        if self._pending is not None:
            self._state.retake_rng(self._pending[1])
            self._send_pending()

    def set_data_position(self, position: Any) -> None:
        """Where the data loader is (numbers, strings, lists, dicts or
        tensors); saved with the next step and given back by restore()."""
        self._state.data_position = position

    def plan(self, step: Optional[int] = None) -> Plan:
        """The composite plan for `step` (None = the latest durable one).
        Raises ckpt.Error NOT_FOUND when the job has no checkpoint."""
        return plan_of(self.client.plan(step or 0, job_id=self.job_id, rank=self.rank),
                       set(self._layout.frozen_layers))

    def global_durable_step(self) -> int:
        """The newest step durable on every rank of the job: each rank's
        newest durable step, all-reduced (MIN) over the ranks' gloo group.
        Collective: every rank calls it at the same point. With one rank (or
        no torch.distributed), this rank's newest durable step; 0 for none."""
        own = newest_durable(self.client, self.job_id, self.rank, unknown=None)
        if self._group is None:
            return own
        if self._agreement is not None:
            self._agreement.join()  # its collectives come first, on every rank
        return min_over(self._group, own)

    @property
    def agreed_durable_step(self) -> Optional[int]:
        """The newest step durable on every rank, as the ranks last agreed
        (every agree_every steps, in the background); None before the first
        agreement or with one rank."""
        return self._agreement.agreed if self._agreement is not None else None

    def restore(self, step: Optional[int] = None, from_job: Optional[str] = None,
                older_within: int = 0) -> Restored:
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
        `target_step + 1`.

        A layer whose version the step needs was lost (damaged, and no
        tier holds an intact copy) fails the restore with ckpt.Error
        DATA_LOSS, reason "LOST_VERSION", naming it. `older_within` N > 0
        takes the layer's previous version instead when it is at most N
        steps older than the target (the Restored's layer says lost_step)."""
        if self._pending is not None:
            self._send_pending()
            self.client.wait_snapshot(self._step)  # ckptd restores no rank it is copying
        if step is None and from_job is None and self._group is None and self._registered and \
                self._step >= self._first_reported:
            # "The latest" is the latest this run reported, once ckptd has it
            # durable: on a loaded machine none may be yet (NOT_FOUND below).
            # A step that fails leaves the plan to say what is durable.
            try:
                self.client.wait_durable(self._step)
            except ckpt.Error:
                pass
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
        prepared = self._restorer.prepare(step, older_within)
        if not self._registered:
            self._register()
        self._guard.check()  # ckptd writes where the tensors are
        reply = self._restorer.write(prepared, discard_later=agreed)
        self._buffers.to_live()
        if prepared.aux is not None:
            self._state.apply(prepared.aux, self._counter)
        target, latest = prepared.target, prepared.latest
        behind = not agreed and target < max(latest, self._step)
        self._read_only_below = max(latest, self._step) if behind else 0
        self._step = target
        return restored_of(plan_of(reply, set(self._layout.frozen_layers)),
                           self._state.data_position, reply["bytes_restored"], reply["seconds"])

    def _restore_from(self, source: str, step: Optional[int]) -> Restored:
        """restore(from_job=source): see restore()."""
        t0 = time.perf_counter()
        if source == self.job_id:
            raise ValueError("from_job names this job; restore() it without from_job")
        if self._layout.world_size > 1 and self._group is None:
            raise ValueError("restore(from_job=) with several ranks exchanges what each read over "
                             "the process group: initialize torch.distributed first (or pass "
                             "process_group=)")
        if self._registered and self._step > 0:
            raise RuntimeError(f"job '{self.job_id}' has trained steps already: restore from "
                               f"'{source}' into a new job, before its first step")
        src = self._restorer.find_source(source, step)
        if not self._registered:
            self._register()
        steps, aux_blob, read = self._restorer.read_source(src)
        self._buffers.to_live()
        aux = load_aux(aux_blob, src.target)
        if aux is not None:
            self._state.apply(aux, self._counter)
        self._step = src.target
        # This job's first StepDone is target + 1 (it has no steps: ckptd
        # takes any first step, and persists every layer at it).
        self._first_reported = src.target + 1
        layout = self._layout
        plan = composite_of(src.target, steps, layout.layer_bytes, layout.layer_names,
                            layout.frozen_layers)
        return restored_of(plan, self._state.data_position, read, time.perf_counter() - t0)

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
        self._send_pending()
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
        try:
            if self._registered:
                self._send_pending()
        finally:
            # Detached whatever happens: a later attach() of the model works.
            self._closed = True
            self._hooks.remove()
            if self._scaler is not None:
                self._scaler.remove()
            hooks.release(self)
            if self._agreement is not None:
                self._agreement.close()
        if self._registered:
            self.client.unregister(drain)


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, client: "ckpt.Client",
           job_id: str, rank: int = 0, world_size: int = 1, policy: str = "all",
           layercheck: Optional[dict] = None, layers: Optional[LayerOf] = None,
           scheduler: Any = None, record_trace: bool = False,
           process_group: Any = None, scheduler_step: str = "optimizer",
           replicated: Optional[bool] = None, agree_every: int = 10,
           scaler: Any = None) -> Attached:
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
    `scaler`: the torch.amp.GradScaler of a mixed-precision loop; its state
    after each scaler.update() is saved with the step and restored (a step
    is reported to ckptd at that update()).
    Raises ValueError naming the tensor for tensors ckptd cannot map (sparse,
    meta, non-contiguous, another device than the rest), RuntimeError when
    the model or optimizer is attached already, and ckpt.Error for refusals
    by ckptd."""
    _check_daemon(client, job_id, rank)
    return Attached(model, optimizer, client, job_id, rank, world_size, policy, layercheck,
                    layers, scheduler, record_trace, process_group, scheduler_step, replicated,
                    agree_every, scaler)


def _check_daemon(client: "ckpt.Client", job_id: str, rank: int) -> None:
    """Asks ckptd for the job's plan (a read, NOT_FOUND for a new job), so
    that a ckptd that is not there is reported by attach() rather than at
    the first optimizer step."""
    try:
        client.plan(0, job_id, rank)
    except ckpt.Error as e:
        if e.code != "UNAVAILABLE":
            return
        why = (f"no ckptd answers ({e.message}): is ckptd running? (systemctl status ckptd; "
               "ckpt.Client(socket_path) names the socket)")
        if client.on_daemon_loss == "continue":  # training goes on unprotected, as asked
            warnings.warn("ckpt.torch: " + why, stacklevel=3)
            return
        raise ckpt.Error(e.code, why, e.reason) from None

