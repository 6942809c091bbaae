"""ckpt.torch against a real ckptd: a small GPT-style model trained with AdamW
and an LR schedule, SIGKILLed mid-run, restored by a new process.

- policy `all`: the restored run's losses and final weights equal a
  failure-free run's bit for bit (RNG, data position, LR schedule and
  optimizer step counts ride along with every step);
- policy `layercheck`: the composite restore gives every layer exactly the
  bytes (weights and optimizer state) the killed process had at the step the
  plan names for that layer;
- bad input: sparse, meta and non-contiguous parameters are refused naming
  the tensor; restoring a job without checkpoints is NOT_FOUND.

Run by ctest (PYTHONPATH=<build>/python); exits 77 (skipped) when torch or
the module is missing. `--worker` runs one trainer process.
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402

try:
    import torch
    import torch.nn as nn

    import ckpt
    from ckpt import torch as ckpt_torch
except ImportError as e:  # pragma: no cover - reported as a skip
    print("skipping: %s" % e)
    sys.exit(77)

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


def layer_hashes(run):
    """sha256 of every layer's registered tensors (weights and optimizer state)."""
    out = {}
    for layer in run._spec["layers"]:
        h = hashlib.sha256()
        for t in layer["tensors"]:
            nbytes = math.prod(t["shape"]) * {"F32": 4, "F16": 2, "BF16": 2}[t["dtype"]]
            h.update(memoryview(run._region)[t["offset"]:t["offset"] + nbytes])
        out[layer["name"]] = h.hexdigest()
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
            plan = run.restore()
            cursor = plan["data_position"]
            log.write(json.dumps({"restored": plan["target_step"],
                                  "layers": {l["name"]: l["step"] for l in plan["layers"]},
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


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)


def bad_input(daemon):
    client = ckpt.Client(daemon.socket)

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

    model, opt, sched = make_model()
    run = ckpt_torch.attach(model, opt, client, job_id="never-stepped")
    try:
        run.restore()
        raise AssertionError("restore of a job without checkpoints succeeded")
    except ckpt.Error as e:
        check(e.code == "NOT_FOUND", "restore without checkpoints: %s" % e)
    run.close()


class StoredAs(nn.Module):
    """A linear layer whose parameters are stored in `dtype` and computed in
    f32 (CPU torch 1.13 has no f16 matmul)."""

    def __init__(self, n_in, n_out, dtype):
        super().__init__()
        self.weight = nn.Parameter((torch.randn(n_out, n_in) / n_in ** 0.5).to(dtype))
        self.bias = nn.Parameter(torch.zeros(n_out).to(dtype))

    def forward(self, x):
        return x @ self.weight.float().t() + self.bias.float()


def other_optimizers_and_dtypes(daemon):
    """Adam, SGD with momentum and a bf16/f16 model: what a restore writes back
    equals what the optimizer had after the last durable step."""
    cases = [("adam", torch.float32, lambda ps: torch.optim.Adam(ps, lr=1e-2)),
             ("sgd", torch.float32, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
             ("adamw-bf16", torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
             ("sgd-f16", torch.float16, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))]
    for name, dtype, make_opt in cases:
        def build(seed):
            torch.manual_seed(seed)
            model = nn.Sequential(StoredAs(8, 16, dtype), nn.Tanh(), StoredAs(16, 4, dtype))
            return model, make_opt(model.parameters())

        model, opt = build(1)
        run = ckpt_torch.attach(model, opt, ckpt.Client(daemon.socket), job_id=name)
        for i in range(5):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        run.wait_durable()
        want = [t.clone() for p in model.parameters()
                for t in [p.data] + [v for k, v in sorted(opt.state[p].items()) if k != "step"]]
        run.close()

        model2, opt2 = build(2)  # other weights: the restore must overwrite them
        run2 = ckpt_torch.attach(model2, opt2, ckpt.Client(daemon.socket), job_id=name)
        plan = run2.restore()
        got = [t for p in model2.parameters()
               for t in [p.data] + [v for k, v in sorted(opt2.state[p].items()) if k != "step"]]
        check(plan["target_step"] == 5 and len(got) == len(want) and
              all(torch.equal(a, b) for a, b in zip(got, want)),
              "%s (%s): weights and optimizer state restored exactly" % (name, dtype))
        steps = [int(opt2.state[p]["step"]) for p in model2.parameters() if "step" in opt2.state[p]]
        if steps:  # Adam(W) counts steps per parameter; SGD keeps no count
            check(all(s == 5 for s in steps), "%s: optimizer step counts restored" % name)
        run2.close()


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
        bad_input(daemon)
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
