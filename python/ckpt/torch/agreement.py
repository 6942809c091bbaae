"""What the ranks of a job agree on, over a gloo process group, on one
background thread: multi-rank LayerCheck's drift sums, and the newest step
durable on every rank."""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from typing import Any, List, Optional

import torch

import ckpt


# older_within for a plan asked only for its target step: a layer whose
# version was lost takes any older one, so the step is still found.
ANY_OLDER = (1 << 63) - 1


def newest_durable(client: "ckpt.Client", job: str, rank: int,
                   unknown: Optional[int]) -> int:
    """The rank's newest durable step from its ckptd (its latest plan's
    target): 0 when it has none, `unknown` when ckptd does not answer (None:
    raise)."""
    try:
        return client.plan(0, job_id=job, rank=rank, older_within=ANY_OLDER)["target_step"]
    except ckpt.Error as e:
        if e.code == "NOT_FOUND":
            return 0
        if unknown is not None:
            return unknown  # any failure: the agreement goes on without a new figure
        raise


def min_over(group: Any, value: int) -> int:
    """The smallest of every rank's `value` (all-reduce MIN over `group`)."""
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


class Agreement:
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
        self._own_durable = newest_durable(self._client, self._job, self._rank,
                                            self._own_durable)
        return self._own_durable

    def durable_min(self) -> int:
        t0 = time.perf_counter()
        agreed = min_over(self._group, self.own_durable())
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


def job_nodes(client: "ckpt.Client", group: Any, world_size: int) -> List[str]:
    """The node of each rank (its ckptd's name, Client.node()), in rank
    order, gathered over `group` (collective: every rank calls it): ckptd
    places the job's copies on peer nodes from it (docs/peer.md,
    "Placement"). One rank: its own node. [] without a group for several
    ranks, or when some rank's ckptd could not say; ckptd then places the
    job by its cluster's ring."""
    try:
        mine = client.node()
    except Exception:  # any failure: the collective below still runs on every rank
        mine = ""
    if world_size <= 1:
        return [mine] if mine else []
    if group is None:
        return []
    import torch.distributed as dist
    names: List[Any] = [None] * world_size
    dist.all_gather_object(names, mine, group=group)
    return [] if not all(isinstance(n, str) and n for n in names) else [str(n) for n in names]


def agreement_group(process_group: Any, required: bool) -> Any:
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
