"""The remote tier end to end, with real ckptd processes, the example trainer
and a real store: a shared directory (--backend=posix) or a one-node Ceph
cluster with radosgw serving S3 (--backend=s3; tests/daemon/remote/ceph_rgw.py).

1. ckptd A trains three jobs (policy all; layercheck, whose plans are
   composite; and, with S3, one trained while radosgw is killed and brought
   back): every training step succeeds, the remote lag is reported and
   alarmed while the store is down, and it goes back to 0 after.
2. Node loss: ckptd A is SIGKILLed and its whole data directory deleted.
   ckptd B starts on an empty directory with the same remote configuration,
   lists the jobs, and a new trainer restores each one (pulled from the
   remote tier): every layer's bytes equal what the first trainer logged at
   that layer's planned step; training then continues on B.
3. Damage: an object of the newest manifest is corrupted, another deleted;
   ckptd C (empty again) never serves them: it restores an older step whose
   objects are whole, and counts the damage.
4. S3: wrong credentials give a clear error and training goes on; no
   credential appears in any log, in `ckptctl config` or in the metrics, and
   ckptd runs with core dumps off.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon", "remote"))

LAYERS = 6
LAYER_BYTES = "64K,256K,1M"


def ctl_jobs(d):
    return harness.ctl_jobs(d)


def wait_remote(d, jobs, timeout=600):
    return harness.wait_tier(d, jobs, "remote", timeout)


def train(d, job, log, policy, steps, *extra, timeout=600):
    out = harness.run_trainer(d, job, "--layers=%d" % LAYERS, "--layer-bytes=" + LAYER_BYTES,
                              "--steps=%d" % steps, "--policy=" + policy, "--log=" + log,
                              *extra, timeout=timeout)
    harness.check(out.returncode == 0, "trainer of %s: %s %s" % (job, out.stdout, out.stderr))
    rows = harness.read_jsonl(log)
    harness.check(rows and rows[-1]["step"] == steps, "every step of %s ran" % job)
    return out


def restore(d, job, log, policy, steps, *extra):
    """Restores `job` in a new trainer, checks it, trains on to `steps`
    (logging those steps too); returns the restored step."""
    out = harness.run_trainer(d, job, "--layers=%d" % LAYERS, "--layer-bytes=" + LAYER_BYTES,
                              "--steps=%d" % steps, "--policy=" + policy, "--restore",
                              "--verify-log=" + log, "--log=" + log, *extra)
    restore.stdout = out.stdout
    sys.stdout.write(out.stdout)
    harness.check(out.returncode == 0, "restore of %s: %s %s" % (job, out.stdout, out.stderr))
    harness.check("verify: %d of %d layers match" % (LAYERS, LAYERS) in out.stdout,
                  "every layer of %s equals its bytes at its planned step" % job)
    lines = out.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("composite restore"):
            restore.layer_steps = {int(l.split()[1]) for l in lines[i + 2:i + 2 + LAYERS]}
            return int(line.split("to step ")[1].split()[0])
    raise AssertionError("no plan printed")


def metrics_address(d):
    return d.ctl("status")["metrics_address"]


def metric(d, name, labels=""):
    return harness.metric(metrics_address(d), name, labels) or 0


def remote_args(backend, where, creds):
    key = "--remote_key_file=" + harness.remote_key(os.path.dirname(creds))
    if backend == "posix":
        return ["--remote_kind=posix", "--remote_path=" + where, key]
    return ["--remote_kind=s3", key, "--remote_endpoint=" + where.endpoint,
            "--remote_bucket=" + where.bucket, "--remote_region=" + where.region,
            "--remote_credentials_file=" + creds, "--remote_part_bytes=5242880"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("posix", "s3"), required=True)
    ap.add_argument("--outage-s", type=float, default=15.0,
                    help="how long radosgw stays down while a job trains")
    args = ap.parse_args()
    root = harness.tempdir("ckpt-remote-")
    rgw = None
    secret = None
    try:
        creds = os.path.join(root, "s3.cred")
        if args.backend == "s3":
            import ceph_rgw
            rgw = ceph_rgw.CephRgw(os.path.join(root, "ceph"))
            t0 = time.time()
            rgw.start()
            print("ceph cluster with radosgw ready in %.1f s at %s" % (time.time() - t0, rgw.endpoint))
            rgw.write_credentials(creds)
            secret = rgw.secret_key
            where = rgw
        else:
            where = os.path.join(root, "shared")
        extra = remote_args(args.backend, where, creds)

        # 1. Train on node A.
        a = harness.Daemon(os.path.join(root, "a"), extra=extra).start()
        logs = {j: os.path.join(root, j + ".jsonl") for j in ("r-all", "r-lc", "r-out")}
        train(a, "r-all", logs["r-all"], "all", 30)
        train(a, "r-lc", logs["r-lc"], "layercheck", 80, "--warmup=0", "--k0=0.5")
        if rgw is not None:
            proc = subprocess.Popen(
                harness.trainer_cmd(a, "r-out", "--layers=%d" % LAYERS,
                                    "--layer-bytes=" + LAYER_BYTES, "--steps=100000",
                                    "--policy=all", "--log=" + logs["r-out"], "--compute-ms=20"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while len(harness.read_jsonl(logs["r-out"])) < 20:
                harness.check(proc.poll() is None, "the trainer runs")
                time.sleep(0.05)
            rgw.kill_rgw()
            down_at = len(harness.read_jsonl(logs["r-out"]))
            t_down = time.time()
            lag_seen = 0
            while time.time() - t_down < args.outage_s:
                lag_seen = max(lag_seen, metric(a, "ckpt_remote_lag_steps"))
                time.sleep(0.5)
            up = metric(a, "ckpt_remote_up")
            rows_down = len(harness.read_jsonl(logs["r-out"])) - down_at
            t_up = time.time()
            rgw.start_rgw()
            print("radosgw down %.1f s: %d steps trained meanwhile, remote lag reached %d steps, "
                  "ckpt_remote_up %d; radosgw back in %.1f s" %
                  (t_up - t_down, rows_down, lag_seen, up, time.time() - t_up))
            harness.check(rows_down > 0, "training went on while radosgw was down")
            harness.check(lag_seen > 0 and up == 0, "the lag was reported and the store down")
            proc.kill()
            proc.wait()
            t_catch = time.time()
            wait_remote(a, ["r-out"])
            print("remote tier caught up %.1f s after radosgw returned" % (time.time() - t_catch))
            harness.check(metric(a, "ckpt_remote_failures_total", 'reason="unavailable"') > 0,
                          "the outage was counted")
        remote_steps = wait_remote(a, [j for j in logs if os.path.exists(logs[j])])
        status = a.ctl("status")
        harness.check(status["remote_lag_steps"] == 0 and status["remote"] != "none",
                      "ckptctl status shows the remote tier caught up: %s" % status)
        history = a.ctl("history", "r-all")["events"]
        harness.check(history[0]["remote"], "ckptctl history marks remote-durable steps")
        uploaded = metric(a, "ckpt_remote_uploaded_bytes_total")
        print("uploaded %d bytes; remote-durable steps %s" % (uploaded, remote_steps))

        # 2. Node loss.
        a.kill()
        logs_seen = a.log()
        shutil.rmtree(os.path.join(root, "a"))
        b = harness.Daemon(os.path.join(root, "b"), extra=extra).start()
        listed = ctl_jobs(b)
        harness.check(set(remote_steps) <= set(listed), "the fresh node lists the jobs: %s" % listed)
        for job, policy in (("r-all", "all"), ("r-lc", "layercheck")):
            t0 = time.time()
            step = restore(b, job, logs[job], policy, remote_steps[job] + 5)
            print("%s restored on the replacement node to step %d in %.2f s" %
                  (job, step, time.time() - t0))
            harness.check(step == remote_steps[job], "restored the newest remote-durable step")
            if policy == "layercheck":
                harness.check(len(restore.layer_steps) > 1,
                              "a composite plan (layers from steps %s)" % sorted(restore.layer_steps))
        if "r-out" in remote_steps:
            restore(b, "r-out", logs["r-out"], "all", remote_steps["r-out"] + 1)
        harness.check(metric(b, "ckpt_remote_pulled_bytes_total") > 0, "bytes were pulled")
        # Training continued on B (the restores ran 5 more steps): uploaded too.
        wait_remote(b, ["r-all"])
        harness.check(ctl_jobs(b)["r-all"]["ranks"][0]["remote_step"] == remote_steps["r-all"] + 5,
                      "the replacement node keeps uploading")

        # 3. Damage one object of the newest manifest and delete another:
        # node C refuses the newest step, whose two versions are lost, and
        # takes those layers' previous versions only when asked to.
        b.stop()
        newest = remote_steps["r-all"] + 5
        damaged = damage_newest(args.backend, where, rgw, "r-all", newest)
        c = harness.Daemon(os.path.join(root, "c"), extra=extra).start()
        out = harness.run_trainer(c, "r-all", "--layers=%d" % LAYERS,
                                  "--layer-bytes=" + LAYER_BYTES, "--steps=0", "--restore")
        harness.check(out.returncode != 0 and "DATA_LOSS" in out.stderr and
                      "lost its version of step %d" % newest in out.stderr,
                      "the damaged step %d is refused, naming it: %s %s"
                      % (newest, out.stdout[-800:], out.stderr[-500:] + c.log()[-4000:]))
        step = restore(c, "r-all", logs["r-all"], "all", newest + 1, "--older-within=1000")
        harness.check(step == newest and
                      restore.stdout.count("(step %d was lost)" % newest) == 2,
                      "asked to, the newest step with the two lost layers' previous versions "
                      "(got step %d)" % step)
        harness.check(metric(c, "ckpt_remote_failures_total", 'reason="corrupt"') +
                      metric(c, "ckpt_remote_failures_total", 'reason="other"') > 0,
                      "the damage was counted")
        print("damaged %s: node C refused step %d, then restored it with older versions of the "
              "two layers" % (damaged, newest))
        c.stop()

        # 4. Wrong credentials (S3): node B comes back with a wrong secret;
        # its job restores from the local disk and trains on, uploads fail
        # with a clear error.
        if rgw is not None:
            bad = os.path.join(root, "bad.cred")
            with open(bad, "w") as f:
                f.write("access_key_id = %s\nsecret_access_key = %s\n" %
                        (rgw.access_key, "x" * 40))
            os.chmod(bad, 0o600)
            w = harness.Daemon(os.path.join(root, "b"),
                               extra=remote_args("s3", rgw, bad)).start()
            restore(w, "r-all", logs["r-all"], "all", newest + 10)
            deadline = time.time() + 60
            while time.time() < deadline and not w.ctl("status")["remote_error"]:
                time.sleep(0.2)
            err = w.ctl("status")["remote_error"]
            print("with a wrong secret: %s" % err)
            harness.check("denied" in err.lower() or "403" in err or "signature" in err.lower(),
                          "the error says the credentials were refused: %s" % err)
            harness.check(metric(w, "ckpt_remote_failures_total", 'reason="denied"') > 0,
                          "counted as denied")
            # Credentials: never in logs, config, metrics; core dumps off.
            config = w.ctl_raw("config").stdout + logs_seen + b.log() + c.log() + w.log()
            import urllib.request
            config += urllib.request.urlopen("http://%s/metrics" % metrics_address(w),
                                             timeout=10).read().decode()
            harness.check(secret not in config and "x" * 40 not in config,
                          "no credential in logs, ckptctl config or metrics")
            with open("/proc/%d/limits" % w.proc.pid) as f:
                core = [l for l in f if l.startswith("Max core file size")][0].split()
            harness.check(core[4] == "0", "core dumps are off while credentials are held: %s" % core)
            w.stop()
        print("remote tier (%s): OK" % args.backend)
    finally:
        if rgw is not None:
            rgw.stop()
        shutil.rmtree(root, ignore_errors=True)


def damage_newest(backend, where, rgw, job, step):
    """Flips a payload byte of one version object of `step`'s manifest and
    deletes another one. Returns what it did."""
    prefix = "jobs/%s/rank-00000000/" % job
    if backend == "posix":
        vdir = os.path.join(where, prefix, "v")
        names = sorted(os.listdir(vdir))
        at = [n for n in names if "-S%016x-" % step in n]
        with open(os.path.join(vdir, at[0]), "r+b") as f:
            f.seek(4096 + 10)
            b = f.read(1)
            f.seek(4096 + 10)
            f.write(bytes([b[0] ^ 0xff]))
        os.unlink(os.path.join(vdir, at[1]))
        return "%s (flipped), %s (deleted)" % (at[0], at[1])
    status, _, body = rgw.s3("GET", "", query={"list-type": "2", "prefix": prefix + "v/"})
    harness.check(status == 200, "list objects")
    import re
    keys = [k for k in re.findall(r"<Key>([^<]+)</Key>", body.decode()) if "-S%016x-" % step in k]
    status, _, data = rgw.s3("GET", keys[0])
    data = bytearray(data)
    data[4096 + 10] ^= 0xff
    status, _, _ = rgw.s3("PUT", keys[0], body=bytes(data))
    harness.check(status == 200, "overwrite with a flipped byte")
    status, _, _ = rgw.s3("DELETE", keys[1])
    return "%s (flipped), %s (deleted)" % (keys[0], keys[1])


if __name__ == "__main__":
    main()
