"""ckpt.torch (PyTorch 2.x) against a real ckptd.

A small GPT-style model trained with AdamW and an LR schedule, SIGKILLed
mid-run, restored by a new process:
- policy `all`: the restored run's losses and final weights equal a
  failure-free run's bit for bit (RNG, data position, LR schedule and
  optimizer step counts ride along with every step);
- policy `layercheck`: the composite restore gives every layer exactly the
  bytes (weights and optimizer state) the killed process had at the step the
  plan names for that layer.
Then, in this process:
- Adam, SGD with momentum, foreach and fused AdamW, bf16/f16: weights and
  optimizer state restored exactly;
- frozen weights and a LoRA fine-tune: the frozen base is written once, the
  bytes per step are the adapters' share (printed);
- the defects found on models of their own: a frozen first parameter, a
  scheduler made after attach(), a second attach(), module buffers, an
  optimizer made after attach() or over the trainable parameters only;
- state that comes back is never unpickled: a pickled aux blob of a step is
  refused without running it, a damaged one is a clear error;
- bad input: sparse, meta and non-contiguous tensors are refused naming the
  tensor; restoring a job without checkpoints is NOT_FOUND and changes
  nothing.

Run by ctest (PYTHONPATH=<build>/python); exits 77 (skipped) when torch or
the module is missing. `--worker` runs one trainer process.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ckpt  # noqa: E402
from ckpt import torch as ckpt_torch  # noqa: E402

VOCAB, CONTEXT, WIDTH, BLOCKS, BATCH = 64, 16, 32, 3, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True, dropout=0.1)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH),
                                 nn.Dropout(0.1))

    def forward(self, x, mask):
        h = self.ln(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one tensor

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t))
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def batch_at(cursor):
    """The training batch number `cursor`: a pure function of it."""
    g = torch.Generator().manual_seed(1000 + cursor)
    idx = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def make_model():
    torch.manual_seed(7)
    random.seed(7)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97 ** s)
    return model, opt, sched


def tensor_bytes(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def layer_hashes(run):
    """sha256 of every layer's registered tensors (weights, optimizer state,
    buffers), as ckptd reads them."""
    out = {}
    for layer, tensors in run.tensors().items():
        h = hashlib.sha256()
        for _, t in tensors:
            h.update(tensor_bytes(t))
        out[layer] = h.hexdigest()
    return out


def worker(args):
    torch.set_num_threads(1)
    model, opt, sched = make_model()
    log = open(args.log, "a")
    run = None
    cursor = 0
    if args.socket:
        client = ckpt.Client(args.socket, call_timeout_s=10, wait_timeout_s=60)
        lc = {"k0": 1e-3, "warmup": 0, "s_max": 12}
        run = ckpt_torch.attach(model, opt, client, job_id=args.job, policy=args.policy,
                                layercheck=lc, scheduler=sched)
        if args.restore:
            restored = run.restore()
            cursor = restored.data_position
            log.write(json.dumps({"restored": restored.target_step,
                                  "layers": {l.name: l.step for l in restored.layers},
                                  "hashes": layer_hashes(run)}) + "\n")
            log.flush()
    step = run.step if run else 0
    while step < args.steps:
        x, y = batch_at(cursor)
        cursor += 1
        model.train()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if run:
            run.set_data_position(cursor)
        opt.step()
        sched.step()
        step += 1
        row = {"step": step, "loss": loss.item().hex()}
        if run:
            row["hashes"] = layer_hashes(run)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    log.write(json.dumps({"final": hashlib.sha256(final.numpy().tobytes()).hexdigest()}) + "\n")
    if run:
        run.wait_durable()
        run.close()


def spawn(args_list, expect_kill=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + args_list
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if expect_kill:
        assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    else:
        assert p.returncode == 0, (p.returncode, p.stderr)


def bad_input(daemon):
    client = ckpt.Client(daemon.socket)

    # export_into copies each tensor into [ptr, ptr + size): a strided
    # destination (a reversed view) was written past its end.
    reversed_view = torch.zeros(64, dtype=torch.uint8).numpy()[::-1]
    try:
        client.export_into("any-job", 0, 0, {"w": reversed_view})
        check(False, "a strided export destination is refused")
    except ValueError as e:
        check("not a contiguous buffer" in str(e), "a strided export destination is refused "
              "before anything is read: %s" % e)

    def refused(model, needle):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            ckpt_torch.attach(model, opt, client, job_id="bad")
        except ValueError as e:
            check(needle in str(e), "refused naming the tensor: %s" % e)
            return
        raise AssertionError("attach accepted " + needle)

    sparse = nn.Module()
    sparse.table = nn.Parameter(torch.eye(4).to_sparse())
    refused(sparse, "'table'")
    meta = nn.Linear(4, 4, device="meta")
    refused(meta, "'weight'")
    strided = nn.Module()
    strided.w = nn.Parameter(torch.ones(4, 6).t())
    refused(strided, "'w'")
    buffered = nn.Linear(4, 4)
    buffered.register_buffer("mask", torch.ones(4, 6).t())
    refused(buffered, "'mask'")

    model, opt, sched = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = ckpt_torch.attach(model, opt, client, job_id="never-stepped")
    try:
        run.restore()
        raise AssertionError("restore of a job without checkpoints succeeded")
    except ckpt.Error as e:
        check(e.code == "NOT_FOUND", "restore without checkpoints: %s" % e)
    check(run.resume() is None and not run.registered and len(opt.state) == 0 and
          all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
          "resume() of a job without checkpoints changes nothing (no state, no registration)")
    run.close()


class StoredAs(nn.Module):
    """A linear layer whose parameters are stored in `dtype` and computed in
    f32."""

    def __init__(self, n_in, n_out, dtype):
        super().__init__()
        self.weight = nn.Parameter((torch.randn(n_out, n_in) / n_in ** 0.5).to(dtype))
        self.bias = nn.Parameter(torch.zeros(n_out).to(dtype))

    def forward(self, x):
        return x @ self.weight.float().t() + self.bias.float()


def train_steps(model, opt, n, seed=0):
    for i in range(n):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed + i))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def round_trip(daemon, name, build, steps=5):
    """Trains `steps` steps attached, restores into a model built with other
    weights, and returns (wanted, got, restored, model, opt)."""
    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=name)
    train_steps(model, opt, steps)
    run.wait_durable()
    want = harness.model_state(model, opt)
    run.close()
    model2, opt2 = build(2)  # other weights: the restore must overwrite them
    run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id=name)
    restored = run2.restore()
    got = harness.model_state(model2, opt2)
    run2.close()
    return want, got, restored, model2, opt2


def other_optimizers_and_dtypes(daemon):
    """Adam, SGD with momentum, foreach and fused AdamW, a bf16/f16 model:
    what a restore writes back (weights, state, step counts) equals what
    the optimizer had after the last durable step."""
    cases = [("adam", torch.float32, lambda ps: torch.optim.Adam(ps, lr=1e-2)),
             ("sgd", torch.float32, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
             ("adamw-foreach", torch.float32,
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
             ("adamw-fused", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
             ("adamw-bf16", torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
             ("sgd-f16", torch.float16, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))]
    for name, dtype, make_opt in cases:
        def build(seed):
            torch.manual_seed(seed)
            model = nn.Sequential(StoredAs(8, 16, dtype), nn.Tanh(), StoredAs(16, 4, dtype))
            return model, make_opt(model.parameters())

        want, got, restored, _, _ = round_trip(daemon, name, build)
        check(restored.target_step == 5 and len(got) == len(want) and
              all(torch.equal(a, b) for a, b in zip(got, want)),
              "%s (%s): weights, optimizer state and step counts restored exactly" % (name, dtype))


def defects(daemon):
    """Each defect found when ckpt.torch was tried on models of its own."""
    # A frozen first parameter: AdamW over every parameter, [0].weight frozen.
    # Its step count stays 0 and the others' are 5 after a restore (they
    # used to be read from the first parameter and all restored to 0).
    def frozen_first(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        model[0].weight.requires_grad_(False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    want, got, restored, model, opt = round_trip(daemon, "frozen-first", frozen_first)
    steps = [int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0
             for p in model.parameters()]
    check(steps == [0, 5, 5, 5] and all(torch.equal(a, b) for a, b in zip(got, want)),
          "a frozen first parameter: step counts %s restored, weights exact" % steps)

    # A scheduler made after attach() (it used to crash on the wrapped step).
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    client = ckpt.Client(daemon.socket)
    run = ckpt_torch.attach(model, opt, client, job_id="late-scheduler")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    run.scheduler = sched
    for i in range(4):
        train_steps(model, opt, 1, seed=i)
        sched.step()
    check(run.step == 4 and opt.param_groups[0]["lr"] == 1e-2 * 0.25,
          "a scheduler made after attach() steps with it")

    # A second attach() of the same model or optimizer is refused clearly.
    for what, args in (("the same client", (model, opt, client)),
                       ("a new client", (model, opt, ckpt.Client(daemon.socket))),
                       ("another optimizer over the same model",
                        (model, torch.optim.SGD(model.parameters(), lr=0.1),
                         ckpt.Client(daemon.socket)))):
        try:
            ckpt_torch.attach(*args, job_id="second")
            raise AssertionError("a second attach() with %s was accepted" % what)
        except RuntimeError as e:
            check("already attached to job 'late-scheduler'" in str(e),
                  "second attach() with %s refused: %s" % (what, e))

    # An optimizer made after attach() that steps the attached parameters.
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 8)).sum().backward()
    try:
        other.step()
        raise AssertionError("an optimizer made after attach() stepped unprotected")
    except RuntimeError as e:
        check("through another optimizer" in str(e) and
              all(torch.equal(p, b) for p, b in zip(model.parameters(), before)),
              "an optimizer made after attach() is refused before it steps: %s" % e)
    run.close()
    other.step()  # once the run is closed, any optimizer may step

    # Module buffers (BatchNorm) are checkpointed with their layer.
    def batchnorm(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    want, got, restored, model, _ = round_trip(daemon, "batchnorm", batchnorm)
    bn = model[1]
    check(all(torch.equal(a, b) for a, b in zip(got, want)) and
          int(bn.num_batches_tracked) == 5,
          "BatchNorm running_mean/var and num_batches_tracked (%d) restored"
          % int(bn.num_batches_tracked))

    # The usual idiom: an optimizer over the trainable parameters only. The
    # others are frozen weights, registered once.
    def trainable_only(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        for p in model[0].parameters():
            p.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                        lr=1e-2)

    want, got, restored, _, _ = round_trip(daemon, "trainable-only", trainable_only)
    frozen = [l.name for l in restored.layers if l.frozen]
    check(all(torch.equal(a, b) for a, b in zip(got, want)) and frozen == ["0.frozen"],
          "an optimizer over the trainable parameters only: the rest is the frozen layer %s"
          % frozen)


class Branchy(nn.Module):
    """Layer b is used from step `b_from` on: it has no gradient before."""

    def __init__(self, b_from):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b_from = b_from
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = torch.tanh(self.a(x))
        return self.b(x) if self.calls >= self.b_from else x


def more_defects(daemon):
    """Defects found when ckpt.torch was used on more models, each reproduced first."""
    # A parameter with no gradient at step 1 (a branch not taken yet) had
    # no state when the rank registered: its state was never checkpointed
    # and a new process could not restore (a tensor-count mismatch).
    def branchy(seed):
        torch.manual_seed(seed)
        model = Branchy(b_from=3)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    want, got, restored, model, opt = round_trip(daemon, "late-state", branchy, steps=6)
    steps = {n: int(opt.state[p]["step"]) for n, p in model.named_parameters()}
    check(all(torch.equal(a, b) for a, b in zip(got, want)) and
          steps == {"a.weight": 6, "a.bias": 6, "b.weight": 4, "b.bias": 4},
          "a parameter first stepped at step 3 restores exactly, with per-parameter step "
          "counts %s" % steps)

    # A parameter frozen when the rank registered and unfrozen later would
    # keep its first bytes in ckptd: refused before the step changes it.
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="unfreeze")
    train_steps(model, opt, 2)
    model[0].weight.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        train_steps(model, opt, 1, seed=9)
        raise AssertionError("a parameter unfrozen after registration stepped")
    except RuntimeError as e:
        check("was frozen" in str(e) and
              all(torch.equal(p, b) for p, b in zip(model.parameters(), before)),
              "unfreezing after registration is refused before the step: %s" % str(e)[:90])
    run.close()

    # restore() of an older step, then training: ckptd keeps steps in order;
    # refused before the optimizer changes anything.
    model, opt = branchy(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="older")
    train_steps(model, opt, 6)
    run.wait_durable()
    run.close()
    model, opt = branchy(2)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="older")
    check(run.restore(3).target_step == 3, "restore(3) of a job at step 6")
    before = [p.detach().clone() for p in model.parameters()]
    try:
        train_steps(model, opt, 1)
        raise AssertionError("training went on from an older step")
    except RuntimeError as e:
        check("older than its step 6" in str(e) and
              all(torch.equal(p, b) for p, b in zip(model.parameters(), before)),
              "training after restore(older) is refused before the step: %s" % str(e)[:80])
    client = run.client
    run.close()

    # A client reused by a second attach() kept its old step count and
    # regions (fences returned at once, wait_durable failed).
    model, opt = branchy(3)
    try:
        ckpt_torch.attach(model, opt, client, job_id="reuse")
        raise AssertionError("a used client was accepted")
    except ValueError as e:
        check("used by an earlier attach()" in str(e), "a used client is refused: %s" % e)

    # ReduceLROnPlateau (and per-epoch schedulers) are not stepped per
    # optimizer step: restore replayed one step (a TypeError for plateau).
    for name, make in (("plateau", lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(
                           o, factor=0.5, patience=0)),
                       ("epoch", lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))):
        lrs = []
        for seed in (1, 2):
            model, opt = branchy(seed)
            sched = make(opt)
            run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="sched-" + name,
                                    scheduler=sched, scheduler_step="manual")
            if seed == 1:
                for epoch in range(2):
                    train_steps(model, opt, 4, seed=10 * epoch)
                    sched.step(1.0) if name == "plateau" else sched.step()
                train_steps(model, opt, 2, seed=50)  # mid-epoch
                run.wait_durable()
            else:
                run.restore()
            lrs.append(opt.param_groups[0]["lr"])
            run.close()
        check(lrs[0] == lrs[1], "%s scheduler (scheduler_step='manual'): lr %g restored as %g"
              % (name, lrs[1], lrs[0]))

    # What is saved with a step is checked whenever its kinds change, not
    # only at the first step (a numpy scalar from step 2 on made every later
    # checkpoint unreadable).
    import numpy as np
    model, opt = branchy(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="late-unsafe")
    run.set_data_position(1)
    train_steps(model, opt, 1)
    run.set_data_position(np.int64(2))
    try:
        train_steps(model, opt, 1)
        raise AssertionError("a numpy scalar data position was saved")
    except TypeError as e:
        check("set_data_position" in str(e), "a data position that turns unsafe at step 2 is "
              "refused at step 2")
    run.close(drain=False)

    # A parameter with no elements failed in torch.frombuffer after the step.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 4))
    model.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="empty")
    train_steps(model, opt, 2)
    check(run.wait_durable() == 2, "a parameter with no elements is skipped")
    run.close()

    # Moving CPU tensors into shared memory with Tensor.set_ gave each
    # parameter a new gradient accumulator: hooks on the old one (what
    # DistributedDataParallel's gradient all-reduce hangs on) never ran
    # again, and DDP failed at step 2 ("Expected to have finished reduction").
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fired = []
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    for i, acc in enumerate(accumulators):
        acc.register_hook(lambda *_, i=i: fired.append(i))
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="acc-hooks")
    train_steps(model, opt, 3)
    check(run.registered and sorted(fired) == sorted(list(range(4)) * 3),
          "gradient-accumulator hooks keep running after the rank registers (%d of 12 "
          "calls)" % len(fired))
    run.close()


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update B @ A."""

    def __init__(self, n, rank):
        super().__init__()
        self.base = nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, n) / n)
        self.lora_b = nn.Parameter(torch.zeros(n, rank))

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


