"""A live scrape of ckptd's Prometheus endpoint while a trainer runs:
promtool accepts it, and the figures agree with what happened."""

import os
import re
import shutil
import subprocess
import sys
import urllib.request

import harness


def scrape(address):
    with urllib.request.urlopen("http://%s/metrics" % address, timeout=10) as r:
        return r.read().decode()


def value(text, name, labels=""):
    m = re.search(r"^%s%s (\S+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    return float(m.group(1)) if m else None


def main():
    root = harness.tempdir("ckpt-metrics-")
    try:
        d = harness.Daemon(root).start()
        status = d.ctl("status")
        address = status["metrics_address"]
        assert address.startswith("127.0.0.1:"), status
        out = harness.run_trainer(d, "m", "--layers=5", "--layer-bytes=64K", "--steps=40",
                                  "--policy=layercheck", "--optimizer=adamw", "--warmup=10",
                                  "--warmup-interval=5")
        assert out.returncode == 0, out.stderr
        text = scrape(address)
        path = os.path.join(root, "scrape.txt")
        with open(path, "w") as f:
            f.write(text)
        promtool = shutil.which("promtool")
        if promtool:
            check = subprocess.run([promtool, "check", "metrics"], stdin=open(path),
                                   capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
            print("promtool check metrics: ok")
        else:
            print("promtool not installed: format check skipped")
        # Regression: the disk limit gauge was 0 unless max_disk_bytes was set.
        used, limit = value(text, "ckpt_disk_used_bytes"), value(text, "ckpt_disk_limit_bytes")
        assert limit > used > 0, (used, limit)
        # Regression: exports (ckptctl restore/export) were not counted as restores.
        assert value(text, "ckpt_restores_total") == 0
        exported = d.ctl("export", "m", "--out=" + os.path.join(root, "exp"))
        after = scrape(address)
        assert value(after, "ckpt_restores_total") == 1, after
        assert value(after, "ckpt_restored_bytes_total") == exported["ranks"][0]["bytes"]
        committed = value(text, "ckpt_versions_committed_total")
        jobs = d.ctl("jobs")["jobs"]
        assert committed == jobs[0]["versions"], (committed, jobs)
        assert value(text, "ckpt_io_backend_info", '{backend="%s"}' % status["io_backend"]) == 1
        assert value(text, "ckpt_registrations_total") == 1
        assert value(text, "ckpt_staleness_invariant_violations_total") == 0
        assert value(text, "ckpt_fence_wait_seconds_count") >= 39
        assert value(text, "ckpt_commit_seconds_count") == committed
        assert value(text, "ckpt_staging_pool_bytes") == status["pool_bytes"]
        assert value(text, "ckpt_disk_used_bytes") > 0
        # Regression: the training job was the label `job`, which a scrape
        # renames to exported_job (Prometheus sets `job` to the scrape job), so
        # the dashboard's per-job panels showed nothing.
        assert re.search(r'ckpt_layer_staleness_steps\{[^}]*ckpt_job="m"', text), "no per-layer series"
        assert not re.search(r'ckpt_layer_\w+\{[^}]*(?<![a-z_])job=', text), "a bare job label"
        print("scrape: %d versions committed, %d metric lines" % (committed, len(text.splitlines())))
        assert d.stop() == 0
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
