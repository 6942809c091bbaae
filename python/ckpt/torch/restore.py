"""What restore() reads before it writes anything, and how.

- A restore of this job: the plan, the saved state read and checked against
  this run's layout (prepare), then the composite checkpoint written into
  the registered tensors and, for replicas, handed between the ranks
  (write).
- restore(from_job=): the old job's world found from the state any of its
  ranks saved, the old ranks this node holds, who reads which old rank, and
  the newest step they all have (find_source); then the reads and the
  exchange between the ranks (read_source).
Used by Attached on the training loop's thread; the methods that exchange
run on every rank at the same point."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import ckpt

from .agreement import newest_durable
from .layout import Layout
from .reshard import Exchange, Read, check_reslicable
from .state import load_aux

MAX_SOURCE_RANKS = 4096  # restore(from_job=): old ranks probed for the old world


class Prepared(NamedTuple):
    """A restore of this job, checked and not yet written."""
    plan: dict
    target: int
    aux: Optional[dict]   # the state saved with the target step (None: none)
    latest: int           # the job's newest durable step
    older_within: int = 0  # what a lost version's layer may take instead


class Source(NamedTuple):
    """The old job of restore(from_job=) as this world sees it."""
    job: str
    old_world: int
    sharded: bool
    reader: Dict[int, int]  # old rank -> the new rank that reads it
    target: int             # the newest step every old rank has


class Restorer:
    """Restores of one rank (see the module's doc). `memory` is the rank's
    host_memory.HostMemory or gpu.GpuMemory."""

    def __init__(self, client: "ckpt.Client", job_id: str, layout: Layout, memory: Any,
                 exchange: Exchange):
        self._client = client
        self._job_id = job_id
        self._layout = layout
        self._memory = memory
        self._exchange = exchange

    def prepare(self, step: Optional[int], older_within: int = 0) -> Prepared:
        """The plan for `step` (None: the latest), with its saved state read
        and checked: NOT_FOUND before anything is created, and the saved
        state checked before any tensor is written. `older_within`: as in
        restore()."""
        plan = self._client.plan(step or 0, job_id=self._job_id, rank=self._layout.rank,
                                 older_within=older_within)
        target = plan["target_step"]
        aux = load_aux(plan["aux"], target)
        if aux is not None:
            self._check_layout(aux, plan)
        latest = target if step is None else \
            newest_durable(self._client, self._job_id, self._layout.rank, unknown=None)
        return Prepared(plan, target, aux, latest, older_within)

    def write(self, prepared: Prepared, discard_later: bool) -> dict:
        """Writes the prepared step into the registered tensors (REQUIRES:
        registered); replicas then hand each layer from its writer to the
        others. Returns the client's restore reply."""
        self._memory.synchronize()  # no queued kernel writes after the restore
        reply = self._client.restore(prepared.target, discard_later=discard_later,
                                     older_within=prepared.older_within)
        if self._layout.replicated:
            self._exchange.broadcast_layers()
        return reply

    def _check_layout(self, aux: dict, plan: dict) -> None:
        """Refuses, before anything is written, a checkpoint whose ranks held
        other parts of the model than this world's ranks do."""
        if "world_size" not in aux:
            return  # saved before ckpt.torch recorded the layout: as before, not checked
        layout = self._layout
        saved = aux["world_size"]
        if saved == layout.world_size and aux.get("replicated", False) == layout.replicated:
            return
        layer = plan["layers"][0]["name"] if plan["layers"] else "?"
        how = "replicated (each layer written by one rank)" if aux.get("replicated") else \
            "held rank by rank (sharded or per-rank)"
        raise ckpt.Error(
            "FAILED_PRECONDITION",
            f"job '{self._job_id}' step {plan['target_step']} was saved by {saved} ranks, its "
            f"layers {how}; this run has {layout.world_size} ranks"
            f"{', replicated' if layout.replicated else ''}, so layer '{layer}' of rank "
            f"{layout.rank} cannot be put back as saved (restore(from_job='{self._job_id}') in a "
            "new job restores a replicated checkpoint onto another world size)")

    # ---- restore(from_job=) ----

    def _plan_or_none(self, source: str, rank: int, step: Optional[int]) -> Optional[dict]:
        try:
            return self._client.plan(step or 0, job_id=source, rank=rank)
        except ckpt.Error as e:
            if e.code != "NOT_FOUND":
                raise
            return None

    def _old_world(self, source: str, step: Optional[int]) -> tuple:
        """(world size, replicated, sharded) of `source`, from the state
        saved by any of its ranks this world's nodes hold (collective)."""
        found: Optional[dict] = None
        for k in range(MAX_SOURCE_RANKS):
            found = self._plan_or_none(source, k, step)
            if found is not None:
                break
        aux0 = load_aux(found["aux"], found["target_step"]) if found else None
        worlds = {a for a in self._exchange.all_gather(
            None if aux0 is None else (aux0.get("world_size", 1), aux0.get("replicated", False),
                                       aux0.get("sharded", False))) if a is not None}
        if not worlds:
            raise ckpt.Error("NOT_FOUND", f"job {source} has no checkpoint on any rank's ckptd")
        if len(worlds) > 1:
            raise ckpt.Error("FAILED_PRECONDITION", f"the ranks of job {source} disagree on its "
                             f"world: {sorted(worlds)}")
        return worlds.pop()

    def find_source(self, source: str, step: Optional[int]) -> Source:
        """`source` at `step` (None: the newest step all its ranks have), or
        ckpt.Error NOT_FOUND / FAILED_PRECONDITION, before anything is
        registered or written (collective)."""
        layout = self._layout
        old_world, replicated, sharded = self._old_world(source, step)
        names = layout.names_for_messages()
        if sharded:
            check_reslicable(layout, source, old_world)
        elif layout.sharded:
            raise ckpt.Error(
                "FAILED_PRECONDITION",
                f"layer '{names[0]}' of job {source} holds whole tensors and this model is "
                "sharded (fully_shard): restore it into an unsharded model")
        elif old_world > 1 and not replicated:
            raise ckpt.Error(
                "FAILED_PRECONDITION",
                f"layer '{names[0]}' of job {source} was saved by each of {old_world} ranks "
                "separately; only replicated (DDP) checkpoints, FSDP2 dim-0 shards or one "
                f"rank's restore onto another world ({layout.world_size} ranks)")
        # Which old ranks this node holds, and their newest durable steps.
        local: Dict[int, int] = {}
        for k in range(old_world):
            plan = self._plan_or_none(source, k, step)
            if plan is not None:
                local[k] = plan["target_step"]
        reader: Dict[int, int] = {}
        newest: Dict[int, int] = {}
        for r, d in enumerate(self._exchange.all_gather(local)):
            for k, t in d.items():
                # Spread the reading: old rank k to the new rank k % world
                # when it holds it, else to the first that does.
                if k not in reader or r == k % layout.world_size:
                    reader[k] = r
                newest[k] = t
        missing = [k for k in range(old_world) if k not in reader]
        if missing:
            raise ckpt.Error("NOT_FOUND", f"job {source}: the checkpoint of rank {missing[0]} is "
                             "on no node of this job's ranks")
        # The newest step every old rank has (at or below `step`): each
        # rank's plan for it must be of exactly that step, checked when read.
        return Source(source, old_world, sharded, reader, min(newest.values()))

    def read_source(self, src: Source) -> Read:
        """Reads `src` into the registered tensors (REQUIRES: registered):
        each layer's step, old rank 0's saved state (on every rank) and the
        bytes read on this rank."""
        if src.sharded:
            steps, aux_blob, read = self._exchange.reslice(src.job, src.old_world, src.reader,
                                                           src.target)
        else:
            steps, aux_blob, read = self._exchange.read_replicated(src.job, src.old_world,
                                                                   src.reader, src.target)
        aux_blob = self._exchange.broadcast_blob(aux_blob, src.reader[0])
        steps = {n: s for d in self._exchange.all_gather(steps) for n, s in d.items()}
        return steps, aux_blob, read
