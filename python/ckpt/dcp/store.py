"""RankStore: one rank's DCP tensors held in ckptd.

A rank's tensors are copied, at staging, into one shared-memory region
ckptd maps (a memfd the client allocates), one slot per tensor, and
registered as one ckptd job of one rank: one layer per tensor, named by the
tensor's key, policy EXPLICIT. A commit reports a ckptd step listing the
layers whose bytes changed since the version ckptd last took; ckptd copies
them into its pinned pool, writes them with io_uring and checksums, and
every other layer of the step is the version it already holds (a frozen
base, a LoRA backbone: written once).

The job's name carries a digest of the layout (keys, dtypes, sizes), so a
state dict of another shape is another job and an old checkpoint keeps
naming the job that holds it. The ckptd steps of a RankStore are its own
(1, 2, ...: one per commit), not DCP's; the catalog (catalog.py) maps
checkpoint ids to them.

Its lock guards everything below: stage() runs on the trainer's thread and
commit() on DCP's upload thread."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

import torch

import ckpt

ALIGN = 64  # each slot starts on a cache line

# ckptd's dtype names; a tensor of any other dtype is held as its bytes (U8)
# and read back through the DCP metadata's dtype.
_CKPT_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                torch.uint8: "U8"}


class Stored(NamedTuple):
    """What a DCP WriteResult's storage_data names: where ckptd holds an
    item. A tensor: `job`'s layer `key`, taken at ckptd step `version`, as
    of the job's step `step`. A bytes item: the aux of `job`'s step `step`,
    under `key`."""
    job: str
    key: str
    step: int
    version: int
    nbytes: int
    is_bytes: bool = False


def client_for(socket_path: Optional[str], call_timeout_s: float,
               wait_timeout_s: float) -> "ckpt.Client":
    """A ckpt.Client of `socket_path` (the default socket when None)."""
    kwargs = {"call_timeout_s": call_timeout_s, "wait_timeout_s": wait_timeout_s}
    return ckpt.Client(socket_path, **kwargs) if socket_path else ckpt.Client(**kwargs)


def unregister(client: "ckpt.Client") -> None:
    """Ends `client`'s registration, its committed steps durable first. A
    registration another writer of the job replaced since (a writer per
    save, one per executor), or has closed, is not an error: every step
    ckpt.dcp commits is durable before its save returns, so nothing of it
    is left to drain."""
    try:
        client.unregister(drain=True)
    except ckpt.Error as e:
        if e.reason not in ("NOT_REGISTERED", "STALE_GENERATION"):
            raise


def dumps(obj: Any) -> bytes:
    """`obj` (plain data: dicts, lists, tuples, str, bytes, numbers) in
    torch.save's format."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(blob: bytes) -> Any:
    """dumps() undone with torch.load(weights_only=True), PyTorch's
    restricted unpickler: it builds plain data only, so a blob someone
    else wrote cannot make it run code."""
    return torch.load(io.BytesIO(blob), weights_only=True)


