"""LayerCheck end to end: the example trainer runs real AdamW steps (weights,
exp_avg, exp_avg_sq in ckptd shared memory), the daemon reconstructs each
layer's drift from the optimizer state and persists only layers that moved
enough. Checks: fewer bytes than policy `all` on the same workload; after a
SIGKILL the composite restore's per-layer steps equal `ckptctl plan`, every
layer's bytes equal the killed process's at that step, staleness stays below
S_max; the recorded drift trace replays in ckpt_policy_sim."""

import os
import shutil
import signal
import subprocess
import sys
import time

import harness

ARGS = ["--layers=8", "--layer-bytes=128K", "--optimizer=adamw", "--lr=1e-4",
        "--warmup=20", "--warmup-interval=10"]


def main():
    root = harness.tempdir("ckpt-lc-")
    try:
        d = harness.Daemon(root).start()
        out = harness.run_trainer(d, "lc-all", "--policy=all", "--steps=150", *ARGS)
        assert out.returncode == 0, out.stderr
        out = harness.run_trainer(d, "lc-ref", "--policy=layercheck", "--steps=150", *ARGS)
        assert out.returncode == 0, out.stderr
        jobs = {j["job_id"]: j for j in d.ctl("jobs")["jobs"]}
        b_all, b_lc = jobs["lc-all"]["bytes"], jobs["lc-ref"]["bytes"]
        print("150 AdamW steps, 8 layers: policy all wrote %d bytes, layercheck %d (%.1fx fewer)" %
              (b_all, b_lc, b_all / b_lc))
        assert b_lc * 2 < b_all, (b_lc, b_all)

        # Kill a layercheck run mid-way and restore it in a new process.
        log = os.path.join(root, "steps.jsonl")
        proc = subprocess.Popen(
            harness.trainer_cmd(d, "lc", "--policy=layercheck", "--steps=100000", "--log=" + log,
                                "--record-trace", "--compute-ms=1", *ARGS),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 240
        while time.time() < deadline:
            rows = harness.read_jsonl(log)
            if rows and rows[-1]["step"] >= 150:
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        layers_live = d.ctl("layers", "lc")
        assert layers_live["policy"] == "layercheck" and "threshold" in layers_live["layers"][1]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        plan = d.stable_plan("lc")
        assert plan["complete"]
        assert plan["max_staleness"] < 200, plan
        out = harness.run_trainer(d, "lc", "--policy=layercheck", "--restore", "--verify-log=" + log,
                                  "--steps=%d" % (plan["target_step"] + 10), *ARGS)
        sys.stdout.write(out.stdout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "verify: 8 of 8 layers match" in out.stdout
        restored = {}
        lines = out.stdout.splitlines()
        start = next(i for i, l in enumerate(lines) if l.startswith("composite restore"))
        for line in lines[start + 2:start + 2 + 8]:
            name, step = line.split()[0], int(line.split()[1])
            restored[name] = step
        planned = {l["name"]: l["step"] for l in plan["layers"]}
        assert restored == planned, (restored, planned)
        print("restored per-layer steps equal ckptctl plan: %s" % sorted(set(planned.values())))

        # The recorded trace replays under other thresholds.
        trace = os.path.join(d.data, "jobs", "lc", "rank-00000000", "drift.jsonl")
        sim = subprocess.run([os.path.join(harness.BUILD, "tools", "ckpt_policy_sim"),
                              "--trace=" + trace, "--k0=1e-4,1e-3,1e-2", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert sim.returncode == 0, sim.stderr
        import json
        res = json.loads(sim.stdout)["results"]
        assert len(res) == 3
        writes = [r["layer_writes"] for r in res]
        assert writes[0] >= writes[1] >= writes[2], writes  # larger K0, fewer writes
        print("policy sim over the trace, K0 1e-4/1e-3/1e-2: layer writes %s" % writes)
        assert d.stop() == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
