"""The optimizer step hooks of an attachment, and what they keep count of.

- StepHooks: the step pre- and post-hooks on the attached optimizer, off
  while ckpt.torch steps the optimizer itself (internal()) and once removed.
- The claims of live attachments, and the global step pre-hook that refuses
  a step by another optimizer over an attached model's parameters.
- StepCounter: each trained parameter's optimizer step count, as the
  optimizer counted it (read in the post-hook where that costs no wait).
- FrozenGuard: a parameter registered frozen that now requires grad.
- create_missing_state: the optimizer state of parameters that had no
  gradient yet, made as their first step would make it.
Everything here runs on the training loop's thread."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ckpt

Param = Tuple[str, torch.nn.Parameter, Any]  # name, parameter, optimizer group


class StepHooks:
    """Calls `before()` before and `after()` after each step of `optimizer`,
    except the steps taken inside internal(), until remove()."""

    def __init__(self, optimizer: torch.optim.Optimizer, before: Callable[[], None],
                 after: Callable[[], None]):
        self._before = before
        self._after = after
        self._internal = False
        self._removed = False
        self._handles = [optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post)]

    def _pre(self, optimizer, args, kwargs) -> None:
        if not (self._internal or self._removed):
            self._before()

    def _post(self, optimizer, args, kwargs) -> None:
        if not (self._internal or self._removed):
            self._after()

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """A step of ckpt.torch's own (the state-creating step): no hook runs."""
        self._internal = True
        try:
            yield
        finally:
            self._internal = False

    def remove(self) -> None:
        self._removed = True
        for h in self._handles:
            h.remove()


# ---- live attachments ----

class _Claim(NamedTuple):
    """What a live attachment holds: its optimizer, its parameters, its
    client, and its model (whose parameters may be replaced later)."""
    optimizer: torch.optim.Optimizer
    param_ids: Set[int]
    client: Any
    job_id: str
    rank: int
    model: "weakref.ref[torch.nn.Module]"


# Live attachments (weakly: an attachment that is collected leaves), for the
# refusals of a second attach() and of steps by an optimizer that was not
# attached.
_LIVE: "weakref.WeakKeyDictionary[Any, _Claim]" = weakref.WeakKeyDictionary()
_GUARD_HANDLE = None


def check_unclaimed(optimizer: torch.optim.Optimizer, param_ids: Set[int],
                    client: "ckpt.Client") -> None:
    """Refuses an optimizer or parameters a live attachment holds
    (RuntimeError), and a client an attachment used (ValueError)."""
    for c in list(_LIVE.values()):
        if c.optimizer is optimizer or c.param_ids & param_ids:
            raise RuntimeError(
                f"this model or optimizer is already attached to job '{c.job_id}' rank "
                f"{c.rank}; call close() on that run before attaching again")
    if client.generation != 0 or any(c.client is client for c in list(_LIVE.values())):
        # A client keeps its regions and step count across registrations.
        raise ValueError("this ckpt.Client was used by an earlier attach(); give each "
                         "attach() a new ckpt.Client")


def claim(owner: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          param_ids: Set[int], client: "ckpt.Client", job_id: str, rank: int) -> None:
    """`owner` holds these until release(owner) or until it is collected."""
    global _GUARD_HANDLE
    if _GUARD_HANDLE is None:
        _GUARD_HANDLE = register_optimizer_step_pre_hook(_guard_other_optimizers)
    _LIVE[owner] = _Claim(optimizer, param_ids, client, job_id, rank, weakref.ref(model))


def release(owner: Any) -> None:
    _LIVE.pop(owner, None)


def _guard_other_optimizers(optimizer, args, kwargs):
    """Global step pre-hook: an optimizer that steps parameters of an attached
    model but is not the attached optimizer would change them unprotected:
    the parameters registered, and those in the model now (a new optimizer
    over parameters that load_state_dict(assign=True) put in the model)."""
    for c in list(_LIVE.values()):
        if optimizer is c.optimizer:
            continue
        model = c.model()
        ids = c.param_ids | ({id(p) for p in model.parameters()} if model is not None else set())
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in ids:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} steps parameters of the model attached to "
                        f"job '{c.job_id}' rank {c.rank} through another optimizer, which "
                        "ckptd would not see: close() that run, then attach() this optimizer "
                        "and call resume() to go on with the job from its last durable step "
                        "(or attach it to a new job id)")


# ---- step counts ----

