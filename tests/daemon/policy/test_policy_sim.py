"""ckpt_policy_sim on the fidelity experiment's drift traces
(docs/fidelity/traces, recorded by ckptd):

- replaying a trace with its recorded config reproduces every persist set
  ckptd recorded (with and without a write budget): the simulator predicts
  what the daemon does;
- for write budgets from the staleness guard's floor up, the achieved bytes
  per step are within 10 % of the budget and no layer gets S_max steps old;
  a smaller budget gives fewer bytes, more staleness and a larger multiplier;
- a budget in bytes/s with a step time equals the same budget per step;
- malformed budgets are refused with exit status 2 and a message."""

import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
TRACES = os.path.join(REPO, "docs", "fidelity", "traces")


def sim(*args, check=True):
    exe = os.path.join(os.environ.get("CKPT_BUILD_DIR", os.path.join(REPO, "build")), "tools",
                       "ckpt_policy_sim")
    out = subprocess.run([exe] + list(args), capture_output=True, text=True, timeout=60)
    if check:
        assert out.returncode == 0, (args, out.returncode, out.stderr)
    return out


def header(path):
    with open(path) as f:
        return json.loads(f.readline())


def main():
    traces = sorted(glob.glob(os.path.join(TRACES, "lc_*_ff.drift.jsonl")))
    assert len(traces) >= 3, "the fidelity traces are missing from %s" % TRACES
    for path in traces:
        name = os.path.basename(path)
        h = header(path)
        total = sum(l["bytes"] for l in h["layers"])
        s_max = h["config"]["s_max"]

        # The recorded config (and budget, if the run had one) replays exactly.
        r = json.loads(sim("--trace=" + path, "--json").stdout)
        res = r["results"][0]
        assert res["steps_matching_trace"] == r["steps"], (name, res["steps_matching_trace"],
                                                           r["steps"])
        if "budget" in h["config"]:
            assert abs(res["budget_bytes_per_step"] - h["config"]["budget"]["bytes_per_step"]) < 1
            print("%s: recorded budget %.2f MiB/step, achieved %.3fx" %
                  (name, res["budget_bytes_per_step"] / 2 ** 20, res["achieved_over_budget"]))
            continue

        # Budgets as fractions of a full checkpoint per step, above the floor
        # the guard writes (a full checkpoint every S_max steps).
        fracs = [f for f in (0.04, 0.06, 0.1, 0.2, 0.4) if f * s_max > 1.5]
        budgets = [str(int(f * total)) for f in fracs]
        r = json.loads(sim("--trace=" + path, "--json", "--no-budget",
                           "--budget-bytes-per-step=" + ",".join(budgets)).stdout)
        prev = None
        for f, res in zip(fracs, r["results"]):
            ratio = res["achieved_over_budget"]
            assert abs(ratio - 1) <= 0.10, (name, f, ratio)
            assert res["max_staleness"] < s_max, (name, f, res["max_staleness"])
            if prev is not None:
                assert res["bytes"] > prev["bytes"], (name, f)
                assert res["mean_k_multiplier"] < prev["mean_k_multiplier"], (name, f)
                assert res["mean_size_weighted_staleness"] < \
                    prev["mean_size_weighted_staleness"], (name, f)
            prev = res
            print("%s: budget %.2f MiB/step -> %.3fx, SW staleness %.2f, mean K multiplier %.2f" %
                  (name, res["budget_bytes_per_step"] / 2 ** 20, ratio,
                   res["mean_size_weighted_staleness"], res["mean_k_multiplier"]))

        # bytes/s x step_s is the same budget.
        per_step = json.loads(sim("--trace=" + path, "--json", "--no-budget",
                                  "--budget-bytes-per-step=%d" % (0.1 * total * 0.5))
                              .stdout)["results"][0]
        per_s = json.loads(sim("--trace=" + path, "--json", "--no-budget", "--step-s=0.5",
                               "--budget-bytes-per-s=%d" % (0.1 * total)).stdout)["results"][0]
        assert per_step["bytes"] == per_s["bytes"], (per_step, per_s)
        assert abs(per_s["achieved_bytes_per_s"] - per_s["achieved_bytes_per_step"] / 0.5) < 1

        # Series: per-step bytes add up, and the guard holds at every step.
        r = json.loads(sim("--trace=" + path, "--json", "--series", "--no-budget",
                           "--budget-bytes-per-step=%d" % (0.1 * total)).stdout)["results"][0]
        assert sum(r["series"]["bytes"]) == r["bytes"]
        assert max(r["series"]["max_staleness"]) < s_max

    # Refusals.
    path = traces[0]
    for args, what in ((["--budget-share=0.5", "--step-s=1"], "device_write_bytes_per_s"),
                       (["--budget-bytes-per-s=1e8"], "step_s"),
                       (["--budget-bytes-per-s=1e8", "--budget-bytes-per-step=1e6"], "one form"),
                       (["--budget-bytes-per-step=1M", "--budget-k-min=2",
                         "--budget-k-max=1"], "k_min"),
                       (["--budget-bytes-per-step=x"], "bad value")):
        out = sim("--trace=" + path, *args, check=False)
        assert out.returncode == 2 and what in out.stderr, (args, out.returncode, out.stderr)
    # Suffixes: 1Mi = 1048576, 1M = 1e6.
    a = json.loads(sim("--trace=" + path, "--json", "--budget-bytes-per-step=8Mi").stdout)
    b = json.loads(sim("--trace=" + path, "--json", "--budget-bytes-per-step=8388608").stdout)
    assert a["results"][0]["bytes"] == b["results"][0]["bytes"]
    print("ckpt_policy_sim: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
