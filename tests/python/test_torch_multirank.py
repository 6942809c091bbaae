"""Multi-rank LayerCheck from ckpt.torch: two ranks of one job (two
processes, torch.distributed over gloo, one ckptd) train different data with
policy `layercheck`. Each step's per-layer drift is all-reduced over a gloo
group of their own, so both ranks select exactly the same layers at every
step (their drift traces are compared line by line), and neither stalls at
the fence (before, attach(world_size=2, policy="layercheck") waited at the
first fence for global sums nobody sent). The per-step cost of the exchange
is printed.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or the module
is missing. `--worker` runs one rank.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

try:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import ckpt
    from ckpt import torch as ckpt_torch
except ImportError as e:  # pragma: no cover - reported as a skip
    print("skipping: %s" % e)
    sys.exit(77)

STEPS, WORLD = 40, 2


def worker(a):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank,
                            world_size=WORLD)
    torch.manual_seed(7)  # the same initial weights on both ranks
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ckpt_torch.attach(model, opt, ckpt.Client(a.socket, wait_timeout_s=60), job_id="mr",
                            rank=a.rank, world_size=WORLD, policy="layercheck",
                            layercheck={"k0": 2e-2, "warmup": 3, "warmup_interval": 3,
                                        "s_max": 15},
                            layers=lambda name: "l" + name.split(".")[0], record_trace=True)
    g = torch.Generator().manual_seed(100 + a.rank)  # different data per rank
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    run.wait_durable()
    st = run.stats()
    print(json.dumps({"rank": a.rank, "steps": run.step,
                      "exchange_s": statistics.median(st.drift_exchange_s),
                      "exchanges": len(st.drift_exchange_s)}))
    run.close()
    dist.destroy_process_group()


def main():
    root = harness.tempdir("ckpt-mr-")
    daemon = harness.Daemon(root).start()
    try:
        store = os.path.join(root, "store")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                   "--rank", str(r), "--socket", daemon.socket, "--store", store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(WORLD)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        check(all(r["steps"] == STEPS and r["exchanges"] == STEPS for r in results),
              "both ranks trained %d steps and exchanged drift at each" % STEPS)
        traces = []
        for r in range(WORLD):
            path = os.path.join(daemon.data, "jobs", "mr", "rank-%08x" % r, "drift.jsonl")
            rows = [json.loads(line) for line in open(path)]
            traces.append({row["step"]: row["persist"] for row in rows if "step" in row})
        steps = sorted(traces[0])
        check(steps == list(range(1, STEPS + 1)) and sorted(traces[1]) == steps,
              "both traces hold steps 1..%d" % STEPS)
        differ = [s for s in steps if traces[0][s] != traces[1][s]]
        partial = [s for s in steps if 0 < len(traces[0][s]) < 3]
        check(not differ, "both ranks selected the same layers at every step (%d steps, %d of "
              "them selecting some layers but not all)" % (len(steps), len(partial)))
        check(len(partial) > 0, "LayerCheck did select per layer (not all or nothing)")
        print("FIGURES multirank drift exchange: median %.6f s per step on rank 0, %.6f s on "
              "rank 1 (partials, gloo all-reduce of 2 x 3 doubles, global sums back; beside the "
              "next forward/backward)" % (results[0]["exchange_s"], results[1]["exchange_s"]))
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", action="store_true")
        p.add_argument("--rank", type=int, required=True)
        p.add_argument("--socket", required=True)
        p.add_argument("--store", required=True)
        worker(p.parse_args())
    else:
        main()
