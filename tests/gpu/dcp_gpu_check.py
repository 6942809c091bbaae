#!/usr/bin/env python3
"""ckpt.dcp with CUDA tensors: DCP's save, async_save (staged on the
writer's thread) and load through ckptd, on the device's state dict.

    PYTHONPATH=<bundle>/python python3 tests/gpu/dcp_gpu_check.py --build-dir <bundle> \
        [--device cuda|cpu]

A small MLP and its AdamW state on the device, one step taken:
- dcp.save, then dcp.load into zeroed tensors on the device: bit-exact;
- async_save with CkptWriter(async_staging=True): the trainer waits for
  staging_completion, then changes every parameter on the device while the
  upload runs; the load gives the values at the call, bit-exact;
- on a GPU, the CUDA tensors were handed to ckptd in place (its GPU
  job), not copied into host slots, and a save with nothing changed
  writes none of them (their digests on the device) and loads bit-exact;
- the staging time of its state dict (96 MiB) against a pinned
  device-to-host copy of the same bytes, printed (ckptd's own copy into
  its pinned pool is what a stage waits for).
Exit 0 when every check holds; `--device cpu` runs the same on the CPU
(ctest's dry run of this script).
"""

import argparse
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))


def flat_bytes(sd):
    import torch
    out = {}
    for k, v in sorted(sd.items()):
        if isinstance(v, dict):
            for kk, vv in flat_bytes(v).items():
                out["%s.%s" % (k, kk)] = vv
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()
    return out


def differs(a, b):
    import torch
    fa, fb = flat_bytes(a), flat_bytes(b)
    if fa.keys() != fb.keys():
        return "keys differ"
    bad = [k for k in fa if not torch.equal(fa[k], fb[k])]
    return ", ".join(bad[:3]) if bad else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--build-dir", default=os.environ.get("CKPT_BUILD_DIR", "build"))
    a = ap.parse_args()
    os.environ["CKPT_BUILD_DIR"] = os.path.abspath(a.build_dir)
    import harness
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from ckpt.dcp import CkptReader, CkptWriter
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device=dev)).pow(2).mean().backward()
    opt.step()
    root = harness.tempdir("ckpt-dcp-gpu-")
    d = harness.Daemon(root, pool_bytes=256 << 20).start()
    ok = True
    try:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        writer = CkptWriter("dcp-gpu", socket_path=d.socket, async_staging=True)
        dcp.save(sd, checkpoint_id="step-1", storage_writer=writer)
        got = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}
        dcp.load(got, checkpoint_id="step-1", storage_reader=CkptReader("dcp-gpu", d.socket))
        diff = differs({"model": msd}, got)
        print("dcp.save/load of %s tensors: %s" % (a.device, "bit-exact" if diff is None
                                                   else "DIFFERS: " + diff))
        ok &= diff is None
        # On a GPU the CUDA tensors go to ckptd where they are (a job
        # "<job>.g<rank>.<layout>" of the GPU handover), AdamW's step
        # counters (CPU tensors) into host slots.
        gstore = writer._gpu_store
        in_place = gstore is not None and gstore.job.startswith("dcp-gpu.g0.")
        print("CUDA tensors handed to ckptd in place: %s" % (
            ("yes, ckptd job %s" % gstore.job) if in_place else "no (host slots)"))
        if dev.type == "cuda":
            ok &= in_place and writer._gpu_in_place
        want = flat_bytes({"model": model.state_dict()})
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        resp = dcp.async_save(sd, checkpoint_id="step-2", storage_writer=writer)
        resp.staging_completion.result(timeout=120)
        staged_s = time.perf_counter() - t0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        resp.upload_completion.result(timeout=300)
        got = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}
        dcp.load(got, checkpoint_id="step-2", storage_reader=CkptReader("dcp-gpu", d.socket))
        fg = flat_bytes(got)
        diff = [k for k in want if not torch.equal(want[k], fg[k])]
        print("async_save with async staging, parameters changed after staging: %s"
              % ("the values at the call" if not diff else "DIFFERS: " + ", ".join(diff[:3])))
        ok &= not diff
        if in_place:
            # The parameters changed after step-2's staging: step-3 writes
            # them; step-4, with nothing changed, writes no CUDA tensor.
            dcp.save(sd, checkpoint_id="step-3", storage_writer=writer)
            before = {k: v[1] for k, v in gstore._durable.items()}
            dcp.save(sd, checkpoint_id="step-4", storage_writer=writer)
            after = {k: v[1] for k, v in gstore._durable.items()}
            got = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}
            dcp.load(got, checkpoint_id="step-4", storage_reader=CkptReader("dcp-gpu", d.socket))
            diff = differs({"model": msd}, got)
            print("a save with nothing changed wrote no CUDA tensor: %s; loads %s" % (
                "yes" if before == after else "NO", "bit-exact" if diff is None else
                "DIFFERENT: " + diff))
            ok &= before == after and diff is None
        nbytes = sum(t.numel() * t.element_size() for t in flat_bytes(sd).values())
        pinned = None
        if dev.type == "cuda":
            src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dst.copy_(src)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            pinned = time.perf_counter() - t1
        print("staging %.1f MiB: %.4f s (%.2f GB/s)%s" % (
            nbytes / 2**20, staged_s, nbytes / staged_s / 1e9,
            "" if pinned is None else "; a pinned D2H copy of the same bytes %.4f s (%.2f GB/s)"
            % (pinned, nbytes / pinned / 1e9)))
        writer.close()
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