class LoRANet(nn.Module):
    def __init__(self, n=256, rank=4, blocks=4):
        super().__init__()
        self.layers = nn.ModuleList([LoRALinear(n, rank) for _ in range(blocks)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def lora(daemon):
    """A LoRA fine-tune writes its adapters (and their AdamW state) each step
    and its frozen base once: bytes per step after the base checkpoint equal
    the adapters' share; a restore is exact."""
    address = daemon.ctl("status")["metrics_address"]

    def build(seed):
        torch.manual_seed(seed)
        model = LoRANet()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                        lr=1e-3)

    model, opt = build(1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="lora")

    def step(i):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    start = harness.metric(address, "ckpt_committed_bytes_total")
    step(0)
    run.wait_durable()
    base_step = harness.metric(address, "ckpt_committed_bytes_total") - start
    for i in range(1, 11):
        step(i)
    run.wait_durable()
    per_step = (harness.metric(address, "ckpt_committed_bytes_total") - start - base_step) / 10
    adapters = sum(t.numel() * t.element_size() for layer, ts in run.tensors().items()
                   if layer not in run.frozen_layers for _, t in ts)
    frozen = sum(t.numel() * t.element_size() for layer in run.frozen_layers
                 for _, t in run.tensors()[layer])
    print("FIGURES lora: first checkpoint %d bytes (frozen base %d, adapters and their AdamW "
          "state %d); then %.0f bytes per step (%.2f %% of the model and its state)"
          % (base_step, frozen, adapters, per_step, 100.0 * per_step / (frozen + adapters)))
    check(frozen + adapters <= base_step < (frozen + adapters) * 1.2,
          "the first checkpoint holds the base and the adapters")
    check(adapters <= per_step < adapters * 1.2,
          "bytes per step after the base (%.0f) are the adapters' share (%d of %d)"
          % (per_step, adapters, frozen + adapters))
    want = harness.model_state(model, opt)
    run.close()
    model2, opt2 = build(2)
    run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id="lora")
    restored = run2.restore()
    check(restored.target_step == 11 and
          all(torch.equal(a, b) for a, b in zip(harness.model_state(model2, opt2), want)),
          "the LoRA run restores exactly (base from step %d, adapters from step %d)"
          % (min(l.step for l in restored.layers if l.frozen),
             max(l.step for l in restored.layers)))
    run2.close()


