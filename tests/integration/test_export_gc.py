"""Retention/GC and export against a real daemon.

GC: after `ckptctl gc`, the plans of retained steps (the latest, the newest
events, multiples of keep_every_steps) are unchanged and verify; removed
steps are NOT_FOUND; --dry-run deletes nothing.
Export: `ckptctl export` writes safetensors + manifest.json that an
independent reader (numpy, below) parses, with bytes equal to what a client
restore writes into a trainer's buffers."""

import json
import os
import shutil
import sys

import harness

try:
    import numpy as np
except ImportError:  # the reader needs numpy; Debian's python3-numpy provides it
    np = None

DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I64": "<i8", "I32": "<i4",
          "U8": "u1"}


def read_safetensors(path):
    """A minimal independent safetensors reader."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        arr = np.frombuffer(body[begin:end], dtype=DTYPES[meta["dtype"]])
        tensors[name] = arr.reshape(meta["shape"])
    return header, body, tensors


def main():
    if np is None:
        print("numpy missing: skipping")
        return 77
    root = harness.tempdir("ckpt-gc-")
    try:
        d = harness.Daemon(root, extra=["--gc_interval_s=0", "--keep_last_events=5",
                                        "--keep_every_steps=50"]).start()
        job = "gcx"
        trainer = ["--layers=6", "--layer-bytes=64K,128K", "--policy=explicit"]
        out = harness.run_trainer(d, job, "--steps=120", *trainer)
        assert out.returncode == 0, out.stderr
        before = d.ctl("jobs")["jobs"][0]
        plan_latest = d.ctl("plan", job)
        plan_100 = d.ctl("plan", job, "--step=100")
        assert plan_latest["target_step"] == 120 and plan_100["target_step"] == 100

        dry = d.ctl("gc", job, "--dry-run")
        assert dry["versions_deleted"] > 0, dry
        assert d.ctl("jobs")["jobs"][0]["versions"] == before["versions"], "dry run deleted"
        gc = d.ctl("gc", job)
        for k in ("versions_deleted", "bytes_deleted", "events_deleted", "versions_kept"):
            assert gc[k] == dry[k], (k, gc, dry)
        after = d.ctl("jobs")["jobs"][0]
        assert after["versions"] == before["versions"] - gc["versions_deleted"]
        assert after["bytes"] == before["bytes"] - gc["bytes_deleted"]
        # Retained steps: latest 5 (116..120) and multiples of 50 (50, 100).
        assert gc["retained_targets"] == 7, gc
        assert d.ctl("plan", job) == plan_latest
        assert d.ctl("plan", job, "--step=100") == plan_100
        gone = d.ctl_raw("plan", job, "--step=60")
        assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr, gone.stderr
        verify = d.ctl("verify", job, "--deep")
        assert verify["failures"] == [] and verify["versions_checked"] == after["versions"]
        print("gc: deleted %d of %d versions (%d bytes), %d events; 7 restorable steps unchanged"
              % (gc["versions_deleted"], before["versions"], gc["bytes_deleted"],
                 gc["events_deleted"]))
        assert d.ctl("gc", job)["versions_deleted"] == 0  # idempotent

        # Export of the latest plan vs a client restore of the same plan.
        out_dir = os.path.join(root, "export")
        manifest = d.ctl("export", job, "--out=" + out_dir)
        assert manifest["job_id"] == job and len(manifest["ranks"]) == 1
        rank = manifest["ranks"][0]
        assert rank["target_step"] == 120
        assert [l["step"] for l in rank["layers"]] == [l["step"] for l in plan_latest["layers"]]
        with open(os.path.join(out_dir, "manifest.json")) as f:
            assert json.load(f) == manifest
        header, body, tensors = read_safetensors(os.path.join(out_dir, rank["file"]))
        assert header["__metadata__"]["target_step"] == "120"
        assert len(tensors) == 6 and all(t.dtype == np.float32 for t in tensors.values())
        dump = os.path.join(root, "restored.bin")
        out = harness.run_trainer(d, job, "--restore", "--steps=0", "--dump=" + dump, *trainer)
        assert out.returncode == 0, out.stderr
        with open(dump, "rb") as f:
            restored = f.read()
        ordered = b"".join(tensors[n].tobytes() for n in sorted(
            tensors, key=lambda n: header[n]["data_offsets"][0]))
        assert ordered == body and restored == body, "export bytes differ from the restore"
        print("export: %d tensors, %d bytes, equal to a client restore of step %d" %
              (len(tensors), len(body), rank["target_step"]))

        # restore --out: one rank at a retained older step.
        r_dir = os.path.join(root, "restore100")
        m = d.ctl("restore", job, "--step=100", "--out=" + r_dir)
        assert m["ranks"][0]["target_step"] == 100
        assert [l["step"] for l in m["ranks"][0]["layers"]] == [l["step"] for l in plan_100["layers"]]
        assert d.stop() == 0
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
