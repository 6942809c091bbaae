#!/usr/bin/env python3
"""What ckptd's many-rank design costs at scale, from per-node figures.

A model, not a measurement: it takes the figures measured on one node (the
defaults below, each with the command that produced it) and the shape of a
job, and prints, per step and per node, the agreement traffic, the bytes
ckptd writes under policy `all` and under LayerCheck with the data-parallel
spreading, the time the disk needs for them, and the recovery time after a
node is lost. The last section of docs/scaling.md shows its output for a
1,024-GPU job.

    tools/scale_model.py [--nodes 128] [--ranks-per-node 8] [--params 6.7e9] ...
"""

import argparse
import math

# Measured figures (docs/throughput.md, docs/fidelity.md, docs/pytorch.md).
WRITE_GBPS = 1.36       # ckptd's write path, ckpt_bench 2 GiB in 64 MiB layers, one NVMe-less VM disk
LAYERCHECK_FACTOR = 7.7  # bytes, LayerCheck K0=1e-3 vs `all` (tests/fidelity, 200 steps)
EXCHANGE_2_RANKS_S = 0.0028  # drift all-reduce round trip, 2 ranks, gloo (python.torch_multirank)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--params", type=float, default=6.7e9, help="model parameters")
    p.add_argument("--bytes-per-param", type=float, default=12.0,
                   help="bytes ckptd keeps per parameter: fp32 weights and AdamW's two moments")
    p.add_argument("--layers", type=int, default=35, help="ckptd layers (32 blocks + 3)")
    p.add_argument("--layout", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--write-gbps", type=float, default=WRITE_GBPS,
                   help="per-node write bandwidth of ckptd (GB/s); also used for reads")
    p.add_argument("--layercheck-factor", type=float, default=LAYERCHECK_FACTOR)
    p.add_argument("--exchange-2-ranks-s", type=float, default=EXCHANGE_2_RANKS_S)
    p.add_argument("--agree-every", type=int, default=10)
    p.add_argument("--nic-gbps", type=float, default=25.0,
                   help="per-node network bandwidth for the restore broadcast (GB/s; an "
                        "assumption: 200 Gb/s)")
    p.add_argument("--step-s", type=float, default=1.0, help="training step time (s)")
    a = p.parse_args()

    ranks = a.nodes * a.ranks_per_node
    replica = a.params * a.bytes_per_param
    rounds = math.ceil(math.log2(ranks))
    rows = []

    # Agreement traffic per rank and step. LayerCheck's drift vector (2
    # doubles per layer) is all-reduced only when ranks share layers (FSDP2);
    # DDP writers decide alone. The durable-step MIN is 8 bytes every k steps.
    drift_vec = 16 * a.layers if a.layout == "fsdp2" else 0
    ring = 2 * (ranks - 1) / ranks
    per_rank = ring * drift_vec + ring * 8 / a.agree_every
    rows.append(("agreement bytes sent per rank per step",
                 "%.0f B (drift %d B vector, ring all-reduce; durable step 8 B every %d steps)"
                 % (per_rank, drift_vec, a.agree_every)))
    rows.append(("agreement bytes per node per step", "%.1f KB" % (per_rank * a.ranks_per_node / 1e3)))
    latency = a.exchange_2_ranks_s * rounds
    rows.append(("agreement latency per exchange (recursive doubling, %d rounds)" % rounds,
                 "%.1f ms, off the critical path (beside the next forward/backward)"
                 % (latency * 1e3)))

    # Bytes written per node per step: one replica spread over every rank
    # (DDP: each layer by one rank; FSDP2: each rank its shards).
    per_node_all = replica / a.nodes
    per_node_lc = per_node_all / a.layercheck_factor
    unspread = replica * a.ranks_per_node
    rows.append(("one replica", "%.1f GB" % (replica / 1e9)))
    rows.append(("written per node per step, `all`, spread", "%.2f GB (%.2f s of disk at %.2f GB/s)"
                 % (per_node_all / 1e9, per_node_all / 1e9 / a.write_gbps, a.write_gbps)))
    rows.append(("written per node per step, LayerCheck, spread", "%.3f GB (%.3f s of disk)"
                 % (per_node_lc / 1e9, per_node_lc / 1e9 / a.write_gbps)))
    if a.layout == "ddp":
        rows.append(("written per node per step, `all`, every replica writing everything",
                     "%.0f GB (%.0f s of disk): why DDP spreads" % (unspread / 1e9,
                                                                    unspread / 1e9 / a.write_gbps)))
    keeps_up_all = per_node_all / 1e9 / a.write_gbps <= a.step_s
    rows.append(("the disk keeps up with a %.1f s step" % a.step_s,
                 "`all`: %s; LayerCheck: %s" % ("yes" if keeps_up_all else "no (steps wait at "
                                               "the fence or are skipped)",
                                               "yes" if per_node_lc / 1e9 / a.write_gbps <= a.step_s
                                               else "no")))

    # Recovery after losing a node: its replacement has no local data. With
    # DDP every layer is also on its writer's node only, so a lost node's
    # layers come from the remote tier (not modelled) or, with spreading
    # alone, are lost: the model reports the restore of the surviving
    # nodes, read locally then broadcast.
    read_s = per_node_all / 1e9 / a.write_gbps
    bcast_s = replica / 1e9 / a.nic_gbps if a.layout == "ddp" else 0.0
    rows.append(("restore: each node reads its share", "%.2f s" % read_s))
    if a.layout == "ddp":
        rows.append(("restore: every node receives the replica (pipelined broadcast at %.0f GB/s)"
                     % a.nic_gbps, "%.1f s" % bcast_s))
    rows.append(("restore: agreed step (one MIN all-reduce)", "%.1f ms" % (latency * 1e3)))
    rows.append(("restore total, surviving nodes", "%.1f s" % (read_s + bcast_s + latency)))

    print("| %d nodes x %d ranks, %s, %.1fB parameters, %d layers | |"
          % (a.nodes, a.ranks_per_node, a.layout.upper(), a.params / 1e9, a.layers))
    print("| --- | --- |")
    for k, v in rows:
        print("| %s | %s |" % (k, v))


if __name__ == "__main__":
    main()