def safe_state(daemon, root):
    """Nothing that comes back from ckptd is unpickled: a pickle that would
    create a file is refused at restore without running; a damaged blob is
    a clear error; state that cannot be saved safely is refused at the first
    step."""
    planted = os.path.join(root, "pwned")

    class Payload:
        def __reduce__(self):
            return (open, (planted, "w"))

    import pickle
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="evil")
    good = run._aux_blob
    run._aux_blob = lambda aux, step: pickle.dumps(Payload())  # what a hostile writer could send
    train_steps(model, opt, 1)
    run._aux_blob = lambda aux, step: good(aux, step)[:200]  # a torn blob
    train_steps(model, opt, 1)
    run._aux_blob = lambda aux, step: pickle.dumps(Payload(), protocol=0)  # no 0x80 opcode
    train_steps(model, opt, 1)
    run.wait_durable()
    run.close()
    for step, code in ((1, "FAILED_PRECONDITION"), (2, "DATA_LOSS"), (3, "FAILED_PRECONDITION")):
        model2 = nn.Sequential(nn.Linear(8, 4))
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
        run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id="evil")
        try:
            run2.restore(step)
            raise AssertionError("the aux blob of step %d was accepted" % step)
        except ckpt.Error as e:
            check(e.code == code and "step %d" % step in e.message and not os.path.exists(planted),
                  "step %d: %s, nothing run: %s" % (step, code, e.message[:100]))
        run2.close()

    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id="unsafe-position")
    run.set_data_position(Payload())
    try:
        train_steps(model, opt, 1)
        raise AssertionError("a data position that cannot be loaded safely was saved")
    except TypeError as e:
        check("set_data_position" in str(e), "an unsafe data position is refused: %s"
              % str(e)[:120])
    run.close(drain=False)


