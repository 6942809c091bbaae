"""GpuStore: one rank's CUDA tensors of a DCP state dict, handed to ckptd
where they are.

The rank's CUDA tensors are registered with ckptd through the GPU handover
(CUDA IPC, as ckpt.torch's GpuMemory does) as a ckptd job of one rank, one
layer per tensor, named like RankStore's jobs with a `g` for the device:
`<job_id>.g<rank>.<layout>`. A stage is then one ckptd step of every layer:
StepDone records an event on the stream the caller gave (the trainer's),
ckptd copies each tensor into its pinned pool once the event has completed,
and stage() returns when WaitSnapshot says the bytes are there. The trainer
makes no copy, and may change the tensors as soon as stage() returns (DCP's
contract). commit() waits until the step is durable.

Registration is by identity: the store keeps a reference to every tensor
it registered, so an address ckptd maps cannot be freed and handed to
another tensor; a stage whose tensors are other storages (or other keys,
dtypes or sizes) registers again. The same layout keeps the same job, so
its steps go on.

A step lists only the tensors whose bytes changed since the version ckptd
holds (the frozen base of a LoRA fine-tune is written once): each stage
takes a digest of every tensor on its device (digest(): two random linear
sums of its 32-bit words, keyed by a seed of the store's) and compares it
with the digest of the version last made durable. Unlike RankStore's byte
comparison this is probabilistic: a change goes unseen with probability
at most 2^-49 per tensor and save, whatever the change (see digest()).
When the handover is refused (a ckptd or client built without CUDA,
memory that cannot be exported), the writer copies the CUDA tensors into
host slots instead (writer.py).

Its lock guards everything below: stage() runs on the trainer's thread or
the writer's staging thread, commit() on DCP's upload thread."""

from __future__ import annotations

import contextlib
import hashlib
import random
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

import ckpt

from .store import Stored, check_snapshot, client_for, layout_digest, layer_spec, nbytes_of
from .store import StoreBase, unregister


def identity(tensors: Dict[str, torch.Tensor]) -> Tuple[str, Tuple[Tuple[str, int], ...]]:
    """What a registration of `tensors` depends on: the layout and where
    each tensor's bytes are."""
    return layout_digest(tensors), tuple((str(t.device), t.data_ptr()) for t in tensors.values())


# 32-bit words a digest takes at a time: its temporaries on the device are
# a few int64 tensors of that many elements (about 100 MiB at most).
DIGEST_PIECE = 1 << 21


