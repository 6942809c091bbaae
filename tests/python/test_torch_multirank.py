"""Multi-rank LayerCheck from ckpt.torch: two ranks of one job (two
processes, torch.distributed over gloo, one ckptd) train different data with
policy `layercheck`. Each step's per-layer drift is all-reduced over a gloo
group of their own, so both ranks select exactly the same layers at every
step (their drift traces are compared line by line), and neither stalls at
the fence (before, attach(world_size=2, policy="layercheck") waited at the
first fence for global sums nobody sent). The per-step cost of the exchange
is printed.

Then two simulated nodes (one ckptd each) with on_daemon_loss="continue":
rank 1's ckptd is SIGKILLed at step 15. Rank 1 trains on unprotected, rank 0
stays protected, and neither waits for the other (rank 1 takes part in each
exchange with zeros): both finish every step. The durable step the ranks
agree on every 10 steps stops advancing, and rank 0's ckptd exports the lag
(ckpt_global_durable_lag_steps); rank 1's ckptd is started again at step 25,
rank 1 re-registers and the agreed step catches up.

Last, one agreed durable step: on two nodes (policy `all`), rank 0 stops
after 20 steps and rank 1 after 25. Restarted, both restore the newest step
durable on every rank (20, all-reduced MIN); rank 1's ckptd deletes its
steps 21..25, its tensors hold exactly their step-20 bytes, and both ranks
train on to step 30.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch or the module
is missing. `--worker` runs one rank.
"""

import hashlib
import json
import os
import shutil
import signal
import statistics
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

STEPS, WORLD = 40, 2


def worker(a):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank,
                            world_size=WORLD)
    torch.manual_seed(7)  # the same initial weights on both ranks
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # reconnect_interval_s=0: a ckptd that is back is re-registered with at
    # the next step (the test orders the restart by a sync point, not time).
    client = ckpt.Client(a.socket, wait_timeout_s=60, on_daemon_loss=a.on_daemon_loss,
                         reconnect_interval_s=0)
    run = ckpt_torch.attach(model, opt, client, job_id=a.job,
                            rank=a.rank, world_size=WORLD, policy=a.policy,
                            layercheck={"k0": 2e-2, "warmup": 3, "warmup_interval": 3,
                                        "s_max": 15},
                            layers=lambda name: "l" + name.split(".")[0],
                            record_trace=a.policy == "layercheck")
    log = open(a.log, "a") if a.log else None

    def tensors_hash():
        h = hashlib.sha256()
        for _, ts in sorted(run.tensors().items()):
            for _, t in ts:
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    first = 1
    if a.restore:
        first = run.restore().target_step + 1
        log.write(json.dumps({"restored": first - 1, "hash": tensors_hash()}) + "\n")
    g = torch.Generator().manual_seed(100 + a.rank)  # different data per rank
    for t in range(first, a.steps + 1):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if log:
            log.write(json.dumps({"step": t, "hash": tensors_hash(),
                                  "agreed": run.agreed_durable_step}) + "\n")
            log.flush()
        if t in a.pause_at:
            # A sync point with the test: it kills or restarts this rank's
            # ckptd now.
            open(os.path.join(a.sync, "reached-%d" % t), "w").close()
            while not os.path.exists(os.path.join(a.sync, "go-%d" % t)):
                time.sleep(0.01)
    try:
        durable = run.wait_durable()
    except ckpt.Error as e:
        if e.code != "ABORTED":  # a step lost with ckptd
            raise
        durable = None
    st = run.stats()
    # After wait_durable, whose join ends the background agreements: the
    # last agreed step, the same on every rank.
    print(json.dumps({"rank": a.rank, "steps": run.step, "durable": durable,
                      "agreed": run.agreed_durable_step,
                      "unprotected": client.unprotected,
                      "exchange_s": statistics.median(st.drift_exchange_s or [0.0]),
                      "exchanges": len(st.drift_exchange_s)}))
    run.close()
    dist.destroy_process_group()


