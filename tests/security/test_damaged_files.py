"""Damaged files in the data directory, against a real ckptd and ckptctl.

1. Clean stop, then the newest version of a layer truncated and the newest
   of another with one payload bit flipped, while ckptd is stopped. Start-up
   after a clean stop looks files up by name only, so the restore was the
   first to read them and failed with DATA_LOSS although the previous step
   was intact (after a SIGKILL the start-up check dropped the record and the
   restore fell back). Then the restore took each damaged version out of the
   history (its file to quarantine/) and fell back to the layer's previous
   version unasked. Now, with no intact copy anywhere, each damaged version
   is marked lost and the restore is refused naming the layers, again on
   every retry; asked to (--older-within=1) it takes the previous versions
   and says so, and the trainer's --verify-log checks every restored byte
   against the hashes it logged when it wrote them.
2. A FIFO planted in quarantine/ under a layer file's name: `ckptctl repair`
   blocked in open() on it forever, holding the index's lock. Now it opens
   without blocking, skips the FIFO as not a layer file and finishes.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

LAYERS = ["--layers=3", "--layer-bytes=64K", "--policy=all"]
STEPS = 4


def newest_file(data, job, layer):
    files = sorted(glob.glob(os.path.join(data, "jobs", job, "rank-00000000",
                                          "L%08x-S*.ckv" % layer)))
    return files[-1]


def damaged_after_clean_stop(root):
    d = harness.Daemon(os.path.join(root, "clean"), extra=["--gc_interval_s=0"])
    d.start()
    try:
        log = os.path.join(root, "hashes.jsonl")
        out = harness.run_trainer(d, "dmg", "--steps=%d" % STEPS, "--log=" + log, *LAYERS)
        assert out.returncode == 0, out.stdout + out.stderr
        assert d.stop() == 0, d.log()[-3000:]
        truncated, flipped = newest_file(d.data, "dmg", 0), newest_file(d.data, "dmg", 1)
        assert "-S%016x-" % STEPS in truncated and "-S%016x-" % STEPS in flipped
        os.truncate(truncated, os.path.getsize(truncated) // 2)
        with open(flipped, "r+b") as f:
            f.seek(os.path.getsize(flipped) - 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x04]))

        d.start()
        check("start-up check after a clean stop" in d.log(), "ckptd started after a clean stop")
        for attempt in range(2):
            out = harness.run_trainer(d, "dmg", "--steps=0", "--restore", *LAYERS)
            check(out.returncode != 0 and "DATA_LOSS" in out.stderr and
                  "' lost its version of step %d" % STEPS in out.stderr,
                  "restore %d is refused, naming the lost versions (exit %d: %s)"
                  % (attempt + 1, out.returncode, out.stderr[-600:]))
        # ckptctl plan says the same, and with --older-within shows the loss.
        refused = d.ctl_raw("plan", "dmg")
        check(refused.returncode != 0 and "DATA_LOSS" in refused.stderr and
              "--older-within" in refused.stderr, "ckptctl plan refuses: %s" % refused.stderr)
        plan = d.ctl("plan", "dmg", "--older-within=1")
        lost = {l["name"]: (l["step"], l["lost_step"]) for l in plan["layers"]}
        check(lost["embed_tokens"] == (STEPS - 1, STEPS),
              "ckptctl plan --older-within=1 names the lost step: %s" % lost)
        shown = d.ctl_raw("plan", "dmg", "--older-within=1")
        check("step %d" % STEPS in shown.stdout and "LOST" in shown.stdout,
              "... and its table has a LOST column:\n%s" % shown.stdout)
        out = harness.run_trainer(d, "dmg", "--steps=0", "--restore", "--older-within=1",
                                  "--verify-log=" + log, *LAYERS)
        print(out.stdout[-1500:])
        check(out.returncode == 0,
              "asked to, the restore takes the previous versions and every restored byte "
              "matches its logged hash (exit %d: %s)" % (out.returncode, out.stderr[-500:]))
        check(out.stdout.count("(step %d was lost)" % STEPS) == 2,
              "the trainer is told which layers came from an older step")
        plan = [line.split() for line in out.stdout.splitlines() if line.startswith("  layers.") or
                line.startswith("  embed")]
        steps = {row[0]: int(row[1]) for row in plan}
        check(sorted(steps.values()) == [STEPS - 1, STEPS - 1, STEPS],
              "the two damaged layers come from step %d, the intact one from %d: %s"
              % (STEPS - 1, STEPS, steps))
        quarantined = sorted(os.path.basename(p) for p in glob.glob(
            os.path.join(d.data, "quarantine", "dmg", "rank-00000000", "*")))
        check(quarantined == sorted(os.path.basename(p) for p in (truncated, flipped)),
              "both damaged files are in quarantine/, not deleted: %s" % quarantined)
        address = d.ctl("status")["metrics_address"]
        check(harness.metric(address, "ckpt_versions_quarantined_total") == 2,
              "ckpt_versions_quarantined_total counts them")
        check(harness.metric(address, "ckpt_lost_version_restores_total", 'outcome="refused"') == 2
              and harness.metric(address, "ckpt_lost_version_restores_total",
                                 'outcome="older"') == 1,
              "ckpt_lost_version_restores_total counts the refusals and the older restore")
        assert d.stop() == 0, d.log()[-3000:]
        return d
    except BaseException:
        d.kill()
        raise


def fifo_in_quarantine(d):
    qdir = os.path.join(d.data, "quarantine", "dmg", "rank-00000000")
    fifo = os.path.join(qdir, "L00000002-S%016x-G%016x.ckv" % (1, 99))
    os.mkfifo(fifo, 0o600)
    r = subprocess.run([harness.CKPTCTL, "--json", "repair", "--data-dir=" + d.data],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, "`ckptctl repair` finishes with a FIFO in quarantine/ (exit %d: %s)"
          % (r.returncode, r.stderr.strip()[-300:]))
    report = json.loads(r.stdout)
    print("repair report: %s" % json.dumps(report, sort_keys=True)[:800])
    check(os.path.exists(fifo), "the FIFO is left where it was")
    check("FIFO" in r.stdout or "FIFO" in r.stderr, "the report names the FIFO as skipped")


def main():
    root = harness.tempdir("ckpt-damaged-")
    try:
        d = damaged_after_clean_stop(root)
        fifo_in_quarantine(d)
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