def digest(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Two 64-bit sums over the bytes of the contiguous tensor `t`, computed
    on its device (mod 2^64; a tensor of two int64 on t's device):
    sum_i R_i * w_i and sum_i S_i * rot16(w_i), where w_i are its 32-bit
    words as unsigned numbers (the last zero-padded), rot16 swaps a word's
    halves, and R_i, S_i are keys drawn from [0, 2^62) by a generator
    seeded with `seed`, one per word.

    Two byte strings of one length that differ get the same two sums with
    probability at most 2^-49 over the keys, whatever the difference. Let
    2^v be the largest power of two dividing every word's difference
    (v <= 31). One key R_i whose word's difference has exactly v factors of
    two makes the first sum miss the change with probability at most
    2^-min(62, 64 - v). When v >= 16 the words differ in their upper halves
    only, so the rotated words' differences have exactly v - 16 factors of
    two, and the second sum misses with probability at most 2^-(80 - v).
    Either way one of the two is at most 2^-49."""
    b = t.reshape(-1).view(torch.uint8)
    if b.numel() % 4 or b.storage_offset() % 4:  # a 32-bit view needs both: a padded copy
        b = torch.cat([b, b.new_zeros(-b.numel() % 4)])
    words = b.view(torch.int32)
    g = torch.Generator(device=t.device)
    g.manual_seed(seed)
    sums = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), DIGEST_PIECE):
        w = words[start:start + DIGEST_PIECE].to(torch.int64) & 0xFFFFFFFF
        keys = torch.randint(0, 1 << 62, (w.numel(),), dtype=torch.int64, device=t.device,
                             generator=g)
        sums[0] += (w * keys).sum()
        keys = torch.randint(0, 1 << 62, (w.numel(),), dtype=torch.int64, device=t.device,
                             generator=g)
        sums[1] += ((((w << 16) | (w >> 16)) & 0xFFFFFFFF) * keys).sum()
    return sums


def digests(tensors: Dict[str, torch.Tensor], seed: int,
            stream: Any = None) -> Dict[str, Tuple[int, int]]:
    """digest() of each tensor, computed on `stream` (a torch.cuda.Stream;
    the caller's current stream when None) so that it follows the work
    queued there, each with its own seed derived from `seed` and its key."""
    if not tensors:
        return {}
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        sums = [digest(t, _seed_of(seed, key)) for key, t in tensors.items()]
        host = torch.stack(sums).cpu().tolist()
    return {key: (a, b) for key, (a, b) in zip(tensors, host)}


def _seed_of(seed: int, key: str) -> int:
    h = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def marks_of(tensors: Dict[str, torch.Tensor]) -> Dict[torch.device, Any]:
    """Per device of the CUDA tensors among `tensors`, a torch.cuda.Event
    recorded now on the calling thread's current stream there: what a stage
    that runs later, on another thread, starts after."""
    marks: Dict[torch.device, Any] = {}
    for t in tensors.values():
        if t.is_cuda and t.device not in marks:
            marks[t.device] = torch.cuda.Event()
            marks[t.device].record(torch.cuda.current_stream(t.device))
    return marks


def wait_for_marks(marks: Dict[torch.device, Any]) -> None:
    """The calling thread's current stream on each device waits for its
    mark: a copy it makes then (a CUDA tensor into a host slot) reads what
    the work queued before the mark left."""
    for device, event in marks.items():
        torch.cuda.current_stream(device).wait_event(event)


def _refusal(e: "ckpt.Error", adding: bool) -> bool:
    """Whether `e` says that the client or ckptd cannot take CUDA tensors
    in place: every refusal of add_gpu_tensor (memory that is not CUDA
    device memory or cannot be exported; a client without CUDA), and a
    registration refused for its GPU handover (a ckptd without CUDA or
    without the device, pages it cannot import: its message names CUDA,
    the GPU or pages). Any other error (ckptd
    not running, a quota, a stale registration) is the save's."""
    if e.code == "UNIMPLEMENTED":
        return True
    if e.code not in ("FAILED_PRECONDITION", "INVALID_ARGUMENT"):
        return False
    return adding or any(w in e.message for w in ("CUDA", "GPU", "page"))


class HandoverRefused(RuntimeError):
    """ckptd or the client did not take the CUDA tensors where they are."""


class GpuStore(StoreBase):
    """One rank's CUDA tensors in ckptd (see the module's doc)."""

    def __init__(self, socket_path: Optional[str], job_id: str, rank: int,
                 call_timeout_s: float = 60.0, wait_timeout_s: float = 600.0):
        super().__init__(socket_path, job_id, rank, call_timeout_s, wait_timeout_s)
        self._identity: Optional[tuple] = None
        self._held: Dict[str, torch.Tensor] = {}  # registered; kept so none is freed
        self._streams: Dict[torch.device, Any] = {}  # its own CUDA stream per device
        self._layer: Dict[str, int] = {}
        self._seed = random.SystemRandom().getrandbits(62)
        # Per tensor: the digest and ckptd step of the version last made
        # durable (a tensor named by a step not yet durable has none: ckptd's
        # newest version of it may then be that step's); the digests of the
        # tensors the staged step names; tensors not yet durable since the
        # registration (written whatever their digest).
        self._durable: Dict[str, Tuple[Tuple[int, int], int]] = {}
        self._staged_sums: Dict[str, Tuple[int, int]] = {}
        self._unsent: Set[str] = set()
        self._staged_step = 0

    def _open(self, tensors: Dict[str, torch.Tensor], ident: tuple) -> None:
        """Registers `tensors` where they are. HandoverRefused when the
        client or ckptd does not take them so; the store is then closed."""
        self._close_locked()
        client = client_for(self._socket, *self._timeouts)
        layers: List[dict] = []
        job = f"{self._job_id}.g{self._rank}.{ident[0]}"
        adding = True
        try:
            for key, t in tensors.items():
                region, offset = client.add_gpu_tensor(t.data_ptr(), nbytes_of(t), key)
                layers.append(layer_spec(key, t, region, offset))
            adding = False
            client.register({"job_id": job, "rank": 0, "world_size": 1,
                             "policy": {"kind": "EXPLICIT"}, "layers": layers})
        except ckpt.Error as e:
            if not _refusal(e, adding):
                raise
            raise HandoverRefused(f"ckptd job {job}: {e.message}") from e
        self._client, self._job, self._identity = client, job, ident
        self._held = dict(tensors)
        self._layer = {key: i for i, key in enumerate(tensors)}
        self._durable, self._unsent = {}, set(tensors)
        self._last_step = client.latest_durable_step_at_register
        self._next_step = self._last_step + 1

    def _side(self, device: torch.device, mark: Optional[Any]) -> Optional[Any]:
        """The store's own stream on `device`, made to wait for `mark` (an
        event of the trainer's stream, marks_of()) or, without one, for the
        calling thread's current stream. None on a CPU device (tests)."""
        if device.type != "cuda":
            return None
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        if mark is not None:
            side.wait_event(mark)
        else:
            side.wait_stream(torch.cuda.current_stream(device))
        return side

    def stage(self, tensors: Dict[str, torch.Tensor], mark: Optional[Any] = None,
              tag: Optional[str] = None) -> None:
        """Has ckptd take those of `tensors` (CUDA, contiguous, of one
        device, none of zero size) whose bytes changed into its pinned pool
        once the work queued before `mark` (marks_of(); without one, the
        work queued so far on the calling thread's stream) has run; returns
        when they are there. Every CUDA call is made on the tensors'
        device, whatever the calling thread's current device. `tag`: the
        save's checkpoint id (Turn)."""
        device = next(iter(tensors.values())).device
        on_device = torch.cuda.device(device) if device.type == "cuda" \
            else contextlib.nullcontext()
        with self._lock, on_device:
            self._take_turn()
            ident = identity(tensors)
            if ident != self._identity:
                self._open(tensors, ident)
            side = self._side(device, mark)
            sums = digests(tensors, self._seed, side)
            changed = {k: d for k, d in sums.items()
                       if k in self._unsent or self._durable.get(k, ((), 0))[0] != d}
            # The number is used up before the call, as RankStore.commit's.
            step = self._next_step
            self._next_step = step + 1
            # From here ckptd may hold a newer version of these than the one
            # their digest names, until this step is durable.
            for k in changed:
                self._durable.pop(k, None)
                self._unsent.add(k)
            self._client.set_cuda_stream(side.cuda_stream if side is not None else 0)
            self._client.step_done(step, 0.0, b"", sorted(self._layer[k] for k in changed))
            self._last_step = step
            check_snapshot(self._job, step, self._client.wait_snapshot(step))
            self._staged_step, self._staged_sums = step, changed
            self._turn.hold(tag)

    def commit(self, tag: Optional[str] = None) -> Tuple[int, Dict[str, Stored]]:
        """Waits until the step save `tag` staged is durable; returns it and
        where each tensor's bytes are."""
        with self._committing(tag):
            step = self._staged_step
            if not self._turn.held or self._client is None:
                raise RuntimeError(f"job {self._job_id} rank {self._rank}: no CUDA tensors "
                                   "were staged, or the writer was closed during the save")
            self._client.wait_durable(step)
            self._durable.update({k: (d, step) for k, d in self._staged_sums.items()})
            self._unsent.difference_update(self._staged_sums)
            return step, {key: Stored(self._job, key, step, self._durable[key][1],
                                      nbytes_of(t)) for key, t in self._held.items()}

    def _close_locked(self) -> None:
        if self._client is not None:
            unregister(self._client)
        self._client, self._identity, self._held = None, None, {}
        self._durable, self._unsent = {}, set()

    def close(self) -> None:
        with self._lock:
            self._close_locked()
