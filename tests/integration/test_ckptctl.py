"""Every ckptctl command against a real daemon, in human and --json form,
with the documented exit codes (0 ok, 1 daemon error, 2 usage, 3 unreachable,
4 verify found damage, 5 local file error), and the disk bound's clear error."""

import json
import os
import re
import shutil
import sys

import harness


def table(text):
    """Rows of the first table in human output: the lines after the header."""
    lines = text.splitlines()
    head = next(i for i, l in enumerate(lines) if re.match(r"^\s*[A-Z][A-Z ]+\s{2,}[A-Z]", l))
    return [l.split() for l in lines[head + 1:] if l.strip()]


def main():
    root = harness.tempdir("ckpt-ctl-")
    try:
        d = harness.Daemon(root, extra=["--gc_interval_s=0", "--keep_last_events=3",
                                        "--keep_every_steps=0"]).start()
        job = "ctl"
        args = ["--layers=4", "--layer-bytes=64K", "--policy=explicit"]
        assert harness.run_trainer(d, job, "--steps=30", *args).returncode == 0

        # status
        st = d.ctl("status")
        assert st["jobs"] == 1 and st["versions_committed"] > 0 and st["io_backend"]
        human = d.ctl_raw("status")
        assert human.returncode == 0
        kv = dict(l.split(":", 1) for l in human.stdout.splitlines() if ":" in l)
        assert kv["versions_committed"].strip() == str(st["versions_committed"])

        # jobs
        jobs = d.ctl("jobs")["jobs"]
        assert [j["job_id"] for j in jobs] == [job] and jobs[0]["ranks"][0]["latest_durable_step"] == 30
        rows = table(d.ctl_raw("jobs").stdout)
        assert rows[0][0] == job and rows[0][4] == "30", rows

        # layers
        layers = d.ctl("layers", job)
        assert len(layers["layers"]) == 4 and layers["latest_durable_step"] == 30
        rows = table(d.ctl_raw("layers", job).stdout)
        assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
        for r, l in zip(rows, layers["layers"]):
            assert r[1] == l["name"] and int(r[-1]) == l["versions"], (r, l)

        # history
        hist = d.ctl("history", job, "--layer=1", "--limit=3")["events"]
        assert len(hist) == 3 and all(1 in e["layers"] for e in hist)
        assert [e["step"] for e in hist] == sorted([e["step"] for e in hist], reverse=True)
        rows = table(d.ctl_raw("history", job, "--layer=1", "--limit=3").stdout)
        assert [int(r[0]) for r in rows] == [e["step"] for e in hist]

        # plan
        plan = d.ctl("plan", job)
        assert plan["complete"] and plan["target_step"] == 30
        rows = table(d.ctl_raw("plan", job).stdout)
        assert [int(r[2]) for r in rows] == [l["step"] for l in plan["layers"]]
        at = d.ctl("plan", job, "--step=20")
        assert at["target_step"] == 20 and max(l["step"] for l in at["layers"]) <= 20

        # config
        cfg = d.ctl("config")
        # Regression: --json gave every value as a string.
        assert cfg["keep_last_events"] == 3 and cfg["socket"] == d.socket, cfg
        assert cfg["direct_io"] in (True, False), cfg
        human = d.ctl_raw("config").stdout
        assert "keep_last_events = 3" in human
        assert "shown with its default" not in human, human  # it is the effective config

        # verify (cheap and deep)
        v = d.ctl("verify", job)
        assert v["failures"] == [] and v["versions_checked"] == jobs[0]["versions"]
        assert d.ctl_raw("verify", job, "--deep").returncode == 0

        # export and restore to a directory
        m = d.ctl("export", job, "--out=" + os.path.join(root, "exp"))
        assert os.path.exists(os.path.join(root, "exp", m["ranks"][0]["file"]))
        human = d.ctl_raw("restore", job, "--out=" + os.path.join(root, "res"))
        assert human.returncode == 0 and "rank 0: step 30" in human.stdout, human.stdout

        # gc: dry run, then for real
        dry = d.ctl("gc", job, "--dry-run")
        assert dry["versions_deleted"] > 0 and d.ctl("jobs")["jobs"][0]["versions"] == jobs[0]["versions"]
        human = d.ctl_raw("gc", job)
        assert human.returncode == 0 and "deleted" in human.stdout
        assert d.ctl("jobs")["jobs"][0]["versions"] == jobs[0]["versions"] - dry["versions_deleted"]
        assert d.ctl("plan", job) == plan

        # Regression: a layer the job does not have printed an empty history
        # with exit 0.
        r = d.ctl_raw("history", job, "--layer=99")
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "4 layers" in r.stderr, r
        # Regression: `help plan` printed the whole usage text.
        r = d.ctl_raw("help", "plan")
        assert r.returncode == 0 and "plan JOB" in r.stdout and "export JOB" not in r.stdout, r
        assert d.ctl_raw("help", "nosuchcommand").returncode == 2
        # Regression: a local file-system error exited 2 (usage).
        blocker = os.path.join(root, "a-file")
        with open(blocker, "w") as f:
            f.write("x")
        r = d.ctl_raw("export", job, "--out=" + os.path.join(blocker, "sub"))
        assert r.returncode == 5 and "cannot create" in r.stderr, r
        # Regression: the example trainer threw on a malformed number.
        r = harness.run_trainer(d, "badflag", "--steps=abc")
        assert r.returncode == 2 and "'abc' is not a number" in r.stderr, r

        # Exit codes.
        r = d.ctl_raw("plan", "nosuchjob")
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr, r
        assert d.ctl_raw("plan", "../x").returncode == 1
        assert d.ctl_raw("bogus").returncode == 2
        assert d.ctl_raw("plan").returncode == 2                     # missing JOB
        assert d.ctl_raw("plan", job, "--step=x").returncode == 2
        assert d.ctl_raw("export", job).returncode == 2              # --out required
        r = d.ctl_raw("status", socket=os.path.join(root, "nothing.sock"))
        assert r.returncode == 3, r
        assert d.ctl_raw("--help").returncode == 0

        # verify finds a flipped byte: exit 4 and the failure names the layer.
        rank_dir = os.path.join(d.data, "jobs", job, "rank-00000000")
        victim = sorted(f for f in os.listdir(rank_dir) if f.endswith(".ckv"))[-1]
        layer = int(victim[1:9], 16)
        with open(os.path.join(rank_dir, victim), "r+b") as f:
            f.seek(8192 + 100)
            b = f.read(1)
            f.seek(8192 + 100)
            f.write(bytes([b[0] ^ 0x40]))
        assert d.ctl_raw("verify", job).returncode == 0          # sizes still fine
        r = d.ctl_raw("verify", job, "--deep")
        assert r.returncode == 4 and "checksum" in r.stdout, r.stdout
        bad = json.loads(d.ctl_raw("--json", "verify", job, "--deep").stdout)["failures"]
        assert len(bad) == 1 and bad[0]["layer"] == layer, bad
        print("ckptctl: every command checked in both forms; exit codes 0/1/2/3/4 as documented")
        d.stop()

        # The disk bound: versions past it fail with a clear error, counted.
        d2 = harness.Daemon(os.path.join(root, "small"), extra=["--max_disk_bytes=600000"]).start()
        out = harness.run_trainer(d2, "full", "--layers=4", "--layer-bytes=64K", "--steps=5",
                                  "--durable-every=1")
        assert "disk bound" in out.stderr or "failed or were skipped" in out.stderr, out.stderr
        st = d2.ctl("status")
        assert st["write_errors"] > 0 and st["disk_bytes_used"] <= 600000, st
        assert "disk bound of 600000 bytes reached" in d2.log()
        print("disk bound: %d versions refused, %d bytes used of 600000" %
              (st["write_errors"], st["disk_bytes_used"]))
        d2.stop()
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
