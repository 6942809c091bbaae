"""ckpt.dcp against a real ckptd, on the CPU: DCP's save, async_save and
load with only storage_writer=/storage_reader= changed.
- round trip: a state dict of every kind FileSystemWriter accepts (nested
  dicts and lists, model and AdamW state, bf16/f16/int8/bool/complex, a
  0-dim, an empty and a transposed tensor, Python objects, bytes items of
  300 KB and 3 MiB, the latter beyond what a step's aux holds) loads back
  exactly as through FileSystemWriter/FileSystemReader;
- async_save: the trainer changes its tensors as soon as async_save
  returns (with async_staging, once its staging completes); the checkpoint
  holds the values at the call;
- LoRA: a frozen base is written once; later saves write the adapters
  (bytes on ckptd's disk per save, against FileSystemWriter's, printed);
- a damaged version is loaded from the intact copy in ckptd's memory tier;
  with none (ckptd restarted), it fails the load, naming the tensor, and is
  not served;
- a refused CUDA handover (ckpt.dcp hands CUDA tensors to ckptd where they
  are; tests/gpu/dcp_gpu_check.py checks that on a GPU) is said once and
  the tensors are copied into host slots instead, exactly;
- a tensor larger than ckptd's staging pool is refused naming the setting;
- 4 ranks (gloo, DTensors sharded on dim 0 and replicated, per-rank
  bytes) save with dcp.save, async_save and async_save's PROCESS
  executor; 2 ranks and 8 ranks load the last exactly (DCP reshards);
- across nodes: 4 ranks save through two ckptd sharing a remote tier; a
  fresh node and the first node load the checkpoint exactly, pulling the
  rank jobs they lack; without a tier the load is refused naming the job;
  the same through a peer tier (a third ckptd keeping replicas, mutual TLS
  on loopback): a fresh node whose only tier is that peer loads exactly;
- a trainer killed (SIGKILL) during an async_save: the earlier checkpoint
  is the newest one, intact;
- async_save's PROCESS executor: DCP's process gets meta tensors and a
  writer that asks the trainer's (a process without its token is turned
  away); the checkpoints hold the values at the call and load exactly.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch is missing.
"""

import argparse
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from ckpt.dcp import CkptReader, CkptWriter  # noqa: E402


def odd_state(seed):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 16, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "f16": torch.randn(11, generator=g).to(torch.float16),
            "i8": torch.randint(-100, 100, (13,), generator=g).to(torch.int8),
            "mask": torch.rand(9, generator=g) > 0.5,
            "cplx": torch.randn(4, 2, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(3.25 + seed),
            "empty": torch.zeros(0, 5),
            "transposed": torch.randn(6, 10, generator=g).t(),
            "negzero": torch.tensor([-0.0, 0.0, float("nan")]),
            "list": [torch.arange(5) + seed, {"deep": torch.ones(2, 2) * seed}],
        },
        "meta": {"step": seed, "name": "run-%d" % seed, "blob": os.urandom(300_000),
                 "big": os.urandom(3 << 20)},
    }


