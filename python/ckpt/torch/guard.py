"""StorageGuard: the registered tensors still live where ckptd reads them.

ckptd reads (and a restore writes) each registered tensor at the address it
was registered at. A training loop can give a tensor new storage without
ckpt.torch seeing it: ``p.data = p.data.clone()``, ``model.share_memory()``,
``optimizer.load_state_dict(sd)`` (new state tensors), ``model.half()``,
``model.load_state_dict(sd, assign=True)`` (new Parameters). ckptd would
then keep checkpointing the old bytes while training goes on elsewhere, and
on a GPU the caching allocator would hand the old addresses to other
tensors, which a restore would overwrite.

So the guard keeps, per registered tensor, where to find it again (its
source: a parameter or buffer by name, optimizer state by its parameter and
key), the object found there and its data pointer, and a reference to the
registered storage, which keeps it allocated. A repair writes through a
view of the registered bytes the rank's memory makes afresh
(host_memory.py, gpu.py): share_memory() moves a storage object's bytes in
place, taking every tensor that shares that object along. check() runs
before each optimizer step, after the fence (ckptd has finished reading the
previous step), and before a restore writes:
- same object, same pointer: nothing to do (the cost per tensor is a lookup
  and a pointer comparison);
- same dtype and shape in new storage (a ``.data =`` swap, share_memory(),
  state the optimizer loaded): the new values are copied into the
  registered storage and the tensor is pointed back at it (``.data =``, so
  it keeps its identity and hooks); the next checkpoint holds them;
- another dtype or shape, a parameter replaced by a new object (which the
  attached optimizer no longer steps), a tensor gone, or a moved FSDP2
  shard: RuntimeError naming the tensor, before the step changes anything.
Used by one thread (the training loop's)."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .layout import DTYPE_NAMES, Entry, is_dtensor, local


class _Watched(NamedTuple):
    entry: Entry
    name: str
    source: tuple
    registered: torch.Tensor  # as registered (holds the storage allocated)
    moves_with_base: bool     # an FSDP2 shard viewing its padded base: never repaired
    frozen: bool              # written once: repaired only with the same values


def _describe(t: torch.Tensor) -> str:
    return f"{DTYPE_NAMES.get(t.dtype, t.dtype)} {list(t.shape)} on {t.device}"


class StorageGuard:
    """The registered tensors of one rank and where they belong (see the
    module's doc)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, job_id: str,
                 memory: Any):
        self._memory = memory  # registered_view(entry, registered)
        self._model = model
        self._optimizer = optimizer
        self._job_id = job_id
        self._watched: List[_Watched] = []
        # Per watched tensor, what check() compares, looked up once: the
        # dict that holds it (a module's _parameters, or the optimizer state
        # of its parameter), its key there, the object found, its data
        # pointer as registered, and whether it is a DTensor.
        self._fast: List[list] = []
        self._params: Dict[str, torch.nn.Parameter] = {}

    def watch(self, entries: List[Entry], frozen_layers: List[str]) -> None:
        """`entries` were just registered (placed where ckptd reads them)."""
        frozen = set(frozen_layers)
        self._params = dict(self._model.named_parameters())
        self._watched, self._fast = [], []
        for e in entries:
            if e.source is None or e.source[0] == "buffer":
                continue  # a pad, or a buffer (buffers.py mirrors those)
            w = _Watched(e, e.name, e.source, e.tensor.detach(), e.base is not None,
                         e.layer in frozen)
            holder, key = self._holder(w.source)
            obj = holder.get(key) if holder is not None else None
            self._watched.append(w)
            self._fast.append([holder, key, obj, e.tensor.data_ptr(), is_dtensor(obj)])

    def _holder(self, source: tuple) -> Tuple[Optional[dict], str]:
        """The dict that holds the source's tensor now, and its key there."""
        if source[0] == "param":
            path, _, leaf = source[1].rpartition(".")
            module = self._model.get_submodule(path) if path else self._model
            return module._parameters, leaf
        param = self._params.get(source[1])
        return (self._optimizer.state.get(param) if param is not None else None), source[2]

    def check(self) -> bool:
        """Repairs moved storage, refuses what cannot be repaired (see the
        module's doc). Returns True when optimizer state was repaired (its
        step counts may have changed with it)."""
        state_moved = False
        state = self._optimizer.state
        for i, f in enumerate(self._fast):
            holder, key, found, ptr, dtensor = f
            w = self._watched[i]
            if w.source[0] == "state":
                # optimizer.load_state_dict() makes new per-parameter dicts
                # (their step counts are new too, even where a state tensor
                # came through unchanged).
                holder = state.get(self._params.get(w.source[1]))
                if holder is not f[0]:
                    f[0] = holder
                    state_moved = True
            obj = holder.get(key) if holder is not None else None
            if obj is found and obj is not None and \
                    (obj._local_tensor if dtensor else obj).data_ptr() == ptr:
                continue
            self._repair(i, w, obj)
            state_moved |= w.source[0] == "state"
        return state_moved

    def _repair(self, i: int, w: _Watched, obj: Optional[Any]) -> None:
        where = "parameter" if w.source[0] == "param" else "optimizer state"
        fix = (f"close() the run and attach() the model and optimizer as they are now to a new "
               f"job (job '{self._job_id}' keeps its checkpoints)")
        if obj is None:
            raise RuntimeError(f"{where} '{w.name}' registered with ckptd is no longer in the "
                               f"{'model' if w.source[0] == 'param' else 'optimizer'}: {fix}")
        if w.source[0] == "param" and obj is not self._fast[i][2]:
            raise RuntimeError(
                f"parameter '{w.name}' was replaced by a new Parameter object (as "
                "load_state_dict(assign=True) or assigning a module attribute does); the "
                f"attached optimizer still steps the old one, which ckptd protects: {fix}")
        cur = local(obj)
        reg = w.registered
        if cur.dtype != reg.dtype or cur.shape != reg.shape or cur.device != reg.device:
            raise RuntimeError(
                f"{where} '{w.name}' was registered with ckptd as {_describe(reg)} and is now "
                f"{_describe(cur)} (model.to(dtype), half(), or a new tensor); ckptd keeps the "
                f"registered layout: {fix}")
        if w.moves_with_base:
            raise RuntimeError(
                f"{where} '{w.name}' is an FSDP2 shard that now lives in new storage; ckptd "
                f"reads the shard where it was registered: {fix}")
        if w.frozen and not torch.equal(reg, cur):
            raise RuntimeError(
                f"frozen parameter '{w.name}' now holds other values in new storage; ckptd "
                f"wrote the frozen weights once, at registration: {fix}")
        view = self._memory.registered_view(w.entry, reg)
        if view is None:
            # Not placed where ckptd reads (a layer another replica writes):
            # nothing reads the old storage, so follow the tensor, which a
            # restore's broadcast then writes into.
            w.entry.tensor = cur
            self._fast[i][2:] = [obj, cur.data_ptr(), is_dtensor(obj)]
            return
        if view.data_ptr() != self._fast[i][3] or view.dtype != cur.dtype or \
                view.shape != cur.shape:  # pragma: no cover - the memory moved itself
            raise RuntimeError(f"{where} '{w.name}': ckptd's registered memory moved: {fix}")
        with torch.no_grad():
            view.copy_(cur)
            cur.data = view  # back into the registered storage, keeping its identity
        self._fast[i][2] = obj
        self._fast[i][4] = is_dtensor(obj)