def plain_metadata(md: Any) -> dict:
    """DCP's Metadata as plain data for dumps(): what a load needs (its
    items' dtypes, sizes and chunks, the planner's data, where ckptd holds
    each item)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    items = {}
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            items[fqn] = ("tensor", str(v.properties.dtype).rpartition(".")[2], list(v.size),
                          [(list(c.offsets), list(c.sizes)) for c in v.chunks],
                          bool(v.properties.requires_grad))
        else:
            items[fqn] = ("bytes",)
    where = [(i.fqn, None if i.offset is None else list(i.offset), i.index, tuple(st))
             for i, st in (md.storage_data or {}).items()]
    return {"items": items, "planner_data": md.planner_data, "where": where,
            "version": getattr(md, "version", None)}


def metadata_of(plain: dict) -> Any:
    """plain_metadata() undone."""
    from torch.distributed.checkpoint import metadata as m
    items: Dict[str, Any] = {}
    for fqn, v in plain["items"].items():
        if v[0] == "tensor":
            dtype = getattr(torch, v[1], None)
            if not isinstance(dtype, torch.dtype):
                raise RuntimeError(f"the checkpoint names an unknown dtype {v[1]!r} for '{fqn}'")
            items[fqn] = m.TensorStorageMetadata(
                properties=m.TensorProperties(dtype=dtype, requires_grad=v[4]),
                size=torch.Size(v[2]),
                chunks=[m.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z))
                        for o, z in v[3]])
        else:
            items[fqn] = m.BytesStorageMetadata()
    where = {m.MetadataIndex(fqn, None if off is None else torch.Size(off), idx): Stored(*st)
             for fqn, off, idx, st in plain["where"]}
    md = m.Metadata(state_dict_metadata=items, planner_data=plain["planner_data"],
                    storage_data=where)
    if plain.get("version") is not None and hasattr(md, "version"):
        md.version = plain["version"]
    return md


class _Slot(NamedTuple):
    key: str
    layer: int
    nbytes: int
    dtype: torch.dtype
    view: torch.Tensor  # flat, of `dtype`, over the region


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors of one dtype hold the same bytes (not
    the same values: -0.0 and 0.0 differ, a NaN equals itself)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def layer_spec(key: str, t: torch.Tensor, region: int, offset: int) -> dict:
    """The ckptd layer that holds tensor `t` (its bytes, flat) at `offset`
    of `region`: one tensor named `key`, of t's dtype when ckptd has it,
    else its bytes (U8)."""
    dtype = _CKPT_DTYPES.get(t.dtype)
    spec = {"name": key, "shape": [t.numel() if dtype is not None else nbytes_of(t)],
            "dtype": dtype or "U8", "role": "OTHER", "region": region, "offset": offset}
    return {"name": key, "kind": "OTHER", "tensors": [spec]}


def check_snapshot(job: str, step: int, snap: dict) -> None:
    """Raises unless ckptd took every layer of `job`'s `step` (`snap`: its
    WaitSnapshot reply)."""
    if snap["lost"]:
        raise RuntimeError(f"ckptd restarted during the save of job {job} step {step}: this "
                           "checkpoint is not saved; save again")
    if snap["skipped"]:
        taken = len(snap["layers"])
        raise RuntimeError(
            f"ckptd took {taken} of {taken + snap['skipped']} tensors of job {job} step {step}: "
            "its staging pool had no room for the rest (give ckptd a staging_pool_bytes of at "
            "least one rank's state dict); this checkpoint is not saved")


class GivenUp(TimeoutError):
    """A stage waited the store's wait_timeout_s for the previous save to
    be written, and gave that save up."""


class Turn:
    """Which save a store holds, by checkpoint id (`tag`; None when the
    stage did not know it: a store staged and committed in one call, or a
    stage() called by hand before dcp.save): one save at a time, so that a
    stage does not replace the bytes the previous save is about to report.
    A commit is told from another save's only when both know their ids.
    The store's lock guards it.

    stage() takes the turn (take, then hold once its bytes are in); the
    save's commit checks that the turn is its own and releases it; a save
    whose stage failed gives it back (release). A stage that waits longer
    than the timeout gives the previous save up: that save failed before
    its write (DCP tells the writer nothing then) or is stuck; should its
    commit come after all, it is refused rather than report what a later
    save staged."""

    def __init__(self, lock: threading.Lock):
        self._idle = threading.Condition(lock)
        self.held = False
        self.tag: Optional[str] = None
        self._given_up: "collections.deque[Optional[str]]" = collections.deque(maxlen=64)

    def take(self, job: str, timeout_s: float) -> None:
        """Waits until no save holds the turn; GivenUp after `timeout_s`
        (the save holding it is given up, and this one refused: the next
        goes ahead)."""
        if not self._idle.wait_for(lambda: not self.held, timeout=timeout_s):
            self.give_up()
            raise GivenUp(
                f"job {job}: the previous save was staged but not written within {timeout_s} s "
                "(it failed, or is still planning: its future says which); this save is "
                "refused, the next one goes ahead")

    def hold(self, tag: Optional[str]) -> None:
        self.held, self.tag = True, tag
        if tag in self._given_up:  # a new save of that id
            self._given_up.remove(tag)

    def holds(self, tag: Optional[str]) -> bool:
        """Whether save `tag` holds the turn (as check() tells saves apart)."""
        return self.held and (None in (self.tag, tag) or self.tag == tag)

    def check(self, job: str, tag: Optional[str]) -> None:
        """Raises unless a commit of save `tag` may go ahead."""
        if tag is not None and tag in self._given_up:
            raise RuntimeError(f"job {job}: save {tag!r} was given up before it was written (a "
                               "later save waited for it longer than wait_timeout_s); this "
                               "checkpoint is not saved")
        if self.held and not self.holds(tag):
            raise RuntimeError(f"job {job}: save {tag!r} is written while save {self.tag!r} "
                               "is staged; this checkpoint is not saved")

    def release(self) -> None:
        self.held, self.tag = False, None
        self._idle.notify_all()

    def give_up(self) -> None:
        """The save holding the turn will not be written: its commit, should
        it come, is refused, and the next stage goes ahead."""
        if self.held:
            if self.tag is not None:
                self._given_up.append(self.tag)
            self.release()


def layout_digest(tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key, t in tensors.items():
        h.update(f"{key}\0{t.dtype}\0{nbytes_of(t)}\n".encode())
    return h.hexdigest()[:12]


class StoreBase:
    """What RankStore and GpuStore (gpu_store.py) share: one rank's ckptd
    job of one rank, its client, the save holding its turn, and its lock,
    which guards all of it."""

    def __init__(self, socket_path: Optional[str], job_id: str, rank: int,
                 call_timeout_s: float = 60.0, wait_timeout_s: float = 600.0):
        self._socket = socket_path
        self._job_id = job_id
        self._rank = rank
        self._timeouts = (call_timeout_s, wait_timeout_s)
        self._lock = threading.Lock()
        self._turn = Turn(self._lock)  # the save staged, not yet committed
        self._client: Optional[ckpt.Client] = None
        self._job = ""
        self._next_step = 1
        self._last_step = 0  # the last step reported to ckptd

    def wait_durable(self, tier: str) -> int:
        """Waits until the last committed step is durable in `tier`
        ("local", "peer", "remote"); returns the tier's newest step (0: none
        yet)."""
        with self._lock:
            if self._client is None or self._last_step == 0:
                return 0
            return self._client.wait_durable(self._last_step, tier)

    @property
    def job(self) -> str:
        return self._job

    def abandon(self) -> None:
        """What is staged will not be committed (the rest of its save
        failed): the next stage goes ahead and writes those tensors again."""
        with self._lock:
            if self._turn.held:
                self._staged_dropped()
                self._turn.release()

    def give_up(self) -> None:
        """The save staged will not be written (its stage failed in the
        other store by waiting too long for it): Turn.give_up."""
        with self._lock:
            if self._turn.held:
                self._staged_dropped()
                self._turn.give_up()

    def staged_as(self, tag: Optional[str]) -> bool:
        """Whether save `tag` holds a staged step here."""
        with self._lock:
            return self._turn.holds(tag)

    def _take_turn(self) -> None:
        """Waits, with the lock held, until no staged save holds the turn
        (Turn.take); one given up on the way is dropped as give_up drops it."""
        try:
            self._turn.take(self._job, self._timeouts[1])
        except GivenUp:
            self._staged_dropped()
            raise

    @contextlib.contextmanager
    def _committing(self, tag: Optional[str]):
        """The commit of save `tag`, with the lock held: refused unless that
        save may commit (Turn.check); the turn is free again after it,
        whatever happens."""
        with self._lock:
            self._turn.check(self._job, tag)
            try:
                yield
            finally:
                self._turn.release()

    def _staged_dropped(self) -> None:
        """What a store forgets when its staged save goes without a commit."""


class RankStore(StoreBase):
    """One rank's tensors in ckptd (see the module's doc)."""

    def __init__(self, socket_path: Optional[str], job_id: str, rank: int,
                 call_timeout_s: float = 60.0, wait_timeout_s: float = 600.0):
        super().__init__(socket_path, job_id, rank, call_timeout_s, wait_timeout_s)
        self._digest = ""
        self._slots: Dict[str, _Slot] = {}
        self._by_ptr: Dict[int, _Slot] = {}
        self._version: List[int] = []  # per layer: the step ckptd took it at
        self._unsent: Set[int] = set()  # copied into the region, not yet reported
        self._trusted = False          # the region holds what ckptd last took

    # ---- registration ----

    def _open(self, tensors: Dict[str, torch.Tensor], digest: str) -> None:
        if self._client is not None:
            self._client.unregister(drain=True)
        client = client_for(self._socket, *self._timeouts)
        offset = 0
        places: List[Tuple[str, int, torch.Tensor]] = []
        for key, t in tensors.items():
            offset = (offset + ALIGN - 1) // ALIGN * ALIGN
            places.append((key, offset, t))
            offset += nbytes_of(t)
        region = client.allocate_region(max(offset, 1))
        job = f"{self._job_id}.r{self._rank}.{digest}"
        layers = []
        slots: Dict[str, _Slot] = {}
        for i, (key, off, t) in enumerate(places):
            n = nbytes_of(t)
            raw = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=off)
            layers.append(layer_spec(key, t, region.index, off))
            slots[key] = _Slot(key, i, n, t.dtype, raw.view(t.dtype))
        if not layers:  # a rank with bytes items only: a step needs a layer
            layers.append({"name": "-", "kind": "OTHER", "tensors": [
                {"name": "-", "shape": [1], "dtype": "U8", "role": "OTHER",
                 "region": region.index, "offset": 0}]})
        client.register({"job_id": job, "rank": 0, "world_size": 1,
                         "policy": {"kind": "EXPLICIT"}, "layers": layers})
        self._client, self._job, self._digest, self._slots = client, job, digest, slots
        self._region = region
        self._by_ptr = {s.view.data_ptr(): s for s in slots.values()}
        self._last_step = client.latest_durable_step_at_register
        self._next_step = self._last_step + 1
        self._version = [0] * len(slots)
        self._unsent = set(range(len(layers)))
        self._trusted = False

    # ---- staging ----

    def stage(self, tensors: Dict[str, torch.Tensor],
              tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """Copies each tensor (any device, any strides; no zero-size one)
        into its slot and returns the slots, of each tensor's dtype and
        shape. The tensors may change once this returns. Waits first until
        the previous stage is committed and ckptd has taken it out of the
        region. `tag`: the save's checkpoint id (Turn)."""
        with self._lock:
            self._take_turn()
            digest = layout_digest(tensors)
            if digest != self._digest:
                self._open(tensors, digest)
            elif self._last_step > 0:
                self._fence()
            out: Dict[str, torch.Tensor] = {}
            with torch.no_grad():
                for key, t in tensors.items():
                    slot = self._slots[key]
                    src = t.detach()
                    if src.device.type != "cpu" or not src.is_contiguous():
                        src = src.to("cpu").contiguous()
                    if slot.layer in self._unsent or not self._trusted or \
                            not same_bytes(slot.view, src):
                        slot.view.copy_(src.reshape(-1))
                        self._unsent.add(slot.layer)
                    out[key] = slot.view.view(t.shape)
            self._turn.hold(tag)
            return out

    def _staged_dropped(self) -> None:
        self._trusted = False  # the region no longer holds what ckptd took

    def _fence(self) -> None:
        snap = self._client.wait_snapshot(self._last_step)
        if snap["skipped"] or snap["lost"]:
            self._trusted = False

    def slot_of(self, t: torch.Tensor) -> Optional[str]:
        """The key of the slot `t` is (all of it), or None."""
        with self._lock:
            s = self._by_ptr.get(t.data_ptr())
            if s is None or nbytes_of(t) != s.nbytes or t.dtype != s.dtype:
                return None
            return s.key

    # ---- commit ----

    def commit(self, aux: bytes, tag: Optional[str] = None) -> Tuple[int, Dict[str, Stored]]:
        """Reports the tensors save `tag` staged as the next ckptd step,
        with `aux` (the step's bytes items), and waits until every changed
        layer is durable. Returns the step and where each tensor's bytes
        are."""
        with self._committing(tag):
            return self._commit_locked(aux)

    def _commit_locked(self, aux: bytes) -> Tuple[int, Dict[str, Stored]]:
        if self._client is None:
            raise RuntimeError(f"job {self._job_id} rank {self._rank}: nothing was staged, or "
                               "the writer was closed during the save")
        # The number is used up before the call: a reply lost after ckptd
        # took the step must not make every later step "not above" it.
        step = self._next_step
        self._next_step = step + 1
        layers = sorted(self._unsent)
        self._trusted = False
        self._client.step_done(step, 0.0, aux, layers)
        self._last_step = step
        check_snapshot(self._job, step, self._client.wait_snapshot(step))
        self._client.wait_durable(step)
        for layer in layers:
            self._version[layer] = step
        self._unsent.clear()
        self._trusted = True
        return step, {s.key: Stored(self._job, s.key, step, self._version[s.layer], s.nbytes)
                      for s in self._slots.values()}

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                unregister(self._client)
                self._client = None
                self._digest = ""
