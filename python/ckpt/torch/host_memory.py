"""Host tensors in shared memory: a rank on the CPU moves every tensor it
registers, once, into one region ckptd maps (a memfd the client allocates).
The twin of gpu.GpuMemory; the rank picks one by the device of its tensors."""

from __future__ import annotations

from typing import List, Optional

import torch

import ckpt

from .layout import Entry

ALIGN = 64  # every host tensor starts on a cache line


def aligned(offset: int) -> int:
    """`offset` rounded up to ALIGN."""
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _moved(e: Entry) -> torch.Tensor:
    """The tensor whose storage moves: the FSDP2 base a shard views, or the
    tensor itself."""
    return e.tensor if e.base is None else e.base


class HostMemory:
    """The shared-memory region of one rank's host tensors. Used by one
    thread (the training loop's)."""

    def __init__(self, client: "ckpt.Client"):
        self._client = client
        self.region: Optional["ckpt.Region"] = None  # after place()

    def place(self, entries: List[Entry]) -> None:
        """Moves every tensor into one region ckptd maps and writes each
        one's place into its spec: the tensor keeps its identity, its values
        and its hooks; only its storage changes (`.data =`)."""
        offset = 0
        for e in entries:
            offset = aligned(offset) + _moved(e).numel() * _moved(e).element_size()
        region = self._client.allocate_region(max(offset, 1))
        offset = 0
        with torch.no_grad():
            for e in entries:
                t = _moved(e)
                offset = aligned(offset)
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
        self.region = region

    def registered_view(self, e: Entry, registered: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor over the bytes `e` was registered at, of the dtype
        and shape of `registered` (guard.py); None for an entry not placed
        (a replica's layer another rank writes)."""
        if self.region is None or "offset" not in e.spec:
            return None
        view = torch.frombuffer(self.region, dtype=registered.dtype, count=registered.numel(),
                                offset=e.spec["offset"])
        return view.view(registered.shape)

    def synchronize(self) -> None:
        """Host tensors have no queued writes."""

    def before_step_done(self) -> None:
        """Nothing to record: ckptd copies host memory once StepDone arrives."""
