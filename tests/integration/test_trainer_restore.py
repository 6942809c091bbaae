"""A trainer runs >= 200 steps with different layer subsets persisted at
different steps, is killed with SIGKILL, and a new trainer process restores the
composite checkpoint: every layer's bytes must equal what the old trainer had
at that layer's planned step (checked against hashes the old trainer logged
when it took the step)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import harness


def wait_for_steps(log_path, n, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = harness.read_jsonl(log_path)
        if rows and rows[-1]["step"] >= n:
            return rows[-1]["step"]
        if proc.poll() is not None:
            raise AssertionError("trainer exited early: %s" % proc.stderr.read())
        time.sleep(0.05)
    raise AssertionError("trainer did not reach step %d" % n)


CLEAN = "after a clean stop"
CRASH = "after a crash or a first start"


def check_restarts(d, job, plan, layers, policy):
    """A restart after SIGTERM checks the recorded files by name; so does a
    restart after a SIGKILL that came before any index write. After a SIGKILL
    that followed writes, every file's size is checked. The plan holds."""
    assert d.stop() == 0, d.log()
    d.start()
    assert d.log().count(CLEAN) == 1, d.log()[-3000:]
    assert d.ctl("plan", job) == plan
    d.kill()  # nothing was written since the clean stop
    d.start()
    assert d.log().count(CLEAN) == 2, d.log()[-3000:]
    assert d.ctl("plan", job) == plan
    # A trainer writes, then ckptd dies: a crash.
    out = harness.run_trainer(d, job, "--layers=%d" % layers, "--layer-bytes=64K,256K,1M",
                              "--steps=%d" % (plan["target_step"] + 5), "--policy=" + policy,
                              "--restore")
    assert out.returncode == 0, out.stdout + out.stderr
    later = d.stable_plan(job)
    assert later["target_step"] > plan["target_step"], later
    crashes = d.log().count(CRASH)
    d.kill()
    d.start()
    assert d.log().count(CRASH) == crashes + 1 and d.log().count(CLEAN) == 2, d.log()[-3000:]
    assert d.ctl("plan", job) == later
    print("restarts: after SIGTERM, and after SIGKILL with nothing written since, the files were "
          "checked by name; after SIGKILL following writes, by size; plans kept")


def run(policy, layers, steps_before_kill, restarts=False):
    root = harness.tempdir("ckpt-it-")
    try:
        d = harness.Daemon(root).start()
        job = "it-" + policy.replace(":", "-")
        log = os.path.join(root, "steps.jsonl")
        proc = subprocess.Popen(
            harness.trainer_cmd(d, job, "--layers=%d" % layers, "--layer-bytes=64K,256K,1M",
                                "--steps=100000", "--policy=" + policy, "--log=" + log,
                                "--compute-ms=1"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reached = wait_for_steps(log, steps_before_kill, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Versions staged before the kill still become durable; wait until
        # the latest durable step stops moving, so the plan is final.
        plan = d.stable_plan(job)
        steps = sorted({l["step"] for l in plan["layers"]})
        assert plan["complete"], plan
        out = harness.run_trainer(d, job, "--layers=%d" % layers, "--layer-bytes=64K,256K,1M",
                                  "--steps=%d" % (plan["target_step"] + 20), "--policy=" + policy,
                                  "--restore", "--verify-log=" + log)
        sys.stdout.write(out.stdout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "verify: %d of %d layers match" % (layers, layers) in out.stdout, out.stdout
        # The plan the restore printed is the one ckptctl showed.
        assert "to step %d" % plan["target_step"] in out.stdout
        print("policy %s: killed at step >= %d, restored to step %d, layer steps %s" %
              (policy, reached, plan["target_step"], steps))
        if restarts:
            check_restarts(d, job, d.stable_plan(job), layers, policy)
        assert d.stop() == 0, d.log()
        return steps
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    steps = run("explicit", layers=10, steps_before_kill=200, restarts=True)
    assert len(steps) > 1, "explicit schedule should give a composite plan with mixed steps"
    steps = run("all", layers=4, steps_before_kill=50)
    assert len(steps) == 1


if __name__ == "__main__":
    main()
