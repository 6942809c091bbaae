"""CUDA tensors where they are: a rank on a GPU hands ckptd each tensor it
registers through CUDA IPC (no copy), and each StepDone names the stream the
optimizer step ran on, on which the client records the event ckptd waits
for. The twin of host_memory.HostMemory."""

from __future__ import annotations

from typing import List, Optional

import torch

import ckpt

from .layout import Entry


class GpuMemory:
    """The CUDA tensors of one rank, on `device`. Used by one thread (the
    training loop's)."""

    def __init__(self, client: "ckpt.Client", device: torch.device):
        self._client = client
        self._device = device

    def place(self, entries: List[Entry]) -> None:
        """Hands ckptd each CUDA tensor where it is and writes its place
        (region, offset) into its spec."""
        for e in entries:
            t = e.tensor
            region, offset = self._client.add_gpu_tensor(t.data_ptr(), t.numel() * t.element_size(),
                                                         e.name)
            e.spec.update(region=region, offset=offset)

    def registered_view(self, e: Entry, registered: torch.Tensor) -> Optional[torch.Tensor]:
        """The tensor as registered, whose storage the guard holds (guard.py):
        CUDA storage does not move under a tensor that keeps it. None for an
        entry not placed (a replica's layer another rank writes)."""
        return registered if "region" in e.spec else None

    def synchronize(self) -> None:
        """Waits for every kernel queued on the device (none writes a tensor
        after a restore, or reads one before)."""
        torch.cuda.synchronize(self._device)

    def before_step_done(self) -> None:
        """The stream the optimizer step ran on, for StepDone's event."""
        self._client.set_cuda_stream(torch.cuda.current_stream(self._device).cuda_stream)


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph
    (CUDA not initialized: nothing can be)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