def source_rules():
    """python/ has no pickle.loads, no assignment to .data (but where
    registration moves tensors into shared memory, and where a moved tensor
    is put back) and no monkeypatched optimizer step."""
    src = os.path.join(HERE, "..", "..", "python")
    bad = []
    for dirpath, _, names in os.walk(src):
        for n in names:
            if n.endswith(".py"):
                text = open(os.path.join(dirpath, n)).read()
                # The two places that re-home tensors (keeping their autograd
                # hooks) assign .data: HostMemory.place, and StorageGuard's
                # repair, which puts a moved tensor back where it was placed.
                if n == "host_memory.py":
                    text = re.sub(r"    def place\(.*?\n    def ", "", text, flags=re.S)
                if n == "guard.py":
                    text = re.sub(r'^""".*?"""', "", text, flags=re.S)
                    text = re.sub(r"    def _repair\(.*", "", text, flags=re.S)
                for pattern in (r"pickle\.loads?\(", r"\.data\s*=[^=]", r"\.step\s*=[^=]"):
                    bad += ["%s: %s" % (n, m.group(0)) for m in re.finditer(pattern, text)]
    check(not bad, "python/: no pickle.loads, .data = or .step = (%s)" % bad)


def main():
    root = harness.tempdir("ckpt-torch-")
    daemon = harness.Daemon(root).start()
    try:
        steps, kill_at = 30, 21
        # Failure-free reference, no ckptd.
        ref = os.path.join(root, "ref.jsonl")
        spawn(["--log", ref, "--steps", str(steps)])
        ref_rows = harness.read_jsonl(ref)
        ref_loss = {r["step"]: r["loss"] for r in ref_rows if "step" in r}

        # policy all: SIGKILL after step kill_at, restore in a new process.
        log = os.path.join(root, "all.jsonl")
        common = ["--socket", daemon.socket, "--job", "all", "--policy", "all", "--log", log,
                  "--steps", str(steps)]
        spawn(common + ["--kill-at", str(kill_at)], expect_kill=True)
        spawn(common + ["--restore"])
        rows = harness.read_jsonl(log)
        restored = [r for r in rows if "restored" in r][0]["restored"]
        check(1 <= restored <= kill_at, "restored to durable step %d (killed after %d)"
              % (restored, kill_at))
        after = [r for r in rows if "step" in r and r["step"] > restored]
        resumed = after[-(steps - restored):]
        check([r["step"] for r in resumed] == list(range(restored + 1, steps + 1)),
              "the new process continued at step %d" % (restored + 1))
        check(all(r["loss"] == ref_loss[r["step"]] for r in resumed),
              "losses after the restore equal the failure-free run bit for bit")
        check(rows[-1]["final"] == ref_rows[-1]["final"],
              "final weights equal the failure-free run bit for bit")

        # policy layercheck: per-layer steps as planned, bytes as they were.
        log = os.path.join(root, "lc.jsonl")
        common = ["--socket", daemon.socket, "--job", "lc", "--policy", "layercheck", "--log",
                  log, "--steps", str(steps)]
        spawn(common + ["--kill-at", str(kill_at)], expect_kill=True)
        spawn(common + ["--restore"])
        rows = harness.read_jsonl(log)
        restore_row = [r for r in rows if "restored" in r][0]
        # (ckptd may still have been writing the killed process's last steps
        # when the new one registered: ask for the plan of the step it used.)
        plan = daemon.ctl("plan", "lc", "--step=%d" % restore_row["restored"])
        killed = {r["step"]: r["hashes"] for r in rows[:kill_at] if "step" in r}
        planned = {l["name"]: l["step"] for l in plan["layers"]}
        check(restore_row["layers"] == planned,
              "restore used the plan ckptctl showed (%s vs %s)" % (restore_row["layers"], planned))
        steps_used = set(planned.values())
        check(len(steps_used) > 1, "the composite restore mixes steps %s" % sorted(steps_used))
        check(all(restore_row["hashes"][name] == killed[s][name] for name, s in planned.items()),
              "every layer holds exactly the bytes it had at its planned step")

        other_optimizers_and_dtypes(daemon)
        defects(daemon)
        more_defects(daemon)
        lora(daemon)
        safe_state(daemon, root)
        bad_input(daemon)
        source_rules()
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", action="store_true")
        p.add_argument("--socket")
        p.add_argument("--job", default="job")
        p.add_argument("--policy", default="all")
        p.add_argument("--log", required=True)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--kill-at", type=int, default=0)
        p.add_argument("--restore", action="store_true")
        worker(p.parse_args())
    else:
        main()
