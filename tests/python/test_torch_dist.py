"""Data-parallel (DDP) and sharded (FSDP2) jobs on four CPU ranks (gloo):
two simulated nodes, one ckptd each with its own data directory; ranks 0
and 1 talk to node 0's ckptd, ranks 2 and 3 to node 1's. A small GPT
(token and position embeddings, four blocks, final norm, head) trains with
policy `all`.

For each of DDP and FSDP2 (fully_shard per block and at the root):
- a failure-free run of 16 steps records a hash of every rank's tensors
  (parameters and optimizer state; the rank's shards under FSDP2) after each
  step;
- a second job trains the same steps and every rank is SIGKILLed at step 10
  (a sync point: all four have reported step 10). Restarted, the ranks
  restore the newest step durable on every rank (all-reduced), and each
  rank's tensors and every later step match the failure-free run bit for bit.
DDP: each layer is written by one rank only (the replicas hold identical
layers), so each rank's ckptd receives about a quarter of the bytes (the
per-rank figures are printed), the four ranks together write exactly one
replica, and restore hands each layer from its writer to the others over
the process group: no rank reads another node's data directory.
The 4-rank DDP checkpoint is then restored on 2 ranks (one per node) into
a new job with restore(from_job=): each new rank reads the old ranks its
node holds, bit for bit, and the 2 ranks train on.
FSDP2: each rank registers its local shards; the shards together are one
replica. The 4-rank shards restore on 2 ranks too (re-sliced on dim 0):
the whole all-gathered state equals the 4-rank run's, bit for bit; into a
model that is not sharded they are refused naming a layer.
Policy `layercheck`: the FSDP2 ranks select the same layers at every step;
the DDP writers decide alone.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or the module
is missing. `--worker` runs one rank. Arguments: the modes to run (ddp,
fsdp2; default both) and `--device=cuda` to put every rank's model on the
one GPU (the GPU machine's check, tests/gpu/run_on_gpu.sh: CUDA tensors
registered in place, gloo between the ranks).
"""

import faulthandler
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import ckpt  # noqa: E402
from ckpt import torch as ckpt_torch  # noqa: E402