def template_of(sd):
    """A state dict of the same structure with other values (where load writes)."""
    if isinstance(sd, dict):
        return {k: template_of(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [template_of(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd.contiguous(), 7) if sd.dtype != torch.bool else \
            torch.zeros_like(sd)
    return None


def same(a, b, path="sd"):
    """The first path where `a` and `b` differ (bitwise for tensors), or None."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            d = same(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{path}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{path}: lengths"
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {getattr(b, 'dtype', type(b))} {getattr(b, 'shape', '')}"
        ab = a.contiguous().reshape(-1).view(torch.uint8)
        bb = b.contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(ab, bb) else f"{path}: bytes differ"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def round_trip(daemon, root):
    sd = odd_state(1)
    fs_dir = os.path.join(root, "fs-rt")
    dcp.save(sd, checkpoint_id=fs_dir)
    writer = CkptWriter("dcp-rt", socket_path=daemon.socket)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=writer)
    sd2 = odd_state(2)
    dcp.save(sd2, checkpoint_id="step-2", storage_writer=writer)

    via_fs = template_of(sd)
    via_fs["meta"] = {"step": None, "name": None, "blob": None, "big": None}
    dcp.load(via_fs, checkpoint_id=fs_dir)
    check(same(sd, via_fs) is None, "FileSystemReader round trip: %s" % same(sd, via_fs))
    for cid, want in (("step-1", sd), ("step-2", sd2), (None, sd2)):
        got = template_of(want)
        got["meta"] = {"step": None, "name": None, "blob": None, "big": None}
        dcp.load(got, checkpoint_id=cid, storage_reader=CkptReader("dcp-rt", daemon.socket))
        check(same(want, got) is None, "ckptd round trip of %s: %s" % (cid, same(want, got)))
        check(same(via_fs if cid == "step-1" else want, got) is None,
              "ckptd and FileSystemReader load the same")
    try:
        dcp.save(sd, storage_writer=writer)
        err = ""
    except (Exception, CheckpointException) as e:
        err = str(e)
    check("needs a checkpoint_id" in err, "a save without a checkpoint id is refused: %s"
          % err[-200:])
    try:
        dcp.load(template_of(sd), checkpoint_id="step-9",
                 storage_reader=CkptReader("dcp-rt", daemon.socket))
        err = ""
    except (Exception, CheckpointException) as e:  # DCP wraps a rank's error
        err = str(e)
    check("no checkpoint 'step-9'" in err, "an unknown checkpoint id is named: %s" % err[:300])
    jobs = os.listdir(os.path.join(daemon.data, "jobs"))
    check(any(j.startswith("dcp-rt.bytes.r0.") for j in jobs),
          "the 3 MiB bytes item went to the rank's bytes job: %s" % sorted(jobs))
    writer.close()
    print("round trip: %d tensors of 8 dtypes, bytes items of 300 KB and 3 MiB: exact, as "
          "FileSystemReader"
          % sum(1 for _ in _tensors(sd)))


def _tensors(sd):
    if isinstance(sd, dict):
        for v in sd.values():
            yield from _tensors(v)
    elif isinstance(sd, list):
        for v in sd:
            yield from _tensors(v)
    elif isinstance(sd, torch.Tensor):
        yield sd


def async_contract(daemon):
    torch.manual_seed(3)
    model = nn.Linear(64, 64)
    writer = CkptWriter("dcp-async", socket_path=daemon.socket)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fut = dcp.async_save({"model": model.state_dict()}, checkpoint_id="step-5",
                         storage_writer=writer)
    with torch.no_grad():  # the trainer goes on at once
        for p in model.parameters():
            p.add_(1.0)
    fut.result(timeout=120)
    got = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(got, storage_reader=CkptReader("dcp-async", daemon.socket))
    check(same({"model": want}, got) is None,
          "async_save holds the values at the call: %s" % same({"model": want}, got))
    # Staged on the writer's thread: the trainer waits for the staging,
    # then changes its tensors while the upload runs.
    staged_writer = CkptWriter("dcp-async-staging", socket_path=daemon.socket,
                               async_staging=True)
    want2 = {k: v.clone() for k, v in model.state_dict().items()}
    resp = dcp.async_save({"model": model.state_dict()}, checkpoint_id="step-1",
                          storage_writer=staged_writer)
    resp.staging_completion.result(timeout=120)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    resp.upload_completion.result(timeout=120)
    got = {"model": {k: torch.zeros_like(v) for k, v in want2.items()}}
    dcp.load(got, storage_reader=CkptReader("dcp-async-staging", daemon.socket))
    check(same({"model": want2}, got) is None, "async staging holds the values at the call")
    staged_writer.close()
    # Nothing changed since: the save writes no tensor and still loads.
    now = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.async_save({"model": model.state_dict()}, checkpoint_id="step-6",
                   storage_writer=writer).result(timeout=120)
    dcp.save({"model": model.state_dict()}, checkpoint_id="step-7", storage_writer=writer)
    for cid in ("step-6", "step-7"):
        got = {"model": {k: torch.zeros_like(v) for k, v in now.items()}}
        dcp.load(got, checkpoint_id=cid, storage_reader=CkptReader("dcp-async", daemon.socket))
        check(same({"model": now}, got) is None, "an unchanged save %s loads" % cid)
    writer.close()


def handover_refused(daemon):
    """A writer whose CUDA handover is refused (here: the tensors it offers
    ckptd's GPU path are host memory, which the client refuses as the real
    call does for memory that cannot be exported) says so once, copies them
    into host slots instead, and its checkpoints load exactly."""
    import logging
    torch.manual_seed(4)
    model = nn.Linear(32, 32)
    writer = CkptWriter("dcp-refused", socket_path=daemon.socket)
    offered = []

    def in_place(tensors):  # every tensor offered as if it were on a GPU
        if not writer._gpu_in_place:
            return {}
        offered.append(sorted(tensors))
        return dict(tensors)

    writer._in_place = in_place
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("ckpt.dcp").addHandler(handler)
    try:
        want = {k: v.clone() for k, v in model.state_dict().items()}
        dcp.save({"model": model.state_dict()}, checkpoint_id="step-1", storage_writer=writer)
        with torch.no_grad():
            model.weight.add_(1.0)
        want2 = {k: v.clone() for k, v in model.state_dict().items()}
        resp = dcp.async_save({"model": model.state_dict()}, checkpoint_id="step-2",
                              storage_writer=writer)
        resp.result(timeout=120)
    finally:
        logging.getLogger("ckpt.dcp").removeHandler(handler)
    # The client's refusal: "not in CUDA device memory", or without CUDA
    # "built without CUDA".
    warned = [m for m in logs if "copied into host memory" in m]
    check(len(warned) == 1 and "dcp-refused.g0." in warned[0],
          "a refused handover is said once, with what happens instead: %s %s" % (logs, offered))
    check(len(offered) == 1, "the handover is not tried again after a refusal: %s" % offered)
    for cid, w in (("step-1", want), ("step-2", want2)):
        got = {"model": {k: torch.zeros_like(v) for k, v in w.items()}}
        dcp.load(got, checkpoint_id=cid, storage_reader=CkptReader("dcp-refused", daemon.socket))
        check(same({"model": w}, got) is None, "after a refused handover %s loads exactly" % cid)
    jobs = os.listdir(os.path.join(daemon.data, "jobs"))
    check(not any(j.startswith("dcp-refused.g0.") for j in jobs),
          "no GPU job was left registered: %s" % sorted(jobs))
    writer.close()
    print("a refused CUDA handover: said once, tensors copied, checkpoints exact")


def rank_job_dir(daemon, job):
    jobs = os.path.join(daemon.data, "jobs")
    names = [n for n in os.listdir(jobs) if n.startswith(job + ".r0.")]
    check(len(names) == 1, "one rank job for %s: %s" % (job, names))
    return os.path.join(jobs, names[0])


def lora_bytes(daemon, root):
    torch.manual_seed(4)
    base = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    for p in base.parameters():
        p.requires_grad_(False)
    adapters = nn.ModuleList([nn.Sequential(nn.Linear(256, 4, bias=False),
                                            nn.Linear(4, 256, bias=False)) for _ in range(8)])
    opt = torch.optim.AdamW(adapters.parameters(), lr=1e-2)
    writer = CkptWriter("dcp-lora", socket_path=daemon.socket)
    grown, fs_sizes, prev = [], [], 0
    for save in range(3):
        x = torch.randn(4, 256)
        for lin, ad in zip(base, adapters):
            x = lin(x) + ad(x)
        x.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sd = {"base": base.state_dict(), "adapters": adapters.state_dict(),
              "optim": opt.state_dict()}
        dcp.save(sd, checkpoint_id="step-%d" % save, storage_writer=writer)
        now = harness.dir_bytes(rank_job_dir(daemon, "dcp-lora"))
        grown.append(now - prev)
        prev = now
        fs = os.path.join(root, "fs-lora-%d" % save)
        dcp.save(sd, checkpoint_id=fs)
        fs_sizes.append(harness.dir_bytes(fs))
    base_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    trained = sum(t.numel() * t.element_size() for t in _tensors(
        {"a": adapters.state_dict(), "o": opt.state_dict()["state"]}))
    check(grown[0] >= base_bytes, "the first save writes the base")
    for g in grown[1:]:
        # Each small tensor's file is at least 8 KiB (a header and a payload,
        # each 4 KiB aligned): the bytes on disk are the adapters' files.
        check(g < base_bytes // 2,
              "a later save writes the adapters, not the base: %d bytes (base %d, adapters and "
              "their state %d)" % (g, base_bytes, trained))
    reader = CkptReader("dcp-lora", daemon.socket)
    reader.reset("step-2")
    stored = reader.read_metadata().storage_data
    base_versions = {s.version for i, s in stored.items() if i.fqn.startswith("base.")}
    new_versions = {s.version for i, s in stored.items() if i.fqn.startswith("adapters.")}
    check(len(base_versions) == 1 and len(new_versions) == 1 and
          max(base_versions) < min(new_versions), "the third save names the first save's base versions "
          "(%s) and new adapters (%s)" % (base_versions, new_versions))
    got = {"base": {k: torch.zeros_like(v) for k, v in base.state_dict().items()},
           "adapters": {k: torch.zeros_like(v) for k, v in adapters.state_dict().items()}}
    dcp.load(got, storage_reader=CkptReader("dcp-lora", daemon.socket))
    check(same({"base": base.state_dict(), "adapters": adapters.state_dict()}, got) is None,
          "the newest LoRA checkpoint loads its old base and new adapters")
    writer.close()
    print("LoRA (base %.2f MiB frozen, adapters+AdamW %.1f KiB): bytes per save on ckptd's disk "
          "%s; FileSystemWriter %s" % (base_bytes / 2**20, trained / 1024, grown, fs_sizes))
    return grown, fs_sizes


def damage_largest(daemon, job):
    """Flips a byte in the middle of the payload of the largest version file
    of `job`'s rank job; returns the file's name."""
    rd = os.path.join(rank_job_dir(daemon, job), "rank-00000000")
    files = sorted(os.path.join(rd, n) for n in os.listdir(rd) if n.endswith(".ckv"))
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    return os.path.basename(path)


def damaged_with_remote(root):
    """With a remote tier and no memory tier, a version damaged on disk is
    loaded from the remote tier's copy of it."""
    remote = os.path.join(root, "remote")
    os.makedirs(remote)
    node = harness.Daemon(os.path.join(root, "node-remote"), extra=[
        "--memory_tier_bytes=0", "--remote_kind=posix", "--remote_path=" + remote,
        "--remote_key_file=" + harness.remote_key(root)]).start()
    try:
        torch.manual_seed(6)
        sd = {"w": torch.randn(512, 64), "v": torch.randn(100)}
        writer = CkptWriter("dcp-rot", socket_path=node.socket)
        dcp.save(sd, checkpoint_id="step-1", storage_writer=writer)
        writer.wait_durable("remote")
        writer.close()
        name = damage_largest(node, "dcp-rot")
        got = {"w": torch.zeros(512, 64), "v": torch.zeros(100)}
        dcp.load(got, storage_reader=CkptReader("dcp-rot", node.socket))
        check(same(sd, got) is None, "a version damaged on disk is loaded from the remote "
              "tier's copy: %s" % same(sd, got))
        quarantined = os.path.join(node.data, "quarantine")
        held = [n for _, _, names in os.walk(quarantined) for n in names]
        check(name in held, "the damaged file is kept in quarantine/: %s" % held)
    finally:
        node.stop()


def damaged(daemon):
    torch.manual_seed(5)
    sd = {"w": torch.randn(512, 64), "v": torch.randn(100)}
    writer = CkptWriter("dcp-bad", socket_path=daemon.socket)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=writer)
    writer.close()
    damage_largest(daemon, "dcp-bad")
    # ckptd's memory tier holds an intact copy of that version: it is
    # served, and the damaged file is not read.
    got = {"w": torch.zeros(512, 64), "v": torch.zeros(100)}
    dcp.load(got, storage_reader=CkptReader("dcp-bad", daemon.socket))
    check(same(sd, got) is None, "the intact copy in memory is loaded: %s" % same(sd, got))
    # Without it (ckptd restarted), the damaged version is refused.
    daemon.stop()
    daemon.start()
    got = {"w": torch.zeros(512, 64), "v": torch.zeros(100)}
    try:
        dcp.load(got, storage_reader=CkptReader("dcp-bad", daemon.socket))
        err = ""
    except (Exception, CheckpointException) as e:  # a BaseException
        err = str(e)
    check("'w'" in err and "not loaded" in err, "a damaged version fails the load naming "
          "the tensor: %s" % err[:400])
    check(not got["w"].any(), "the damaged tensor was not served: its destination holds zeros")
    # The version is marked lost: a second load is refused as well, and
    # says so, instead of loading whatever else the history holds.
    try:
        dcp.load(got, storage_reader=CkptReader("dcp-bad", daemon.socket))
        err = ""
    except (Exception, CheckpointException) as e:  # a BaseException
        err = str(e)
    check("lost its version of step" in err, "a load after the loss is refused: %s" % err[:400])


def two_writers(daemon):
    """Two writers of one job in one process (one per save, or one per
    executor): closing the one whose registration the other replaced
    raised UNAVAILABLE "not registered"."""
    sd = {"w": torch.arange(4.0)}
    first = CkptWriter("dcp-two", socket_path=daemon.socket)
    dcp.save(sd, checkpoint_id="a-1", storage_writer=first)
    second = CkptWriter("dcp-two", socket_path=daemon.socket)
    sd["w"] += 1
    dcp.save(sd, checkpoint_id="b-1", storage_writer=second)
    second.close()
    first.close()
    got = {"w": torch.zeros(4)}
    dcp.load(got, storage_reader=CkptReader("dcp-two", daemon.socket))
    check(torch.equal(got["w"], sd["w"]), "two writers of a job close in any order; the newest "
          "save loads")


def newest_moves(daemon):
    """Ranks read the metadata one by one: a save landing between two
    ranks' reads is caught before any rank loads."""
    from torch.distributed.checkpoint.planner import LoadPlan
    sd = {"w": torch.arange(10.0)}
    writer = CkptWriter("dcp-move", socket_path=daemon.socket)
    dcp.save(sd, checkpoint_id="step-1", storage_writer=writer)
    first = CkptReader("dcp-move", daemon.socket)
    first.read_metadata()
    dcp.save(sd, checkpoint_id="step-2", storage_writer=writer)
    writer.close()
    second = CkptReader("dcp-move", daemon.socket)
    second.read_metadata()
    plans = [r.prepare_local_plan(LoadPlan([])) for r in (first, second)]
    try:
        first.prepare_global_plan(plans)
        err = ""
    except RuntimeError as e:
        err = str(e)
    check("rank 0: 'step-1'" in err and "rank 1: 'step-2'" in err and "checkpoint_id=" in err,
          "ranks that found different newest checkpoints are refused: %s" % err)
    plans = [second.prepare_local_plan(LoadPlan([]))] * 2
    check(all(p.storage_data is None for p in second.prepare_global_plan(plans)),
          "ranks that agree get their plans back")


def too_big(root):
    """A tensor larger than ckptd's staging pool: refused at the save,
    naming the setting to raise; nothing is named a checkpoint."""
    small = harness.Daemon(os.path.join(root, "small"), pool_bytes=8 << 20).start()
    try:
        writer = CkptWriter("dcp-big", socket_path=small.socket)
        try:
            dcp.save({"w": torch.zeros(4 << 20)}, checkpoint_id="s1", storage_writer=writer)
            err = ""
        except (Exception, CheckpointException) as e:
            err = str(e)
        check("staging_pool_bytes" in err and "'w'" in err,
              "a tensor beyond the staging pool is refused naming the setting: %s" % err[-300:])
        try:
            CkptReader("dcp-big", small.socket).reset("s1")
            found = True
        except FileNotFoundError:
            found = False
        check(not found, "the refused save is not a checkpoint")
    finally:
        small.stop()


# ---- several ranks ----

GLOBAL_ROWS = 48


def global_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GLOBAL_ROWS, 8, generator=g), torch.randn(5, generator=g)


def worker(a):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (a.world,))
    rows, rep = global_tensors(11)
    if a.mode in ("save-remote", "save-peer"):
        # Each rank saves through its own node's ckptd and waits until the
        # save (and, on the coordinator, its catalog entry) is in the
        # remote or peer tier.
        sd = {"rows": distribute_tensor(rows, mesh, [Shard(0)]),
              "rep": distribute_tensor(rep, mesh, [Replicate()])}
        writer = CkptWriter("dcp-nodes", socket_path=a.socket)
        dcp.save(sd, checkpoint_id="step-1", storage_writer=writer)
        writer.wait_durable(a.mode.split("-")[1])
        writer.close()
    elif a.mode == "save":
        sd = {"rows": distribute_tensor(rows, mesh, [Shard(0)]),
              "rep": distribute_tensor(rep, mesh, [Replicate()]),
              "own": {"r%d" % a.rank: torch.full((3,), float(a.rank))},
              "note": "rank-%d" % a.rank}
        writer = CkptWriter("dcp-ranks", socket_path=a.socket)
        dcp.save(sd, checkpoint_id="step-100", storage_writer=writer)
        # The same again through async_save: staged whole, while DCP's plan
        # leaves the replicated tensor to one rank; still one layout.
        dcp.async_save(sd, checkpoint_id="step-101", storage_writer=writer).result(timeout=300)
        if not a.kill_at_async:
            # And through the PROCESS executor: DTensor shards staged in this
            # process, DCP's process writing through this rank's writer.
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            pwriter = CkptWriter("dcp-ranks", socket_path=a.socket, process_executor=True)
            dcp.async_save(sd, checkpoint_id="step-102", storage_writer=pwriter,
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(
                               timeout=300)
            harness.stop_dcp_process()
            pwriter.close()
        if a.kill_at_async:
            # The next save is killed after staging, while ckptd may be writing.
            sd["rows"].to_local().add_(1)
            dcp.async_save(sd, checkpoint_id="step-200", storage_writer=writer)
            os.kill(os.getpid(), signal.SIGKILL)
        writer.close()
    else:
        sd = {"rows": distribute_tensor(torch.zeros_like(rows), mesh, [Shard(0)]),
              "rep": distribute_tensor(torch.zeros_like(rep), mesh, [Replicate()])}
        reader = CkptReader(a.job, a.socket)
        dcp.load(sd, storage_reader=reader)
        if reader.loaded_id == "step-200":  # the async save finished before the kill
            rows = rows + 1
        elif a.expect_id and reader.loaded_id != a.expect_id:
            print("rank %d loaded %s, not %s" % (a.rank, reader.loaded_id, a.expect_id),
                  flush=True)
            sys.exit(4)
        lo = GLOBAL_ROWS // a.world * a.rank
        mine = rows[lo:lo + GLOBAL_ROWS // a.world]
        ok = torch.equal(sd["rows"].to_local(), mine) and torch.equal(sd["rep"].to_local(), rep)
        if not ok:
            print("rank %d of %d loaded other values" % (a.rank, a.world), flush=True)
            sys.exit(3)
    dist.destroy_process_group()


def process_worker(a):
    """One rank (gloo) saving through async_save's PROCESS executor."""
    import pickle
    from multiprocessing.connection import AuthenticationError
    from multiprocessing.connection import Client as Dial

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=0, world_size=1)
    torch.manual_seed(7)
    model = nn.Linear(256, 128)
    writer = CkptWriter("dcp-proc", socket_path=a.socket, process_executor=True)
    staged = []
    stage = writer.stage
    writer.stage = lambda sd: staged.append(stage(sd)) or staged[-1]
    wants = []
    for cid in ("step-1", "step-2"):
        wants.append({k: v.clone() for k, v in model.state_dict().items()})
        sd = {"model": model.state_dict(), "extra": {"epoch": len(wants), "blob": b"x" * 1000}}
        fut = dcp.async_save(sd, checkpoint_id=cid, storage_writer=writer,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        with torch.no_grad():  # the trainer goes on at once
            for p in model.parameters():
                p.add_(1.0)
        fut.result(timeout=300)
    check(len(staged) == 2 and all(t.is_meta for sd in staged for t in _tensors(sd)),
          "DCP's process was handed meta tensors only")
    for n, (cid, want) in enumerate(zip(("step-1", "step-2"), wants), 1):
        got = {"model": {k: torch.zeros_like(v) for k, v in want.items()},
               "extra": {"epoch": None, "blob": None}}
        dcp.load(got, checkpoint_id=cid, storage_reader=CkptReader("dcp-proc", a.socket))
        diff = same({"model": want, "extra": {"epoch": n, "blob": b"x" * 1000}}, got)
        check(diff is None, "PROCESS executor: %s holds the values at the call: %s" % (cid, diff))
    child = pickle.loads(pickle.dumps(writer))
    check(type(child).__name__ == "ChildWriter" and len(child._token) == 32,
          "the writer pickles to a socket path and a token")
    try:
        Dial(child._address, family="AF_UNIX", authkey=b"\0" * 32).close()
        refused = False
    except AuthenticationError:
        refused = True
    check(refused, "a process without the token is turned away")
    try:
        pickle.dumps(CkptWriter("dcp-other", socket_path=a.socket))
        err = ""
    except TypeError as e:
        err = str(e)
    check("process_executor=True" in err, "a writer made for threads refuses to be pickled, "
          "saying what to do: %s" % err)
    harness.stop_dcp_process()
    writer.close()
    dist.destroy_process_group()


def process_executor(daemon, root):
    cmd = [sys.executable, __file__, "--worker", "process", "--store",
           os.path.join(root, "store-process"), "--socket", daemon.socket]
    code = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600).returncode
    check(code == 0, "the PROCESS executor worker passed: exit %s" % code)
    print("async_save's PROCESS executor: meta tensors to DCP's process, commits through "
          "the trainer's writer; 2 checkpoints exact")


def run_ranks(daemon, root, mode, world, kill_at_async=False, expect_id=None,
              job="dcp-ranks", log=None):
    """Runs `world` ranks of worker(); `daemon` is one ckptd for all of
    them, or a list of one per rank (the node each rank is on). With `log`,
    the ranks' output goes to that file."""
    # A fresh rendezvous file for each group: a FileStore file left by an
    # earlier group of the same size would be joined instead.
    store = tempfile.mktemp(prefix="store-%s-%d-" % (mode, world), dir=root)
    nodes = daemon if isinstance(daemon, list) else [daemon] * world
    procs = []
    for r in range(world):
        cmd = [sys.executable, __file__, "--worker", mode, "--rank", str(r), "--world",
               str(world), "--store", store, "--socket", nodes[r].socket, "--job", job]
        if kill_at_async:
            cmd.append("--kill-at-async")
        if expect_id:
            cmd += ["--expect-id", expect_id]
        out = open(log, "a") if log else None
        procs.append(subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                      stdout=out, stderr=out))
        if out:
            out.close()
    codes = [p.wait(timeout=300) for p in procs]
    return codes


