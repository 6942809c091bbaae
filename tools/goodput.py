#!/usr/bin/env python3
"""Goodput on paper: the effective training time ratio (ETTR) of a large job
under a public failure record, for several ways of checkpointing it, from
measured components (docs/goodput.md explains the model and every input).

    tools/goodput.py                      # the default scenario, 1,024 and 16,384 GPUs
    tools/goodput.py --gpus=4096 --json   # one size, machine-readable
    tools/goodput.py --scenario=my.json   # inputs overridden from a JSON file

The model, per system and failure kind k (first order, valid while the
failure cost is a small share of the time):

    steady   = stall per save / (save interval)
    cost_k   = restart_k + restore_k + lost work_k       (seconds of the job)
    ETTR     = (1 - steady) * (1 - sum_k rate_k * cost_k)

with rate_k the failures of kind k per second of the job, scaled linearly
with the number of GPUs from the record. Lost work is half a save interval
plus the lag until the copy that kind of failure restores from was durable.
Only the standard library is used.
"""

import argparse
import copy
import json
import sys

# Every input, with where it comes from. "measured": this repository's docs,
# on its 2-core VM, taken as each node's figure with every node of the job
# at it at once (that scaling is assumed); "record": the public failure
# record; "assumed": a cluster figure the user should replace with their own
# (--scenario).
DEFAULT = {
    "record": {
        "what": "Llama 3 405B pre-training, 54 days on 16,384 H100 GPUs: 419 unexpected "
                "interruptions (Meta, The Llama 3 Herd of Models, 2024, table 5)",
        "days": 54, "gpus": 16384,
        # Interruptions by root cause. In place: the node is healthy, the job
        # restarts on it. Node lost: the node (a GPU, its host) is taken out
        # and a replacement restores what it held.
        "in_place": {"software bug": 54, "dependency": 2, "NCCL watchdog timeout": 7,
                     "network switch or cable": 35},
        "node_lost": {"faulty GPU": 148, "GPU HBM3 memory": 72, "GPU SRAM memory": 19,
                      "GPU system processor": 17, "silent data corruption": 6,
                      "GPU thermal interface or sensor": 6, "host maintenance (unplanned)": 32,
                      "NIC": 7, "SSD": 3, "power supply": 3, "server chassis": 2,
                      "IO expansion board": 2, "CPU": 2, "system memory": 2},
    },
    "job": {
        "step_s": 10.0,                     # assumed
        "state_bytes_per_gpu": 346e6,       # assumed: 405e9 params x 14 B / 16,384 GPUs
        "gpus_per_node": 8,                 # assumed
        "restart_in_place_s": 120.0,        # assumed: detection, process start, NCCL init
        "restart_node_s": 300.0,            # assumed: the same plus a spare node
    },
    "measured": {
        # docs/dcp-comparison.md, full fine-tune of 126.23 MB: blocked per save.
        "state_bytes": 126.23e6,
        "ckptd_blocked_s": 0.0072,
        "dcp_async_blocked_s": 0.100,
        # docs/remote.md: memory-tier restore 1.64 GB/s, pull from radosgw
        # 256 MiB in 0.68 s, upload 215 MiB/s (one node, loopback).
        "memory_restore_gbps": 1.64,
        "object_pull_gbps": 0.39,
        "object_upload_gbps": 0.225,
        # docs/peer.md, "Figures": one 256 MiB step replicated to one peer
        # node at 0.668 GB/s (its ckpt_peer_upload_seconds; both nodes on this
        # VM's two cores and one virtual disk); a replacement node's register
        # + pull + restore of that step in 0.99 s from the peer against 1.12 s
        # from radosgw, in the same run. The peer's pull is taken as the
        # object store's pull rate times that ratio.
        "peer_replication_gbps": 0.668,
        "recovery_from_peer_s": 0.99,
        "recovery_from_object_store_s": 1.12,
        # The same page: the trainer's mean StepDone 2.30 ms with replication
        # against 0.73 ms without (trainer and both ckptd on two cores),
        # counted as blocked per save, not scaled: StepDone only queues the
        # step.
        "peer_stepdone_extra_s": 0.00157,
    },
    "cluster": {
        "local_disk_write_gbps": 2.0,       # assumed: one NVMe per node
        "storage_write_gbps": 2.0,          # assumed: shared file system, per node
        "storage_read_gbps": 4.0,           # assumed: shared file system, per node
    },
    "systems": {
        "dcp_every_steps": [100],
        "ckptd_every_steps": [10, 1],
    },
}


# Replaced whole by a scenario, not key by key: a record's causes.
WHOLE = ("in_place", "node_lost")