WORLD, STEPS, KILL_AT = 4, 16, 10
DEVICE = "cpu"  # --device=cuda: every rank on the one GPU (gloo: NCCL refuses that)
VOCAB, DIM, CTX, BLOCKS = 96, 32, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool,
                                     device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(CTX, DIM)
        self.h = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def worker(a):
    global WORLD
    WORLD = a.world
    # A rank that aborts (SIGABRT: "terminate called ...") prints every
    # thread's Python stack first: in its work, or on its way out.
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank,
                            world_size=WORLD)
    torch.manual_seed(7)  # the same initial weights on every rank
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = GPT().to(device)
    if a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index or 0] if device.type == "cuda" else None)
        model.register_comm_hook(None, harness.rank_order_mean)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (WORLD,))
        for b in model.h:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    client = ckpt.Client(a.socket, wait_timeout_s=120, on_daemon_loss=a.on_daemon_loss,
                         reconnect_interval_s=0)
    run = ckpt_torch.attach(model, opt, client, job_id=a.job, rank=a.rank, world_size=WORLD,
                            policy=a.policy, record_trace=a.policy == "layercheck",
                            agree_every=a.agree_every,
                            layercheck={"k0": 2e-2, "warmup": 3, "warmup_interval": 3,
                                        "s_max": 8})
    log = open(a.log, "a")

    def tensors_hash():
        h = hashlib.sha256()
        for _, ts in sorted(run.tensors().items()):
            for name, t in ts:
                h.update(name.encode())
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                         .tobytes())
        return h.hexdigest()

    def full_hash():
        """FSDP2: the whole (all-gathered) parameters and optimizer state,
        the same on every rank and under any world size. Collective."""
        if a.mode != "fsdp2":
            return None
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            for key, v in [("", p)] + sorted(opt.state[p].items()):
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                h.update((name + key).encode())
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                         .tobytes())
        return h.hexdigest()

    first = 1
    if a.expect_refusal:
        try:
            run.restore(from_job=a.from_job)
        except ckpt.Error as e:
            print(json.dumps({"rank": a.rank, "refused": e.code, "message": e.message,
                              "registered": run.registered}))
            # As on every other way out: a process that exits with its gloo
            # group alive can die in the group's destructor ("terminate
            # called without an active exception") when its peer has gone.
            dist.destroy_process_group()
            return
    if a.restore or a.from_job:
        r = run.restore(from_job=a.from_job)
        first = r.target_step + 1
        log.write(json.dumps({"restored": r.target_step, "hash": tensors_hash(),
                              "full": full_hash(),
                              "layers": {l.name: l.step for l in r.layers}}) + "\n")
        log.flush()
    for t in range(first, a.steps + 1):
        g = torch.Generator().manual_seed(1000 * a.rank + t)  # each rank's own batch
        idx = torch.randint(0, VOCAB, (4, CTX + 1), generator=g).to(device)
        opt.zero_grad()
        logits = model(idx[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        log.write(json.dumps({"step": t, "hash": tensors_hash(), "full": full_hash(),
                              "agreed": run.agreed_durable_step}) + "\n")
        log.flush()
        if t == a.pause_at:
            # A sync point with the test: it SIGKILLs every rank now.
            open(os.path.join(a.sync, "reached-%d" % a.rank), "w").close()
            time.sleep(600)
    try:
        durable = run.wait_durable()
    except ckpt.Error as e:
        if e.code != "ABORTED" or not client.unprotected:
            raise
        durable = None  # steps lost with a ckptd killed on the way
    if client.unprotected:
        print(json.dumps({"rank": a.rank, "durable": durable, "unprotected": True}))
        run.close(drain=False)
        dist.destroy_process_group()
        return
    # The bytes this rank's ckptd holds for the newest step (its layer files'
    # tensors, each at a 64-byte boundary), and the bytes of every tensor
    # the rank holds (under DDP, a whole replica).
    plan = run.plan()
    own = plan.total_bytes
    whole = sum(t.numel() * t.element_size() for ts in run.tensors().values() for _, t in ts)
    count = sum(len(ts) for ts in run.tensors().values())
    print(json.dumps({"rank": a.rank, "durable": durable, "plan_bytes": own,
                      "replica_bytes": whole, "tensors": count, "owned": run.owned_layers,
                      "layers": len(run.layer_names)}))
    run.close()
    dist.destroy_process_group()


def ranks(root, daemons, job, mode, extra=(), kill_at=0, tag="", world=WORLD):
    store = os.path.join(root, "%s%s-store" % (job, tag))
    sync = os.path.join(root, job + tag + "-sync")
    os.makedirs(sync, exist_ok=True)
    logs = [os.path.join(root, "%s-rank%d.jsonl" % (job, r)) for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                               "--world", str(world), "--rank", str(r),
                               "--socket", daemons[r * len(daemons) // world].socket,
                               "--store", store, "--job", job, "--mode", mode, "--sync", sync,
                               "--log", logs[r], "--pause-at", str(kill_at),
                               "--device", DEVICE] + list(extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        if kill_at:
            deadline = time.time() + 300
            while len(os.listdir(sync)) < world:
                assert time.time() < deadline and all(p.poll() is None for p in procs), \
                    [p.stderr.read()[-3000:] for p in procs if p.poll() is not None]
                time.sleep(0.02)
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait(timeout=60)
            return logs, None
        results = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=600)
            # The exit status and the last line printed tell a rank that died
            # in its work from one that died on its way out after it.
            assert p.returncode == 0, "rank %d exited with %d; its last output line: %s\n%s" % (
                r, p.returncode, (out.strip().splitlines() or ["(none)"])[-1][:500], err[-4000:])
            results.append(json.loads(out.strip().splitlines()[-1]))
        return logs, results
    finally:
        harness.kill_processes(procs)


def hashes(path):
    return {row["step"]: row["hash"] for row in harness.read_jsonl(path) if "step" in row}


def scenario(root, mode):
    daemons = [harness.Daemon(os.path.join(root, "%s-node%d" % (mode, n))).start()
               for n in range(2)]
    try:
        ref_logs, ref = ranks(root, daemons, mode + "-ref", mode, ["--steps", str(STEPS)])
        check(all(r["durable"] == STEPS for r in ref), "%s: the failure-free run made all %d "
              "steps durable on every rank" % (mode, STEPS))
        want = [hashes(p) for p in ref_logs]
        logs, _ = ranks(root, daemons, mode + "-run", mode, ["--steps", str(STEPS)],
                        kill_at=KILL_AT)
        check(all(max(hashes(p)) == KILL_AT for p in logs),
              "%s: every rank reported step %d and was SIGKILLed" % (mode, KILL_AT))
        logs, res = ranks(root, daemons, mode + "-run", mode,
                          ["--steps", str(STEPS), "--restore"], tag="-again")
        restored = [[row for row in harness.read_jsonl(p) if "restored" in row][-1]
                    for p in logs]
        target = restored[0]["restored"]
        check(all(row["restored"] == target for row in restored) and 1 <= target <= KILL_AT,
              "%s: all ranks restored the same agreed step (%d)" % (mode, target))
        check(all(row["hash"] == want[r][target] for r, row in enumerate(restored)),
              "%s: each rank's tensors after the restore equal the failure-free run's at step "
              "%d, bit for bit" % (mode, target))
        got = [hashes(p) for p in logs]
        check(all(got[r][t] == want[r][t] for r in range(WORLD)
                  for t in range(KILL_AT + 1, STEPS + 1)),
              "%s: every step after the restore equals the failure-free run's on every rank"
              % mode)
        check(all(r["durable"] == STEPS for r in res), "%s: training went on to step %d" %
              (mode, STEPS))
        total = sum(r["plan_bytes"] for r in ref)
        if mode == "ddp":
            # Every rank holds the whole replica; the layers are spread.
            replica, tensors = ref[0]["replica_bytes"], ref[0]["tensors"]
        else:
            # Each rank holds its shards; together they are one replica.
            replica = sum(r["replica_bytes"] for r in ref)
            tensors = sum(r["tensors"] for r in ref)
        print("FIGURES %s bytes written per rank for step %d: %s; together %d; one replica %d "
              "bytes" % (mode, STEPS, [r["plan_bytes"] for r in ref], total, replica))
        check(replica <= total <= replica + 64 * tensors,
              "%s: the four ranks together wrote one replica (%d bytes of tensors, %d with "
              "the layer files' 64-byte alignment), each part once" % (mode, replica, total))
        share = [r["plan_bytes"] / (total / WORLD) for r in ref]
        check(max(share) <= 1.5 and min(share) >= 0.5,
              "%s: each rank wrote about 1/%d of the bytes (%s of an even share)"
              % (mode, WORLD, ", ".join("%.2f" % x for x in share)))
        if mode == "fsdp2":
            full = {row["step"]: row["full"] for row in harness.read_jsonl(ref_logs[0])
                    if "step" in row}
            resize(root, daemons, "fsdp2", full[STEPS])
            _, res = ranks(root, daemons, "ddp-from-fsdp2", "ddp",
                           ["--from-job", "fsdp2-ref", "--expect-refusal"], world=2)
            check(all(r["refused"] == "FAILED_PRECONDITION" and not r["registered"] and
                      "layer 'module.wte'" in r["message"] and "not sharded" in r["message"]
                      for r in res),
                  "fsdp2: its shards restored into a model that is not sharded are refused "
                  "before anything is registered or written, naming a layer: %s"
                  % res[0]["message"])
        if mode == "ddp":
            resize(root, daemons, "ddp", want[0][STEPS])
            owned = sorted(l for r in ref for l in r["owned"])
            check(len(owned) == ref[0]["layers"] and len(set(owned)) == len(owned),
                  "ddp: every layer has exactly one writer (%s)" % [r["owned"] for r in ref])
    finally:
        for d in daemons:
            d.kill()


def resize(root, daemons, mode, want):
    """The 4-rank checkpoint restored on 2 ranks (one per node) into a new
    job: each rank reads the old ranks its node's ckptd holds (old ranks 0-1
    on node 0, 2-3 on node 1) and the ranks exchange them (DDP: each layer
    from its reader; FSDP2: every old shard, each rank keeping its new dim-0
    rows); then training goes on, protected, on 2 ranks. `want`: the hash
    of the 4-rank run's step (DDP: a replica's tensors; FSDP2: the whole
    all-gathered state)."""
    logs, res = ranks(root, daemons, mode + "-2", mode,
                      ["--steps", str(STEPS + 3), "--from-job", mode + "-ref"], world=2)
    restored = [[r for r in harness.read_jsonl(p) if "restored" in r][-1] for p in logs]
    key = "full" if mode == "fsdp2" else "hash"
    check(all(r["restored"] == STEPS for r in restored) and
          all(r[key] == want for r in restored),
          "%s: a 4-rank checkpoint restored on 2 ranks holds step %d of the 4-rank run, bit "
          "for bit" % (mode, STEPS))
    check(all(r["durable"] == STEPS + 3 for r in res), "%s: the 2 ranks trained on to step %d"
          % (mode, STEPS + 3))
    if mode == "ddp":
        owned = [l for r in res for l in r["owned"]]
        check(sorted(owned) == sorted(set(owned)),
              "ddp: on 2 ranks each layer is written once (%s)" % [r["owned"] for r in res])


def layercheck(root, mode):
    """Policy layercheck: FSDP2 ranks all-reduce their shards' drift and
    select the same layers at every step; DDP ranks each decide the layers
    they write, alone (identical replicas: nothing to all-reduce)."""
    daemons = [harness.Daemon(os.path.join(root, "%s-lc-node%d" % (mode, n))).start()
               for n in range(2)]
    try:
        steps = 24
        _, res = ranks(root, daemons, mode + "-lc", mode,
                       ["--steps", str(steps), "--policy", "layercheck"])
        check(all(r["durable"] == steps for r in res),
              "%s layercheck: every rank trained and made all %d steps durable" % (mode, steps))
        traces = []
        for r in range(WORLD):
            path = os.path.join(daemons[r // 2].data, "jobs", mode + "-lc", "rank-%08x" % r,
                                "drift.jsonl")
            rows = [json.loads(line) for line in open(path)]
            traces.append({row["step"]: row["persist"] for row in rows if "step" in row})
        check(all(sorted(t) == list(range(1, steps + 1)) for t in traces),
              "%s layercheck: every rank decided every step" % mode)
        if mode == "fsdp2":
            differ = [s for s in range(1, steps + 1) if any(traces[r][s] != traces[0][s]
                                                            for r in range(WORLD))]
            partial = [s for s in range(1, steps + 1) if 0 < len(traces[0][s]) < res[0]["layers"]]
            check(not differ, "fsdp2 layercheck: the four ranks selected the same layers at "
                  "every step (%d of %d steps selected some layers but not all)"
                  % (len(partial), steps))
            check(partial, "fsdp2 layercheck: LayerCheck did select per layer")
    finally:
        for d in daemons:
            d.kill()


def main():
    root = harness.tempdir("ckpt-dist-")
    global DEVICE
    devices = [x.split("=", 1)[1] for x in sys.argv[1:] if x.startswith("--device=")]
    DEVICE = devices[-1] if devices else "cpu"
    modes = [x for x in sys.argv[1:] if not x.startswith("--")] or ["ddp", "fsdp2"]
    for mode in modes:
        scenario(root, mode)
        layercheck(root, mode)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = harness.rank_parser(STEPS)
        p.add_argument("--job", required=True)
        p.add_argument("--mode", required=True)
        p.add_argument("--log", required=True)
        p.add_argument("--pause-at", type=int, default=0)
        p.add_argument("--device", default="cpu")
        p.add_argument("--restore", action="store_true")
        p.add_argument("--policy", default="all")
        p.add_argument("--on-daemon-loss", default="error")
        p.add_argument("--agree-every", type=int, default=10)
        p.add_argument("--world", type=int, default=WORLD)
        p.add_argument("--from-job")
        p.add_argument("--expect-refusal", action="store_true")
        worker(p.parse_args())
    else:
        main()