def many_ranks(daemon, root):
    codes = run_ranks(daemon, root, "save", 4)
    check(codes == [0] * 4, "4 ranks saved: %s" % codes)
    jobs = os.listdir(os.path.join(daemon.data, "jobs"))
    for r in range(4):
        mine = [j for j in jobs if j.startswith("dcp-ranks.r%d." % r)]
        check(len(mine) == 1, "rank %d's save and async_save share one layout: %s" % (r, mine))
    for world in (2, 8):
        codes = run_ranks(daemon, root, "load", world, expect_id="step-102")
        check(codes == [0] * world, "a 4-rank checkpoint saved through the PROCESS executor "
              "loads exactly onto %d ranks: %s" % (world, codes))
    print("4 ranks saved (DTensor shards and a replica; plain, async and PROCESS executor); "
          "loaded exactly onto 2 and 8 ranks")


def across_nodes(root):
    """4 ranks on two nodes (two ckptd sharing a remote tier) save; 2 ranks
    on a third, fresh node load exactly: the catalog and every rank job the
    plan names come from the remote tier when this node's ckptd lacks them.
    The first node, which holds only its own ranks' jobs, refuses the load
    without a tier, naming the missing job and the remedy, and loads exactly
    with one."""
    remote = os.path.join(root, "remote-nodes")
    os.makedirs(remote)
    extra = ["--remote_kind=posix", "--remote_path=" + remote,
             "--remote_key_file=" + harness.remote_key(root)]
    nodes = [harness.Daemon(os.path.join(root, "dcp-node%d" % i), extra=extra) for i in range(3)]
    # Node 0's data directory again, without the remote tier.
    lone = harness.Daemon(os.path.join(root, "dcp-node0"))
    try:
        a, b, fresh = [n.start() for n in nodes]
        codes = run_ranks([a, a, b, b], root, "save-remote", 4, job="dcp-nodes")
        check(codes == [0] * 4, "4 ranks on two nodes saved: %s" % codes)
        codes = run_ranks(fresh, root, "load", 2, job="dcp-nodes", expect_id="step-1")
        check(codes == [0, 0], "2 ranks on a fresh node loaded the 4-rank checkpoint "
              "exactly from the remote tier: %s" % codes)
        pulled = [j for j in os.listdir(os.path.join(fresh.data, "jobs"))
                  if j.startswith("dcp-nodes")]
        check(len(pulled) == 5, "the fresh node holds the catalog and the 4 rank jobs: %s"
              % sorted(pulled))
        a.stop()
        lone.start()
        log = os.path.join(root, "dcp-lone.log")
        codes = run_ranks(lone, root, "load", 2, job="dcp-nodes", log=log)
        out = open(log).read()
        check(0 not in codes and "dcp-nodes.r2." in out and "does not exist" in out and
              "peer or remote tier" in out,
              "without a tier, a load on a node that lacks rank jobs fails naming the job "
              "and the remedy: %s" % codes)
        lone.stop()
        a.start()
        codes = run_ranks(a, root, "load", 2, job="dcp-nodes", expect_id="step-1")
        check(codes == [0, 0], "2 ranks on the first node loaded the other node's chunks "
              "from the remote tier: %s" % codes)
        print("a 4-rank checkpoint saved on two nodes loaded exactly on a third node and on "
              "the first through the remote tier; without a tier, refused naming the "
              "missing rank job")
    finally:
        for n in nodes + [lone]:
            n.stop()


