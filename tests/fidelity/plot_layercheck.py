#!/usr/bin/env python3
"""LayerCheck's write budget and warm-up on the fidelity experiment's drift
traces, through ckpt_policy_sim (the daemon's own policy code).

    tests/fidelity/plot_layercheck.py [--build build] [--traces docs/fidelity/traces]
                                      [--plots docs/plots]

Prints two Markdown tables (budget vs achieved rate vs staleness; what a
warm-up changes) and writes docs/plots/layercheck_budget.png and
docs/plots/layercheck_warmup.png. Budgets are given in bytes/s with the step
time the traces' wall times imply (the fidelity run's measured steps), or
--step-s."""

import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
MIB = 2 ** 20
# Budgets as fractions of a full checkpoint (every layer) per step.
FRACS = (0.015, 0.03, 0.04, 0.06, 0.1, 0.15, 0.2, 0.3, 0.4)
WARMUPS = ((1, 50), (10, 5), (20, 10), (50, 10), (200, 50))


def sim(exe, trace, *args):
    out = subprocess.run([exe, "--trace=" + trace, "--json"] + list(args), capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        sys.exit("ckpt_policy_sim %s: %s" % (" ".join(args), out.stderr.strip()))
    return json.loads(out.stdout)


def read_trace(path):
    header, steps = None, []
    with open(path) as f:
        for line in f:
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if "layers" in j and "step" not in j:
                if header is not None:
                    break  # the first registration's timeline only
                header = j
            elif "step" in j:
                steps.append(j)
    return header, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--traces", default=os.path.join(REPO, "docs", "fidelity", "traces"),
                    help="the drift traces of a fidelity run (default: the run in docs/fidelity)")
    ap.add_argument("--plots", default=os.path.join(REPO, "docs", "plots"))
    ap.add_argument("--step-s", type=float, default=0, help="seconds per step (default: the "
                    "traces' recorded step interval)")
    a = ap.parse_args()
    exe = os.path.join(a.build, "tools", "ckpt_policy_sim")
    traces = sorted(glob.glob(os.path.join(a.traces, "lc_1e-?_ff.drift.jsonl")),
                    key=lambda p: -float(os.path.basename(p).split("_")[1]))
    if not traces:
        sys.exit("no lc_<K0>_ff.drift.jsonl in %s" % a.traces)

    # ---- the budget sweep, with one step time for every trace: --step-s,
    # else the median of the traces' recorded step intervals
    step_s = a.step_s
    if not step_s:
        measured = sorted(sim(exe, p, "--no-budget").get("measured_step_s") or 0 for p in traces)
        step_s = measured[len(measured) // 2]
        if not step_s:
            sys.exit("the traces record no wall times: give --step-s")
    sweep = {}
    for path in traces:
        header, steps = read_trace(path)
        k0 = header["config"]["k0"]
        total = sum(l["bytes"] for l in header["layers"])
        free = sim(exe, path, "--no-budget")
        rates = [f * total / step_s for f in FRACS]
        r = sim(exe, path, "--no-budget", "--step-s=%r" % step_s, "--series",
                "--budget-bytes-per-s=" + ",".join("%d" % x for x in rates))
        sweep[k0] = {"free": free["results"][0], "step_s": step_s, "total": total,
                     "results": r["results"], "s_max": header["config"]["s_max"]}

    print("Budget sweep (`ckpt_policy_sim --trace=TRACE --no-budget --step-s=S "
          "--budget-bytes-per-s=LIST --json`):\n")
    print("| trace (K0) | budget | achieved | achieved / budget | forced by rules | mean size-weighted "
          "staleness | max staleness | mean K multiplier |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for k0, s in sweep.items():
        fr = s["free"]
        print("| %g, no budget | - | %.1f MiB/s | - | %.0f %% | %.2f steps | %d | 1 |" %
              (k0, fr["achieved_bytes_per_step"] / s["step_s"] / MIB,
               100.0 * fr["forced_bytes"] / max(1, fr["bytes"]), fr["mean_size_weighted_staleness"],
               fr["max_staleness"]))
        for res in s["results"]:
            ratio = res["achieved_over_budget"]
            guard_floor = s["total"] / s["s_max"]
            feasible = res["budget_bytes_per_step"] > 1.2 * guard_floor
            if feasible:
                worst = max(worst, abs(ratio - 1))
            print("| %g | %.1f MiB/s (%.1f MiB/step) | %.1f MiB/s | **%.3f**%s | %.0f %% | %.2f steps "
                  "| %d | %.2f |" %
                  (k0, res["budget_bytes_per_s"] / MIB, res["budget_bytes_per_step"] / MIB,
                   res["achieved_bytes_per_s"] / MIB, ratio, "" if feasible else " (guard)",
                   100.0 * res["forced_bytes"] / max(1, res["bytes"]),
                   res["mean_size_weighted_staleness"], res["max_staleness"],
                   res["mean_k_multiplier"]))
    print("\nLargest |achieved / budget - 1| where the budget is above 1.2 x the guard's floor "
          "(a full checkpoint every S_max steps): %.1f %%. Step time %.3f s (%s)." %
          (100 * worst, step_s, "given" if a.step_s else
           "the median of the traces' recorded step intervals"))

    # the same, one row per budget
    k0s = list(sweep)
    print("\nThe same, one row per budget (achieved / budget, mean size-weighted staleness):\n")
    print("| budget | " + " | ".join("trace K0 = %g" % k for k in k0s) + " |")
    print("| --- |" + " --- |" * len(k0s))
    print("| none | " + " | ".join("%.1f MiB/s, %.2f steps" % (
        sweep[k]["free"]["achieved_bytes_per_step"] / step_s / MIB,
        sweep[k]["free"]["mean_size_weighted_staleness"]) for k in k0s) + " |")
    for i, f in enumerate(FRACS):
        r0 = sweep[k0s[0]]["results"][i]
        below = f * sweep[k0s[0]]["s_max"] < 1  # under the guard's floor
        print("| %.1f MiB/s (%g %% of a full checkpoint per step%s) | " %
              (r0["budget_bytes_per_s"] / MIB, 100 * f,
               ", below the guard's %g %%" % (100.0 / sweep[k0s[0]]["s_max"]) if below else "") +
              " | ".join("%.3f, %.2f steps" % (sweep[k]["results"][i]["achieved_over_budget"],
                                               sweep[k]["results"][i]["mean_size_weighted_staleness"])
                         for k in k0s) + " |")

    # ---- warm-up
    print("\nWarm-up (`ckpt_policy_sim --trace=TRACE --warmup=W --warmup-interval=I --json`, "
          "no budget; staleness of the newest selected versions over all the steps, the warm-up included):\n")
    print("| trace (K0) | warm-up W / interval | bytes | vs W = 1 | mean size-weighted staleness | "
          "max staleness | steps with a write | of them in steps 2-20 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    warm = {}
    for path in traces:
        header, steps = read_trace(path)
        k0 = header["config"]["k0"]
        rows = []
        for w, wi in WARMUPS:
            r = sim(exe, path, "--no-budget", "--warmup=%d" % w, "--warmup-interval=%d" % wi,
                    "--series")["results"][0]
            rows.append((w, wi, r))
        base_bytes = rows[0][2]["bytes"]
        for w, wi, r in rows:
            ser = r["series"]
            early = sum(1 for t, b in enumerate(ser["bytes"], 1) if 2 <= t <= 20 and b > 0)
            print("| %g | %d / %d | %.0f MiB | %.2fx | %.2f steps | %d | %d | %d |" %
                  (k0, w, wi, r["bytes"] / MIB, r["bytes"] / base_bytes,
                   r["mean_size_weighted_staleness"], r["max_staleness"],
                   sum(1 for b in ser["bytes"] if b > 0), early))
        warm[k0] = rows

    # ---- plots
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("\n(matplotlib missing: no plots)")
        return 0
    os.makedirs(a.plots, exist_ok=True)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.3))
    for i, (k0, s) in enumerate(sweep.items()):
        b = [r["budget_bytes_per_s"] / MIB for r in s["results"]]
        y = [r["achieved_bytes_per_s"] / MIB for r in s["results"]]
        st = [r["mean_size_weighted_staleness"] for r in s["results"]]
        ax[0].plot(b, y, "o-", color="C%d" % i, label="trace K0=%g" % k0)
        ax[1].plot(b, st, "o-", color="C%d" % i, label="trace K0=%g" % k0)
        free = s["free"]
        ax[1].axhline(free["mean_size_weighted_staleness"], color="C%d" % i, ls=":", lw=0.8)
    lim = max(r["budget_bytes_per_s"] for s in sweep.values() for r in s["results"]) / MIB
    ax[0].plot([0, lim], [0, lim], color="0.5", lw=0.8, label="achieved = budget")
    ax[0].fill_between([0, lim], [0, 0.9 * lim], [0, 1.1 * lim], color="0.85", label="±10 %")
    floor = [s["total"] / s["s_max"] / s["step_s"] / MIB for s in sweep.values()][0]
    ax[0].axvline(floor, color="C3", ls="--", lw=0.8, label="guard floor (full / S_max)")
    ax[0].set_xlabel("budget [MiB/s]")
    ax[0].set_ylabel("achieved write rate [MiB/s]")
    ax[0].set_title("achieved rate vs budget (200 steps)")
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("budget [MiB/s]")
    ax[1].set_ylabel("mean size-weighted staleness [steps]")
    ax[1].set_title("staleness vs budget (dotted: no budget)")
    ax[1].set_xscale("log")
    ax[1].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax[1].set_xticks([5, 10, 20, 50])
    ax[1].legend(fontsize=7)
    # the running average of one trace at three budgets
    k0 = 1e-3 if 1e-3 in sweep else list(sweep)[0]
    s = sweep[k0]
    for j, idx in enumerate((1, 3, 6)):
        if idx >= len(s["results"]):
            continue
        r = s["results"][idx]
        cum, out = 0, []
        for t, b in enumerate(r["series"]["bytes"], 1):
            cum += b
            out.append(cum / t / r["budget_bytes_per_step"])
        ax[2].plot(range(1, len(out) + 1), out, color="C%d" % j,
                   label="budget %.1f MiB/s" % (r["budget_bytes_per_s"] / MIB))
    ax[2].axhspan(0.9, 1.1, color="0.9")
    ax[2].set_ylim(0, 3)
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("average rate so far / budget")
    ax[2].set_title("convergence, trace K0=%g (the base checkpoint at step 1)" % k0, fontsize=9)
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(a.plots, "layercheck_budget.png"), dpi=100)
    plt.close(fig)

    # warm-up: which steps persist which layer, default vs the old warm-up
    path = [p for p in traces if "_1e-3_" in p] or traces
    header, steps = read_trace(path[0])
    names = [l["name"] for l in header["layers"]]
    fig, ax = plt.subplots(1, 2, figsize=(14, 4), sharey=True)
    for j, (w, wi) in enumerate(((1, 50), (200, 50))):
        r = sim(exe, path[0], "--no-budget", "--warmup=%d" % w, "--warmup-interval=%d" % wi,
                "--series")
        xs, ys = [], []
        for st, pers in zip(steps, r["results"][0]["series"]["persist"]):
            xs += [st["step"]] * len(pers)
            ys += pers
        res = r["results"][0]
        ax[j].scatter(xs, ys, marker="|", s=60, color="C%d" % j)
        ax[j].set_title("warm-up W=%d%s: %d layer writes, %.0f MiB, mean SW staleness %.1f steps"
                        % (w, "" if w <= 1 else ", full every %d" % wi, res["layer_writes"],
                           res["bytes"] / MIB, res["mean_size_weighted_staleness"]), fontsize=9)
        ax[j].set_xlabel("step")
    ax[0].set_yticks(range(len(names)))
    ax[0].set_yticklabels(names, fontsize=7)
    fig.suptitle("which layer is persisted at which step, trace K0=%g, S_max=%d (%d fine-tuning "
                 "steps)" % (header["config"]["k0"], header["config"]["s_max"], len(steps)),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(a.plots, "layercheck_warmup.png"), dpi=100)
    plt.close(fig)
    print("\nplots: %s, %s" % (os.path.join(a.plots, "layercheck_budget.png"),
                               os.path.join(a.plots, "layercheck_warmup.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
