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

from typing import Any, Dict, List, Optional

import torch

from .layout import DTYPE_NAMES, Entry, is_dtensor, local


class _Watched:
    """One registered tensor, and what check() compares it with."""
    __slots__ = ("entry", "source", "registered", "moves_with_base", "frozen", "holder", "key",
                 "found", "ptr", "dtensor")

    def __init__(self, entry: Entry, frozen: bool, holder: Optional[dict], key: str):
        self.entry = entry
        self.source = entry.source
        self.registered = entry.tensor.detach()  # as registered (holds the storage allocated)
        self.moves_with_base = entry.base is not None  # an FSDP2 shard: never repaired
        self.frozen = frozen  # written once: repaired only with the same values
        # Where it is found (a module's _parameters, or the optimizer state
        # of its parameter, and its key there), the object found there and
        # the data pointer ckptd reads.
        self.holder = holder
        self.key = key
        self.ptr = entry.tensor.data_ptr()
        self.follow(holder.get(key) if holder is not None else None)

    @property
    def name(self) -> str:
        return self.entry.name

    def follow(self, obj: Optional[Any]) -> None:
        self.found = obj
        self.dtensor = is_dtensor(obj)


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
        self._params: Dict[str, torch.nn.Parameter] = {}

    def watch(self, entries: List[Entry], frozen_layers: List[str]) -> None:
        """`entries` were just registered (placed where ckptd reads them)."""
        frozen = set(frozen_layers)
        self._params = dict(self._model.named_parameters())
        self._watched = []
        for e in entries:
            if e.source is None or e.source[0] == "buffer":
                continue  # a pad, or a buffer (buffers.py mirrors those)
            if e.source[0] == "param":
                path, _, leaf = e.source[1].rpartition(".")
                module = self._model.get_submodule(path) if path else self._model
                holder, key = module._parameters, leaf
            else:
                holder, key = self._state_of(e.source[1]), e.source[2]
            self._watched.append(_Watched(e, e.layer in frozen, holder, key))

    def _state_of(self, param_name: str) -> Optional[dict]:
        param = self._params.get(param_name)
        return self._optimizer.state.get(param) if param is not None else None

    def check(self) -> None:
        """Repairs moved storage, refuses what cannot be repaired (see the
        module's doc)."""
        states: Dict[str, Optional[dict]] = {}  # each parameter's state, looked up once
        for w in self._watched:
            if w.source[0] == "state":
                # optimizer.load_state_dict() makes new per-parameter dicts.
                name = w.source[1]
                if name not in states:
                    states[name] = self._state_of(name)
                w.holder = states[name]
            obj = w.holder.get(w.key) if w.holder is not None else None
            if obj is w.found and obj is not None and \
                    (obj._local_tensor if w.dtensor else obj).data_ptr() == w.ptr:
                continue
            self._repair(w, obj)

    def _repair(self, w: _Watched, obj: Optional[Any]) -> None:
        where = "parameter" if w.source[0] == "param" else "optimizer state"
        fix = (f"close() the run and attach() the model and optimizer as they are now to a new "
               f"job (job '{self._job_id}' keeps its checkpoints)")
        if obj is None:
            raise RuntimeError(f"{where} '{w.name}' registered with ckptd is no longer in the "
                               f"{'model' if w.source[0] == 'param' else 'optimizer'}: {fix}")
        if w.source[0] == "param" and obj is not w.found:
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
            w.ptr = cur.data_ptr()
        else:
            if view.data_ptr() != w.ptr or view.dtype != cur.dtype or \
                    view.shape != cur.shape:  # pragma: no cover - the memory moved itself
                raise RuntimeError(f"{where} '{w.name}': ckptd's registered memory moved: {fix}")
            with torch.no_grad():
                view.copy_(cur)
                cur.data = view  # back into the registered storage, keeping its identity
        w.follow(obj)
