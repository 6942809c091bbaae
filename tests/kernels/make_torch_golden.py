#!/usr/bin/python3
"""Golden data for drift_torch_test from real PyTorch optimizer steps.

Usage: make_torch_golden.py OUT_DIR

For each optimizer (AdamW, Adam with L2 decay, SGD with momentum) a few
parameters of awkward sizes take 3 steps with random gradients. After the
last step this writes, per parameter, raw little-endian f32 files
  <opt>_<i>_wprev.f32  weights before the last step
  <opt>_<i>_w.f32      weights after the last step
  <opt>_<i>_m.f32      exp_avg (adam/adamw) or momentum_buffer (sgd)
  <opt>_<i>_v.f32      exp_avg_sq (adam/adamw only)
and OUT_DIR/golden.json with the hyper-parameters and the group step count.
Exit status 2 when torch cannot be imported (the test then skips).
"""
import json
import os
import sys

try:
    import numpy  # noqa: F401  (Tensor.numpy() needs it)
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"torch unavailable: {e}", file=sys.stderr)
    sys.exit(2)

SIZES = [1, 4097, 10000]
STEPS = 3


def dump(path, tensor):
    arr = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4")
    arr.tofile(path)


def run(out_dir, name, make_opt, hyper):
    torch.manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.float32)) for n in SIZES]
    opt = make_opt(params)
    w_prev = None
    for step in range(STEPS):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == STEPS - 1:
            w_prev = [p.detach().clone() for p in params]
        opt.step()
    entries = []
    group_step = None
    for i, p in enumerate(params):
        st = opt.state[p]
        prefix = os.path.join(out_dir, f"{name}_{i}")
        dump(prefix + "_wprev.f32", w_prev[i])
        dump(prefix + "_w.f32", p)
        entry = {"n": p.numel(), "wprev": prefix + "_wprev.f32", "w": prefix + "_w.f32"}
        if name == "sgd":
            dump(prefix + "_m.f32", st["momentum_buffer"])
            entry["m"] = prefix + "_m.f32"
            group_step = STEPS  # SGD keeps no step count; the caller counts steps
        else:
            dump(prefix + "_m.f32", st["exp_avg"])
            dump(prefix + "_v.f32", st["exp_avg_sq"])
            entry["m"] = prefix + "_m.f32"
            entry["v"] = prefix + "_v.f32"
            group_step = int(torch.as_tensor(st["step"]).item())
        entries.append(entry)
    return dict(hyper, name=name, step=group_step, params=entries)


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 1
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    runs = [
        run(out_dir, "adamw",
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                         weight_decay=0.01),
            {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}),
        run(out_dir, "adam",
            lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                        weight_decay=0.01),
            {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}),
        run(out_dir, "sgd",
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.001),
            {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.001}),
    ]
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump({"torch": torch.__version__, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
