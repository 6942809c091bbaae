"""BufferMirror: module buffers as they were at the step, not one forward later.

Parameters and optimizer state change only inside optimizer.step(), which
waits for ckptd to finish copying the previous step (the fence). Buffers
change elsewhere: BatchNorm's running statistics, and the buffers
DistributedDataParallel broadcasts, are written by the next forward pass,
which runs while ckptd may still be copying the step. Registered in place,
a checkpoint of step K could hold step K+1's statistics.

So ckptd reads a mirror of each buffer instead: at registration every
buffer entry's tensor becomes a copy (placed, like every registered tensor,
where ckptd reads it), capture() copies the live buffers into the mirrors
after each optimizer step, before StepDone (on a GPU, on the step's stream,
before the event ckptd waits for), and to_live() copies them back after a
restore. The fence before the next step's capture keeps ckptd's reads and
the next copy apart. Buffers are found by name every time, so a module that
replaces a buffer object (``model.to()``, a reset) is followed; one whose
dtype or shape changed is refused naming it. Buffers are small, so the
copies cost little. Used by one thread (the training loop's)."""

from __future__ import annotations

from typing import List, NamedTuple

import torch

from .layout import DTYPE_NAMES, Entry


class _Mirrored(NamedTuple):
    name: str
    module: torch.nn.Module
    leaf: str
    mirror: torch.Tensor


class BufferMirror:
    """The mirrored buffers of one rank (see the module's doc)."""

    def __init__(self, model: torch.nn.Module, job_id: str):
        self._model = model
        self._job_id = job_id
        self._mirrored: List[_Mirrored] = []

    def mirror(self, entries: List[Entry]) -> None:
        """Gives every buffer entry of `entries` a mirror as its tensor,
        holding the buffer's values now. REQUIRES: before they are placed."""
        self._mirrored = []
        for e in entries:
            if e.source is None or e.source[0] != "buffer":
                continue
            path, _, leaf = e.name.rpartition(".")
            module = self._model.get_submodule(path) if path else self._model
            e.tensor = e.tensor.detach().clone()
            self._mirrored.append(_Mirrored(e.name, module, leaf, e.tensor))

    def _live(self, m: _Mirrored) -> torch.Tensor:
        live = m.module._buffers.get(m.leaf)
        if live is None or live.dtype != m.mirror.dtype or live.shape != m.mirror.shape or \
                live.device != m.mirror.device:
            now = "gone" if live is None else \
                f"{DTYPE_NAMES.get(live.dtype, live.dtype)} {list(live.shape)} on {live.device}"
            raise RuntimeError(
                f"buffer '{m.name}' was registered with ckptd as "
                f"{DTYPE_NAMES[m.mirror.dtype]} {list(m.mirror.shape)} on {m.mirror.device} and "
                f"is now {now}; close() the run and attach() the model as it is now to a new job "
                f"(job '{self._job_id}' keeps its checkpoints)")
        return live

    def capture(self) -> None:
        """The live buffers into the mirrors (after a step, before StepDone)."""
        with torch.no_grad():
            for m in self._mirrored:
                m.mirror.copy_(self._live(m))

    def to_live(self) -> None:
        """The mirrors (as a restore wrote them) into the live buffers."""
        with torch.no_grad():
            for m in self._mirrored:
                self._live(m).copy_(m.mirror)
