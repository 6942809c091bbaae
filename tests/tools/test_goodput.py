"""tools/goodput.py: the failure record as cited, the model's arithmetic on
a case worked by hand, and the command line."""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "goodput.py")
sys.path.insert(0, os.path.dirname(TOOL))
import goodput  # noqa: E402


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok: " + what)


def record():
    r = goodput.DEFAULT["record"]
    total = sum(r["in_place"].values()) + sum(r["node_lost"].values())
    check(total == 419, "the record's root causes add up to its 419 interruptions (%d)" % total)
    gpu = sum(v for k, v in r["node_lost"].items() if "GPU" in k or k == "silent data corruption")
    check(gpu == 268, "GPU-class causes: %d" % gpu)
    rates = goodput.failure_rates(goodput.DEFAULT, 16384)
    per_day = (rates["in_place"] + rates["node_lost"]) * 86400
    check(abs(per_day - 419 / 54) < 1e-9, "16,384 GPUs: %.2f failures a day" % per_day)
    half = goodput.failure_rates(goodput.DEFAULT, 8192)
    check(abs(half["node_lost"] * 2 - rates["node_lost"]) < 1e-15, "rates scale with the GPUs")


def by_hand():
    # One GPU per node, a 1 GB state measured as such, one in-place failure
    # a day: DCP every 10 one-second steps, blocked 1 s per save.
    s = goodput.merge(goodput.DEFAULT, {
        "record": {"days": 1, "gpus": 1, "in_place": {"x": 1}, "node_lost": {}},
        "job": {"step_s": 1.0, "state_bytes_per_gpu": 1e9, "gpus_per_node": 1,
                "restart_in_place_s": 100.0},
        "measured": {"state_bytes": 1e9, "dcp_async_blocked_s": 1.0},
        "cluster": {"storage_write_gbps": 1.0, "storage_read_gbps": 2.0},
        "systems": {"dcp_every_steps": [10], "ckptd_every_steps": []},
    })
    res = goodput.ettr(s, 1)
    check(len(res) == 1, "one system: %s" % list(res))
    r = next(iter(res.values()))
    # steady 1/10; lost work 10/2 + 1 s (the save's write); restore 1/2 s.
    want = (1 - 0.1) * (1 - (100 + 0.5 + 6) / 86400)
    check(abs(r["ettr"] - want) < 1e-12, "ETTR %.9f, by hand %.9f" % (r["ettr"], want))
    check(r["failures"]["in_place"]["lost_work_s"] == 6.0, "lost work 6 s")


def trailing():
    check(goodput.trailing(1.0, 2.0, 10.0) == 3.0, "a transfer within the interval trails by one")
    check(goodput.trailing(1.0, 20.0, 10.0) == 31.0,
          "a transfer slower than the saves trails by one and a half")


def peers():
    res = goodput.ettr(goodput.DEFAULT, 16384)
    plain = res["ckptd every 1 steps, memory + disk + object store"]
    peer = res["ckptd every 1 steps, with a peer replica"]
    dcp = res["DCP async_save every 100 steps, shared storage"]
    # 8 GPUs of 346 MB; the peer's pull at 0.39 GB/s x 1.12 s / 0.99 s.
    want = 8 * 346e6 / 1e9 / (0.39 * 1.12 / 0.99)
    got = peer["failures"]["node_lost"]["restore_s"]
    check(abs(got - want) < 1e-9, "a peer's restore %.3f s, by hand %.3f s" % (got, want))
    # StepDone's rise with replication, 1.57 ms a save, every 10 s step.
    extra = peer["steady_overhead"] - plain["steady_overhead"]
    check(abs(extra - 0.00157 / 10) < 1e-12, "replication blocks %.6f of the time more" % extra)
    check(peer["failures"]["node_lost"]["cost_s"] < plain["failures"]["node_lost"]["cost_s"],
          "a peer's copy costs less per node lost than the object store's")
    check(dcp["ettr"] < plain["ettr"] < peer["ettr"] < 1,
          "DCP every 100 steps < ckptd < ckptd with peers: %.4f %.4f %.4f"
          % (dcp["ettr"], plain["ettr"], peer["ettr"]))


def command_line():
    out = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, timeout=60)
    check(out.returncode == 0 and "1024 GPUs" in out.stdout and "16384 GPUs" in out.stdout,
          "the default report names both sizes")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"job": {"restart_node_s": 0.0}}, f)
    out = subprocess.run([sys.executable, TOOL, "--gpus=4096", "--json", "--scenario=" + f.name],
                         capture_output=True, text=True, timeout=60)
    os.unlink(f.name)
    figures = json.loads(out.stdout)["4096"]
    restarts = {r["failures"]["node_lost"]["restart_s"] for r in figures.values()}
    check(restarts == {0.0}, "--scenario overrides an input: %s" % restarts)
    bad = subprocess.run([sys.executable, TOOL, "--gpus=0"], capture_output=True, text=True,
                         timeout=60)
    check(bad.returncode == 2 and "positive" in bad.stderr, "--gpus=0 is refused")


if __name__ == "__main__":
    record()
    by_hand()
    trailing()
    peers()
    command_line()
