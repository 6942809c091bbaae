"""ckpt.torch: protect a PyTorch 2.x training loop with ckptd.

    import ckpt
    from ckpt import torch as ckpt_torch

    run = ckpt_torch.attach(model, optimizer, ckpt.Client(), job_id="llama-ft-7",
                            policy="layercheck", scheduler=scheduler)
    resumed = run.resume()                  # the composite checkpoint, or None
    cursor = resumed.data_position if resumed else 0
    for batch in data(cursor):
        loss = model(batch).backward()
        run.set_data_position(cursor)       # saved with this step
        optimizer.step()                    # hooks: fence before, StepDone after
        scheduler.step()

What is registered, and when. ckptd reads the tensors themselves, never a
copy made per step:
- parameters the optimizer steps, and their optimizer state (AdamW, Adam, SGD
  with momentum; foreach and fused implementations alike);
- parameters it does not step (``requires_grad=False``, or left out of the
  optimizer, as in ``AdamW(p for p in model.parameters() if p.requires_grad)``):
  frozen weights, in layers of their own marked frozen, written once and never
  again (a LoRA fine-tune writes its adapters each step, never its base);
- persistent module buffers (BatchNorm's running statistics), in the layer of
  their module.
Optimizer state is not created by ckpt.torch: the optimizer creates it at its
first step, so the rank registers in the post-step hook of that step, and the
first checkpoint is step 1, holding the weights and state after it. A
restore() before the first step lets the optimizer create its state with a
step of learning rate 0 (weights unchanged) and then overwrites everything.

CPU tensors move once, at registration, into shared memory ckptd maps (each
tensor keeps its identity and its autograd hooks: its ``.data`` is replaced).
CUDA tensors stay where they are: ckptd opens them through CUDA IPC (memory
of ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` page by page, each
page's descriptor sent over the handover socket), and each
StepDone records an event on the stream the optimizer step ran on. A rank registers the tensors
of one device: a model split over CPU and GPU, or over two GPUs, is refused
naming a tensor on each.

The hooks. ``Optimizer.register_step_pre_hook`` waits until ckptd has copied
the previous step (the fence; normally done during forward and backward);
``register_step_post_hook`` reports the step with the state that is not in
tensors: the torch (and CUDA), ``random`` and numpy RNG states, learning
rates, optimizer step counts, the scheduler's state, the data position and
``extra_state``. It is saved with ``torch.save`` and read back only with
``torch.load(weights_only=True)``, PyTorch's restricted unpickler (2.6 or
newer: older releases could be made to run code); a blob in any other format
is not loaded at all. restore() writes the composite checkpoint into the live tensors and
puts all of that back, so training continues at ``target_step + 1`` exactly
as it would have.

The package, one concern per module: ``attached`` (attach() and Attached,
the facade that owns the parts below and drives them), ``layout`` (which
tensors, in which layers), ``host_memory`` and ``gpu`` (where ckptd reads
them: shared memory or CUDA IPC), ``hooks`` (the optimizer hooks and step
counts), ``state`` (the state saved with each step and its format),
``policy`` (the registered policy and budget), ``agreement`` (what the ranks
agree on, in the background), ``restore`` and ``reshard`` (restores, and
layers handed between ranks or re-sliced onto another world) and ``types``
(what is returned). The names below are the public API.
"""

import re

import torch

if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
    # Older releases' torch.load(weights_only=True) could be made to run code.
    raise ImportError(f"ckpt.torch needs PyTorch 2.6 or newer, not {torch.__version__}")

from .attached import Attached, attach  # noqa: E402
from .layout import LayerOf, default_layer_of  # noqa: E402,F401  (LayerOf: the type of layers=)
from .types import LayerPlan, Plan, Restored, Stats  # noqa: E402

__all__ = ["Attached", "LayerPlan", "Plan", "Restored", "Stats", "attach", "default_layer_of"]
