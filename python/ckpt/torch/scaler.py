"""ScalerLink: a GradScaler's state saved with the step it ends.

Mixed precision with ``torch.amp.GradScaler`` changes what a step is. A
step whose gradients hold inf or NaN is skipped: a plain optimizer's step()
is not called at all, and a fused one (AdamW(fused=True)) is called and
rolls the update and its step count back inside. Then ``scaler.update()``
changes the scale. A restore must give back the scale and growth tracker as
they were after that update, or the resumed run scales its losses
differently from the run it replaces.

So with a scaler attached, the step's report to ckptd waits for the
scaler: the optimizer's post-step hook takes everything else of the step
(buffers, RNG, learning rates, step counts) and leaves the report pending,
and ``scaler.update()`` (wrapped on this scaler object, and unwrapped by
remove()) sends it, with ``scaler.state_dict()`` in the state saved with
the step. A loop that does not call update() on this scaler before its
next step has the pending step sent by the next pre-step hook, with the
scaler's state as it is then, and is warned once. On a GPU, ``state_dict()`` reads the scale from the device, so it
waits for the step's kernels once per step. Used by one thread (the
training loop's)."""

from __future__ import annotations

from typing import Any, Callable, Optional


class ScalerLink:
    """Sends each pending step after `scaler`'s update() (see the module's
    doc)."""

    def __init__(self, scaler: Any, send: Callable[[], None]):
        if not callable(getattr(scaler, "update", None)) or \
                not callable(getattr(scaler, "state_dict", None)):
            raise TypeError("scaler must be a torch.amp.GradScaler (update(), state_dict(), "
                            "load_state_dict())")
        self.scaler = scaler
        self._send = send
        self._original = scaler.update
        scaler.update = self._update  # an instance attribute: removed by remove()

    def _update(self, *args: Any, **kwargs: Any) -> Any:
        out = self._original(*args, **kwargs)
        self._send()
        return out

    def state(self) -> Optional[dict]:
        return self.scaler.state_dict()

    def load(self, state: Optional[dict]) -> None:
        if state is not None:
            self.scaler.load_state_dict(state)

    def remove(self) -> None:
        if self.scaler.__dict__.get("update") == self._update:
            del self.scaler.update