def ranks(root, sockets, job, extra=(), on_sync=None, store_suffix=""):
    """Runs the two ranks; returns their result lines. `on_sync` maps a
    pause step to what runs when a rank reaches it (see worker)."""
    store = os.path.join(root, job + "-store" + store_suffix)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                               "--rank", str(r), "--socket", sockets[r], "--store", store,
                               "--job", job, "--sync", root] + list(extra[r] if extra else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    try:
        for step, action in sorted((on_sync or {}).items()):
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(root, "reached-%d" % step)):
                assert time.time() < deadline and all(p.poll() is None for p in procs), \
                    [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
                time.sleep(0.01)
            action()
            open(os.path.join(root, "go-%d" % step), "w").close()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        harness.kill_processes(procs)


def daemon_loss(root):
    """Two nodes; rank 1's ckptd dies at step 15 and is back at step 25."""
    daemons = [harness.Daemon(os.path.join(root, "node%d" % r)).start() for r in range(WORLD)]
    logs = [os.path.join(root, "loss-rank%d.jsonl" % r) for r in range(WORLD)]
    lag = []
    try:
        def kill_node1():
            daemons[1].proc.send_signal(signal.SIGKILL)
            daemons[1].proc.wait(timeout=30)

        def restart_node1():
            # Rank 0 waits for rank 1 at the next drift all-reduce: its
            # newest step is 25 or 26 now, and its agreed step is stuck.
            address = daemons[0].ctl("status")["metrics_address"]
            lag.append(harness.metric(address, "ckpt_global_durable_lag_steps"))
            daemons[1].start()

        results = ranks(root, [d.socket for d in daemons], "loss",
                        extra=[["--on-daemon-loss", "continue", "--log", logs[0]],
                               ["--on-daemon-loss", "continue", "--pause-at", "15,25",
                                "--log", logs[1]]],
                        on_sync={15: kill_node1, 25: restart_node1})
        check(all(r["steps"] == STEPS for r in results),
              "both ranks trained all %d steps; none waited for the other" % STEPS)
        check(results[0]["durable"] == STEPS and not results[0]["unprotected"],
              "rank 0 stayed protected: every step durable on its ckptd")
        agreed = [{row["step"]: row["agreed"] for row in harness.read_jsonl(p)} for p in logs]
        # Each rank logs the agreement its background thread last finished,
        # so at a given step one rank may still show the previous one (a
        # flake under load compared them step by step). What must hold: each
        # rank's agreements only move forward, never past the last one, and
        # both ranks end on the same one.
        final = results[0]["agreed"]
        seen = [[v for _, v in sorted(a.items()) if v is not None] for a in agreed]
        check(final is not None and results[1]["agreed"] == final and
              all(s == sorted(s) and all(v <= final for v in s) for s in seen),
              "both ranks' agreed durable steps moved forward only and ended on the same one "
              "(%s, %s)" % (final, results[1]["agreed"]))
        stuck = [agreed[0][t] for t in range(20, 26)]
        check(all(a is not None and a <= 15 for a in stuck),
              "with rank 1's ckptd gone, the agreed durable step stayed at or below 15 "
              "(%s at steps 20..25)" % stuck)
        check(lag[0] is not None and lag[0] >= 10,
              "rank 0's ckptd exports the lag: ckpt_global_durable_lag_steps %s at step 25"
              % lag[0])
        check(results[1]["durable"] == STEPS and not results[1]["unprotected"],
              "rank 1 re-registered with its restarted ckptd and is protected again")
        check(results[0]["agreed"] > 25,
              "the job caught up: the agreed durable step is %d at the end (agreed at step "
              "30, after rank 1's ckptd came back at 25)" % results[0]["agreed"])
        jobs = {j["job_id"]: j for j in daemons[0].ctl("jobs")["jobs"]}
        reported = jobs["loss"]["ranks"][0]["agreed_step"]
        check(reported > 25 and reported in seen[0] + [results[0]["agreed"]],
              "ckptctl jobs shows an agreed step rank 0 reported with its steps (%d)" % reported)
    finally:
        for d in daemons:
            d.kill()


def agreed_restore(root):
    """Rank 0 stops at step 20, rank 1 at 25; both restore step 20."""
    daemons = [harness.Daemon(os.path.join(root, "agree%d" % r)).start() for r in range(WORLD)]
    try:
        logs = [os.path.join(root, "agree-rank%d.jsonl" % r) for r in range(WORLD)]
        sockets = [d.socket for d in daemons]
        common = [["--policy", "all", "--log", logs[r]] for r in range(WORLD)]
        results = ranks(root, sockets, "agree",
                        extra=[common[0] + ["--steps", "20"], common[1] + ["--steps", "25"]])
        check([r["durable"] for r in results] == [20, 25], "rank 0 stopped at 20, rank 1 at 25")
        before = [{row["step"]: row["hash"] for row in harness.read_jsonl(logs[r]) if "step" in row}
                  for r in range(WORLD)]
        results = ranks(root, sockets, "agree",
                        extra=[common[r] + ["--steps", "30", "--restore"] for r in range(WORLD)],
                        store_suffix="-again")
        restored = [[row for row in harness.read_jsonl(logs[r]) if "restored" in row][0]
                    for r in range(WORLD)]
        check([row["restored"] for row in restored] == [20, 20],
              "both ranks restored the newest step durable on both: 20")
        check(all(restored[r]["hash"] == before[r][20] for r in range(WORLD)),
              "each rank's tensors hold exactly their step-20 bytes")
        check([r["durable"] for r in results] == [30, 30],
              "both ranks trained on from step 21 to 30 (rank 1's ckptd let go of 21..25)")
        events = daemons[1].ctl("history", "agree", "--rank=1")
        print("rank 1 history after the restore: %s" % json.dumps(events)[:300])
    finally:
        for d in daemons:
            d.kill()


def main():
    root = harness.tempdir("ckpt-mr-")
    daemon = harness.Daemon(root).start()
    try:
        results = ranks(root, [daemon.socket] * WORLD, "mr")
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
    daemon_loss(root)
    agreed_restore(root)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = harness.rank_parser(STEPS)
        p.add_argument("--job", default="mr")
        p.add_argument("--pause-at", type=lambda v: [int(x) for x in v.split(",")],
                       default=[])
        p.add_argument("--on-daemon-loss", default="error")
        p.add_argument("--policy", default="layercheck")
        p.add_argument("--log")
        p.add_argument("--restore", action="store_true")
        worker(p.parse_args())
    else:
        main()