def merge(base, over):
    """`base` with the keys of `over` replaced, recursively (WHOLE ones as
    they are)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        nested = isinstance(v, dict) and isinstance(out.get(k), dict) and k not in WHOLE
        out[k] = merge(out[k], v) if nested else copy.deepcopy(v)
    return out


def failure_rates(s, gpus):
    """Failures per second of the job, in place and node lost, at `gpus`."""
    r = s["record"]
    seconds = r["days"] * 86400.0
    scale = gpus / r["gpus"]
    return {"in_place": sum(r["in_place"].values()) / seconds * scale,
            "node_lost": sum(r["node_lost"].values()) / seconds * scale}


def trailing(local, transfer, every):
    """How long the copy a transfer makes trails the trainer: the local
    commit, then one transfer when it keeps up with the saves; else the
    newest save is sent once the previous one is done, so the copy trails
    by one and a half transfers on average."""
    return local + (transfer if transfer <= every else 1.5 * transfer)


def peer_pull_gbps(m):
    """A replacement node's pull from a peer: the object store's pull rate
    times the ratio of the two recoveries measured in one run. Both times
    include the same register and restore from the local copy, so the ratio
    of the pulls alone is larger than this one."""
    return m["object_pull_gbps"] * m["recovery_from_object_store_s"] / m["recovery_from_peer_s"]


def systems(s):
    """Per system: stall per save, save interval, and per failure kind the
    (restore seconds, lag seconds) of the copy it restores from."""
    j, m, c, p = s["job"], s["measured"], s["cluster"], s["systems"]
    node_gb = j["state_bytes_per_gpu"] * j["gpus_per_node"] / 1e9
    scale = j["state_bytes_per_gpu"] / m["state_bytes"]
    out = {}
    for n in p["dcp_every_steps"]:
        every = n * j["step_s"]
        lag = trailing(0.0, node_gb / c["storage_write_gbps"], every)
        restore = node_gb / c["storage_read_gbps"]
        out["DCP async_save every %d steps, shared storage" % n] = {
            "stall_s": m["dcp_async_blocked_s"] * scale, "interval_s": every,
            "in_place": (restore, lag), "node_lost": (restore, lag)}
    for n in p["ckptd_every_steps"]:
        every = n * j["step_s"]
        local = node_gb / c["local_disk_write_gbps"]
        memory = node_gb / m["memory_restore_gbps"]
        common = {"stall_s": m["ckptd_blocked_s"] * scale, "interval_s": every,
                  "in_place": (memory, local)}
        out["ckptd every %d steps, memory + disk + object store" % n] = dict(
            common, node_lost=(node_gb / m["object_pull_gbps"],
                               trailing(local, node_gb / m["object_upload_gbps"], every)))
        out["ckptd every %d steps, with a peer replica" % n] = dict(
            common, stall_s=common["stall_s"] + m["peer_stepdone_extra_s"],
            node_lost=(node_gb / peer_pull_gbps(m),
                       trailing(local, node_gb / m["peer_replication_gbps"], every)))
    return out


def ettr(s, gpus):
    """{system: figures} at `gpus`."""
    rates = failure_rates(s, gpus)
    restart = {"in_place": s["job"]["restart_in_place_s"],
               "node_lost": s["job"]["restart_node_s"]}
    out = {}
    for name, sys_ in systems(s).items():
        steady = sys_["stall_s"] / sys_["interval_s"]
        lost_share, costs = 0.0, {}
        for kind, rate in rates.items():
            restore, lag = sys_[kind]
            lost_work = sys_["interval_s"] / 2 + lag
            cost = restart[kind] + restore + lost_work
            costs[kind] = {"restart_s": restart[kind], "restore_s": restore,
                           "lost_work_s": lost_work, "cost_s": cost}
            lost_share += rate * cost
        out[name] = {"ettr": (1 - steady) * (1 - lost_share), "steady_overhead": steady,
                     "failure_share": lost_share, "failures": costs,
                     "failures_per_day": sum(rates.values()) * 86400}
    return out


def report(s, sizes):
    lines = ["record: " + s["record"]["what"]]
    for gpus in sizes:
        res = ettr(s, gpus)
        any_ = next(iter(res.values()))
        lines.append("")
        lines.append("%d GPUs: %.1f failures a day" % (gpus, any_["failures_per_day"]))
        lines.append("| system | ETTR | steady overhead | failure cost share | cost per in-place "
                     "failure | cost per node lost |")
        lines.append("|---|---|---|---|---|---|")
        for name, r in res.items():
            f = r["failures"]
            lines.append("| %s | %.4f | %.4f | %.4f | %.0f s (lost work %.0f s) | %.0f s "
                         "(restore %.1f s, lost work %.0f s) |" % (
                             name, r["ettr"], r["steady_overhead"], r["failure_share"],
                             f["in_place"]["cost_s"], f["in_place"]["lost_work_s"],
                             f["node_lost"]["cost_s"], f["node_lost"]["restore_s"],
                             f["node_lost"]["lost_work_s"]))
        base = res[next(iter(res))]["ettr"]
        for name, r in list(res.items())[1:]:
            lines.append("- %s: %.2f points of ETTR over the first row (%.4f vs %.4f)"
                         % (name, 100 * (r["ettr"] - base), r["ettr"], base))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, action="append", help="job size (repeatable)")
    ap.add_argument("--scenario", help="JSON file whose keys replace the default inputs")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--dump-scenario", action="store_true", help="print the inputs and exit")
    a = ap.parse_args(argv)
    s = DEFAULT
    if a.scenario:
        with open(a.scenario) as f:
            s = merge(DEFAULT, json.load(f))
    if a.dump_scenario:
        print(json.dumps(s, indent=2))
        return 0
    sizes = a.gpus or [1024, 16384]
    for g in sizes:
        if g <= 0:
            ap.error("--gpus must be positive")
    if a.json:
        print(json.dumps({str(g): ettr(s, g) for g in sizes}, indent=2))
    else:
        print(report(s, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
