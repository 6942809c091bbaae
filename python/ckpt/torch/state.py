"""The state saved with each step that is not in tensors, and its format.

With every StepDone a rank sends one blob: the torch (and CUDA), ``random``
and numpy RNG states, the learning rates, the optimizer step counts, the
scheduler's and the GradScaler's state, the data position, ``extra_state``
and the layout of the ranks. The blob is ``torch.save`` of a dict whose "format" is AUX_FORMAT;
load_aux reads it only with ``torch.load(weights_only=True)``, PyTorch's
restricted unpickler, and refuses a blob in any other format without
loading it. SavedState is used by one thread (the training loop's)."""

from __future__ import annotations

import io
import random
import sys
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

import ckpt

AUX_FORMAT = "ckpt.torch/2"


def as_tuple(x: Any) -> Any:
    """Lists, nested, as tuples (random.setstate wants its own shape back)."""
    return tuple(as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def type_shape(x: Any, depth: int = 0) -> Any:
    """The kinds of values in `x` (types, dict keys, nesting), not the values:
    what decides whether torch.load(weights_only=True) can read it back."""
    if depth > 8:
        return type(x)
    if isinstance(x, dict):
        return (dict, tuple((k, type_shape(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(type_shape(v, depth + 1) for v in x))
    if torch.is_tensor(x):
        return (torch.Tensor, x.dtype)
    return type(x)


_SAFE_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
                torch.Size)


def _first_unsafe(x: Any, path: str) -> Optional[Tuple[str, Any]]:
    """(where, value) of the first value under `x` that PyTorch's restricted
    unpickler would refuse, else None."""
    if torch.is_tensor(x) or type(x) in _SAFE_LEAVES:
        return None
    if type(x) in (list, tuple):
        for i, v in enumerate(x):
            found = _first_unsafe(v, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(x) is dict:
        for k, v in x.items():
            found = _first_unsafe(k, f"{path} key {k!r}") or _first_unsafe(v, f"{path}[{k!r}]")
            if found:
                return found
        return None
    return path, x


def _unsafe_value_message(aux: dict) -> str:
    """Why `aux` cannot be saved, naming the value and where it is."""
    where = {"data_position": "set_data_position()", "extra": "extra_state",
             "scheduler": "the scheduler's state_dict()"}
    for key, name in where.items():
        found = _first_unsafe(aux.get(key), name)
        if found:
            path, value = found
            kind = type(value)
            hint = ("int(...) or float(...)" if kind.__module__ == "numpy" else
                    "tensors, numbers, strings, None, lists, tuples and dicts")
            return (f"{path} holds a {kind.__module__}.{kind.__qualname__}, which ckpt.torch "
                    f"cannot save with a step (a restore unpickles only tensors and plain values); "
                    f"use {hint}")
    return ("the state saved with each step must be tensors, numbers, strings, None, lists, "
            "tuples and dicts (check set_data_position(), extra_state and the scheduler's "
            "state_dict())")


def load_aux(blob: bytes, step: int) -> Optional[dict]:
    """The state saved with `step`, read with PyTorch's restricted unpickler
    (weights_only): only tensors and plain containers and values. None for
    an empty blob; ckpt.Error FAILED_PRECONDITION for a blob that is not
    torch.save's, DATA_LOSS for one that cannot be read or is not ours."""
    if not blob:
        return None
    if not blob.startswith(b"PK\x03\x04"):  # torch.save's zip format
        raise ckpt.Error("FAILED_PRECONDITION",
                         f"the state saved with step {step} is not ckpt.torch's (a pickle from an "
                         "older ckpt.torch, or anything else); it is not loaded, since unpickling "
                         "can run code")
    try:
        aux = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means a damaged blob
        raise ckpt.Error("DATA_LOSS", f"the state saved with step {step} cannot be read "
                         f"({type(e).__name__}: {e}); it is damaged or not from ckpt.torch") from None
    if not isinstance(aux, dict) or aux.get("format") != AUX_FORMAT:
        raise ckpt.Error("DATA_LOSS", f"the state saved with step {step} is not ckpt.torch's "
                         f"(format {aux.get('format') if isinstance(aux, dict) else type(aux)})")
    return aux


def _rng_states(device: torch.device) -> Dict[str, Any]:
    rng: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:
        np = sys.modules["numpy"]
        name, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                        int(has_gauss), float(cached)]
    return rng


def _set_rng_states(rng: Dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    random.setstate(as_tuple(rng["python"]))
    if "numpy" in rng and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class SavedState:
    """What a rank saves with each step beside its tensors, and puts back
    at a restore. `layout` is (world_size, replicated, sharded), recorded
    so that a restore can tell which ranks held which parts."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, scheduler_step: str,
                 device: torch.device, layout: Tuple[int, bool, bool]):
        self._optimizer = optimizer
        self._device = device
        self._layout = layout
        self.scheduler = scheduler
        self.scheduler_step = scheduler_step
        self.scaler: Any = None  # scaler.ScalerLink, when a GradScaler is attached (apply())
        self.data_position: Any = None
        self.extra_state: Dict[str, Any] = {}
        # The scheduler state restore() found, before any replay (ckpt.hf
        # loads it into the Trainer's own scheduler).
        self.restored_scheduler_state: Optional[dict] = None
        self._checked: Any = None  # the shape of the last state checked loadable
        self._warned_scheduler = False

    def capture(self, step: int, counter: Any) -> dict:
        """The state to save with `step`; `counter` gives the step counts
        (hooks.StepCounter)."""
        self._check_scheduler()
        world_size, replicated, sharded = self._layout
        return {"format": AUX_FORMAT, "step": step, "rng": _rng_states(self._device),
                "lrs": [float(g["lr"]) for g in self._optimizer.param_groups],
                "group_steps": counter.group_steps(), "param_steps": counter.param_steps(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": None,  # set when the step is reported (attached.py)
                "data_position": self.data_position, "extra": self.extra_state,
                "world_size": world_size, "replicated": replicated, "sharded": sharded}

    def _check_scheduler(self) -> None:
        """Warns once when an LR scheduler drives the optimizer (it set each
        group's initial_lr) but none was handed over: its state would not
        be saved, and a restore would leave the learning rate behind."""
        if self.scheduler is not None or self._warned_scheduler:
            return
        if any("initial_lr" in g for g in self._optimizer.param_groups):
            self._warned_scheduler = True
            warnings.warn(
                "ckpt.torch: an LR scheduler drives this optimizer but was not handed over, so "
                "its state is not saved and a restore leaves the learning rate where the "
                "scheduler no longer expects it; pass attach(scheduler=...) or set "
                "run.scheduler = <the scheduler> (for one made after attach())", stacklevel=4)

    def retake_rng(self, aux: dict) -> None:
        """The RNG states of `aux` (from capture()) taken again, now."""
        aux["rng"] = _rng_states(self._device)

    def blob(self, aux: dict, step: int) -> bytes:
        """`aux` as the bytes StepDone carries. Whenever the kinds of values
        saved change, the blob is read back first: TypeError for state that
        cannot be loaded safely, now rather than at restore time."""
        buf = io.BytesIO()
        torch.save(aux, buf)
        blob = buf.getvalue()
        shape = type_shape([aux["data_position"], aux["extra"], aux["scheduler"]])
        if shape != self._checked:
            try:
                load_aux(blob, step)
            except ckpt.Error:
                raise TypeError(_unsafe_value_message(aux)) from None
            self._checked = shape
        return blob

    def apply(self, aux: dict, counter: Any) -> None:
        """Puts `aux` back: RNG states, learning rates, step counts (through
        `counter`, hooks.StepCounter), the scheduler (replaying the step
        after the restored one when it steps with the optimizer), the data
        position and extra_state."""
        _set_rng_states(aux["rng"], self._device)
        for g, lr in zip(self._optimizer.param_groups, aux["lrs"]):
            if torch.is_tensor(g["lr"]):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        counter.restore(aux["param_steps"])
        if self.scaler is not None:
            self.scaler.load(aux.get("scaler"))
        self.restored_scheduler_state = aux.get("scheduler")
        if self.scheduler is not None and self.restored_scheduler_state is not None:
            self.scheduler.load_state_dict(self.restored_scheduler_state)
            if self.scheduler_step == "optimizer" and not isinstance(
                    self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                # Saved after optimizer.step() and before the loop's
                # scheduler.step(); replay that one.
                self.scheduler.step()
        self.data_position = aux["data_position"]
        self.extra_state = aux["extra"]