class StepCounter:
    """Each trained parameter's step count (-1: the optimizer keeps none,
    like SGD), read from the optimizer at registration and after every step
    where it is on the host (see count())."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer
        self._trained: List[Param] = []
        self._counts: List[int] = []
        # Where count() finds each count, sorted once by read(): the state
        # dicts of parameters whose step is kept on the host (a CPU tensor or
        # a number) or on a device, by index into _trained. count() reads
        # st["step"] each time: an optimizer may rebind it.
        self._host: List[Tuple[int, dict]] = []
        self._device: List[Tuple[int, dict]] = []
        self._canary: Optional[Tuple[torch.nn.Parameter, dict]] = None

    def read(self, trained: List[Param]) -> None:
        """Counts `trained` (the parameters the optimizer steps) from now on,
        starting from the optimizer's own counts (and again by count() when
        optimizer.load_state_dict() replaced the state dicts)."""
        self._trained = trained
        self._counts, self._host, self._device = [], [], []
        self._canary = None
        for i, (_, p, _) in enumerate(trained):
            st = self._optimizer.state.get(p, {})
            if self._canary is None and p in self._optimizer.state:
                self._canary = (p, st)  # optimizer.load_state_dict() replaces every dict
            s = st.get("step")
            self._counts.append(-1 if s is None else int(s.item() if torch.is_tensor(s) else s))
            if s is not None:
                on_device = torch.is_tensor(s) and s.device.type != "cpu"
                (self._device if on_device else self._host).append((i, st))

    @property
    def on_device(self) -> bool:
        """Whether some counts are kept on a device (not read per step)."""
        return bool(self._device)

    def count(self, read_device: bool = False) -> None:
        """After an optimizer step: what the optimizer counted. A count kept
        on the host (a number, or a CPU tensor as the for-loop, foreach and
        CPU fused optimizers keep it) is read as it is, so a step the
        optimizer rolled back (a fused optimizer under a GradScaler that
        found inf gradients) is not counted. A count kept on a device is not
        read (that would wait for the step) unless `read_device`: the
        optimizers count a step exactly when the parameter had a gradient,
        except such a rolled-back one (docs/pytorch.md)."""
        if self._canary is not None and \
                self._optimizer.state.get(self._canary[0]) is not self._canary[1]:
            self.read(self._trained)  # new state dicts: their counts, this step's included
            return
        for group in (self._host, self._device if read_device else []):
            steps = [st.get("step") for _, st in group]
            if not steps:
                continue
            if all(torch.is_tensor(t) and t.device == steps[0].device and
                   t.dtype == steps[0].dtype for t in steps):
                values = torch.stack(steps).tolist()  # one read (each alone costs microseconds)
            else:
                values = [None if t is None else float(t) for t in steps]
            for (i, _), v in zip(group, values):
                if v is not None:
                    self._counts[i] = int(v)
        if not read_device:
            for i, _ in self._device:
                if self._trained[i][1].grad is not None:
                    self._counts[i] += 1

    def group_steps(self) -> List[Tuple[int, int]]:
        """(group, step count) from the first parameter of each group that
        has one (a parameter that never stepped has none)."""
        steps: Dict[int, int] = {}
        for (_, _, gi), count in zip(self._trained, self._counts):
            if count >= 0 and gi not in steps:
                steps[gi] = count
        return sorted(steps.items())

    def param_steps(self) -> List[int]:
        """Each trained parameter's own step count (Adam keeps one per
        parameter; one that had no gradient at a step did not count it)."""
        return list(self._counts)

    def restore(self, steps: List[int]) -> None:
        """Writes saved step counts into the optimizer state and counts from
        them; ckpt.Error FAILED_PRECONDITION when the number differs."""
        if len(steps) != len(self._trained):
            raise ckpt.Error("FAILED_PRECONDITION",
                             f"the checkpoint has step counts of {len(steps)} trained parameters, "
                             f"the model {len(self._trained)}")
        state = self._optimizer.state
        for (_, p, _), s in zip(self._trained, steps):
            st = state.get(p, {}).get("step")
            if s < 0 or st is None:
                continue
            if torch.is_tensor(st):
                st.fill_(s)
            else:
                state[p]["step"] = s
        self.read(self._trained)


class FrozenGuard:
    """The parameters in the optimizer that were frozen at registration."""

    def __init__(self, frozen: List[Tuple[str, torch.nn.Parameter]]):
        self._frozen = frozen

    def check(self) -> None:
        """Before a step: a parameter registered as frozen that the optimizer
        would now change (unfrozen after registration) is refused before it
        changes: ckptd would keep its bytes from when it was written."""
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter '{name}' was frozen (requires_grad=False) when the rank "
                    f"registered with ckptd and now requires grad: ckptd keeps frozen weights "
                    "from when they were written. Unfreeze before the first optimizer step, or "
                    "close() and attach() the model to a new job")


def create_missing_state(optimizer: torch.optim.Optimizer, trained: List[Param],
                         hooks: StepHooks) -> None:
    """Lets the optimizer make the state of every trained parameter that
    has none yet, exactly as its first step would leave it: one step
    over those parameters alone, with zero gradients, learning rate 0 and
    weight decay 0 (their weights do not move and their moments stay 0),
    after which their step counts are set back to 0."""
    missing = [p for _, p, _ in trained if len(optimizer.state.get(p, {})) == 0]
    if not missing:
        return
    ids = {id(p) for p in missing}
    groups = optimizer.param_groups
    grads = [(p, p.grad) for g in groups for p in g["params"]]
    saved = [(g["lr"], g.get("weight_decay")) for g in groups]
    try:
        for p, _ in grads:
            p.grad = torch.zeros_like(p) if id(p) in ids else None
        for g in groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        with hooks.internal():
            optimizer.step()
    finally:
        for g, (lr, wd) in zip(groups, saved):
            g["lr"] = lr
            if wd is not None:
                g["weight_decay"] = wd
        for p, grad in grads:
            p.grad = grad
    for p in missing:
        step = optimizer.state[p].get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0