def across_nodes_by_peer(root):
    """2 ranks save through node A's ckptd, whose peer tier keeps replicas
    in node B's ckptd (gRPC with mutual TLS, here on loopback); 2 ranks on
    node C, fresh, whose only tier is B, load exactly: the catalog and the
    rank jobs come from B's copies."""
    import socket
    import netns
    pki = netns.Pki(os.path.join(root, "peer-pki"))
    key = harness.remote_key(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def node(name, *extra):
        cert, tls_key = pki.issue(name, "127.0.0.1")
        return harness.Daemon(os.path.join(root, "dcp-" + name), extra=[
            "--peer_cert_file=" + cert, "--peer_tls_key_file=" + tls_key,
            "--peer_ca_file=" + pki.ca, "--remote_key_file=" + key,
            "--peer_timeout_ms=3000"] + list(extra))
    to_b = ["--peer_address=127.0.0.1:%d" % port, "--peer_name=node-b"]
    b = node("node-b", "--peer_listen=127.0.0.1:%d" % port, "--peer_allow=node-a,node-c",
             "--peer_memory_bytes=%d" % (64 << 20))
    a, c = node("node-a", *to_b), node("node-c", *to_b)
    try:
        for n in (b, a, c):
            n.start()
        codes = run_ranks(a, root, "save-peer", 2, job="dcp-nodes")
        check(codes == [0, 0], "2 ranks saved and waited for the peer tier: %s" % codes)
        codes = run_ranks(c, root, "load", 2, job="dcp-nodes", expect_id="step-1")
        check(codes == [0, 0], "2 ranks on a fresh node loaded the checkpoint exactly from "
              "the peer's replicas: %s" % codes)
        pulled = [j for j in os.listdir(os.path.join(c.data, "jobs")) if j.startswith("dcp-nodes")]
        check(len(pulled) == 3, "the fresh node holds the catalog and the 2 rank jobs: %s"
              % sorted(pulled))
        exported = {labels: v for (name, labels), v in
                    harness.scrape(c.ctl("status")["metrics_address"]).items()
                    if name == "ckpt_exported_bytes_total"}
        check(exported.get('path="window"', 0) > 0 and exported.get('path="stream"', 0) == 0,
              "the loads' bytes came through shared windows, none through the stream: %s"
              % exported)
        print("a 2-rank checkpoint saved on one node loaded exactly on a fresh node from a "
              "peer's replicas")
    finally:
        for n in (a, c, b):
            n.stop()


def killed_during_async(daemon, root):
    codes = run_ranks(daemon, root, "save", 2, kill_at_async=True)
    check(all(c == -signal.SIGKILL for c in codes), "both ranks were killed: %s" % codes)
    codes = run_ranks(daemon, root, "load", 2)
    check(codes == [0, 0], "after a kill during async_save the newest checkpoint is intact: %s"
          % codes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--store")
    p.add_argument("--socket")
    p.add_argument("--kill-at-async", action="store_true")
    p.add_argument("--expect-id")
    p.add_argument("--job", default="dcp-ranks")
    a = p.parse_args()
    if a.worker == "process":
        process_worker(a)
        return
    if a.worker:
        a.mode = a.worker
        worker(a)
        return
    root = harness.tempdir("ckpt-dcp-")
    daemon = harness.Daemon(root).start()
    try:
        round_trip(daemon, root)
        async_contract(daemon)
        handover_refused(daemon)
        lora_bytes(daemon, root)
        damaged(daemon)
        damaged_with_remote(root)
        two_writers(daemon)
        newest_moves(daemon)
        too_big(root)
        many_ranks(daemon, root)
        across_nodes(root)
        across_nodes_by_peer(root)
        killed_during_async(daemon, root)
        process_executor(daemon, root)
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
