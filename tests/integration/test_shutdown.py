"""Stopping ckptd (SIGTERM, what `systemctl stop` sends) never kills a trainer.

Real trainers against a real ckptd: the C++ client (ckpt_shutdown_trainer)
and ckpt.torch (shutdown_torch_trainer.py). Each trainer stops at a named
point of the per-step protocol; the test sends ckptd SIGTERM there and lets
the trainer go on only once ckptd is in the state the case wants:

- stopping, fence next: the trainer reported step 3 (StepDone returned) and
  its next call is the fence WaitSnapshot(3). ckptd is held right after its
  engine started stopping (the delay point engine.shutdown.stopping, released
  by a file), so every call of the rest of the run, Unregister included, is
  answered by a ckptd that is shutting down;
- stopping, StepDone next: the same with the trainer about to report step 3
  (the reported failure: StepDone refused, then the fence of that step);
- stopped: ckptd has exited (status 0) before the trainer goes on;
- restarted: after the stop the trainer trains steps 4-6 with no ckptd, a
  new ckptd starts on the same data directory, and the trainer carries on;
- in flight: the trainer's StepDone of step 3 is held inside ckptd's handler
  (the delay point rpc.step_done, its third hit) while ckptd stops, so the
  gRPC server cancels it under the stop; repeated $CKPT_SHUTDOWN_IN_FLIGHT_RUNS
  times per client in continue mode (3 by default; tests/run_slow.sh: 20);
- cancelled: the StepDone of step 3 comes back with gRPC's own CANCELLED (the
  cancel point rpc.step_done makes the handler cancel its call, as the
  runtime does to a call in flight when ckptd stops): a status ckptd did not
  answer, which the client takes as the loss of ckptd (it was reported as
  "step done 204: CANCELLED: CANCELLED" killing a trainer).

In both daemon-loss modes no trainer dies:
- continue (OnDaemonLoss::kContinueUnprotected, on_daemon_loss="continue"):
  every step is trained, the run ends normally (exit 0) and reports itself
  unprotected; after a restart the client has re-registered by itself, is
  protected again, and the last step is durable in the new ckptd;
- error (OnDaemonLoss::kError, the default): the first call after the stop
  fails with UNAVAILABLE, the documented daemon-loss error (ckpt.Error code
  "UNAVAILABLE" in Python), and the trainer stops cleanly with its exit code
  3; never another code (FAILED_PRECONDITION was the defect), a signal or a
  hang.
In every case ckptd itself exits 0.

No sleeps: ckptd's state is observed through the delay point's log, its exit
status and its socket; polls have deadlines.
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
CPP_TRAINER = os.path.join(harness.BUILD, "tests", "integration", "ckpt_shutdown_trainer")
PY_TRAINER = os.path.join(HERE, "shutdown_torch_trainer.py")
STOPPED_ON_LOSS = 3
DEADLINE_S = 60
IN_FLIGHT_RUNS = int(os.environ.get("CKPT_SHUTDOWN_IN_FLIGHT_RUNS", "3"))


class Trainer:
    """A trainer process whose stdout lines are read with deadlines."""

    def __init__(self, cmd, env):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines = []
        self._queue = queue.Queue()
        self._stderr = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self._queue), daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    @staticmethod
    def _read(stream, q):
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    def _read_err(self):
        for line in self.proc.stderr:
            self._stderr.append(line)

    def wait_line(self, prefix):
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline:
            try:
                line = self._queue.get(timeout=deadline - time.time())
            except queue.Empty:
                break
            if line is None:
                raise AssertionError("trainer ended before '%s': %s" % (prefix, self.describe()))
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError("no '%s' from the trainer in %d s: %s" % (prefix, DEADLINE_S,
                                                                     self.describe()))

    def go(self):
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self):
        try:
            rc = self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("trainer hung: %s" % self.describe())
        while True:
            line = self._queue.get(timeout=DEADLINE_S)
            if line is None:
                break
            self.lines.append(line)
        return rc

    def stderr(self):
        return "".join(self._stderr)

    def describe(self):
        return "stdout %r, stderr %r" % (self.lines, self.stderr()[-2000:])


def wait_for(what, predicate):
    deadline = time.time() + DEADLINE_S
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.01)  # a poll with a deadline
    raise AssertionError("timed out waiting for " + what)


def file_has_line(path, line):
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return line in f.read().split("\n")


class Case:
    def __init__(self, client, mode, state, point):
        self.client, self.mode, self.state, self.point = client, mode, state, point

    @property
    def name(self):
        return "%s/%s/%s/%s" % (self.client, self.mode, self.state, self.point)


def steps_of(case):
    return 5 if case.state in ("in_flight", "cancelled") else 12


def trainer_cmd(case, socket, job, pauses, py_env):
    args = ["--socket=" + socket, "--job=" + job, "--steps=%d" % steps_of(case),
            "--on-daemon-loss=" + case.mode, "--reconnect-ms=0"]
    args += ["--pause=" + p for p in pauses]
    if case.client == "cpp":
        return [CPP_TRAINER] + args, dict(os.environ)
    return [sys.executable, PY_TRAINER] + args, py_env


def run_case(case, root, py_env):
    """Runs one trainer through a stop of ckptd; returns a list of failures."""
    job = "stop-%s-%s-%s-%s" % (case.client, case.mode, case.state, case.point.replace("_", "-"))
    release = os.path.join(root, "release")
    delay_log = os.path.join(root, "delay.log")
    env = None
    if case.state == "in_flight":
        env = {"CKPT_DELAY_AT": "rpc.step_done:%d:3" % (DEADLINE_S * 1000),
               "CKPT_DELAY_LOG": delay_log, "CKPT_DELAY_UNTIL": release}
    if case.state == "cancelled":
        env = {"CKPT_CANCEL_AT": "rpc.step_done:3"}
    if case.state == "stopping":
        # Hold ckptd right after its engine started stopping; its sockets
        # still answer. 60 s is only the hold's deadline; the test releases it.
        env = {"CKPT_DELAY_AT": "engine.shutdown.stopping:%d" % (DEADLINE_S * 1000),
               "CKPT_DELAY_LOG": delay_log, "CKPT_DELAY_UNTIL": release}
    daemon = harness.Daemon(root, env=env).start()
    failures = []
    pauses = ["%s:3" % case.point] if case.state not in ("in_flight", "cancelled") else []
    if case.state == "restarted":
        pauses.append("before_fence:6")
    cmd, tenv = trainer_cmd(case, daemon.socket, job, pauses, py_env)
    trainer = Trainer(cmd, tenv)
    try:
        if case.state == "in_flight":
            # The trainer's third StepDone is inside ckptd's handler: stop
            # ckptd under it, then let the handler go (the server has
            # cancelled the call by then or does so once it stops).
            wait_for("StepDone 3 to be held in ckptd",
                     lambda: file_has_line(delay_log, "rpc.step_done"))
            daemon.proc.send_signal(signal.SIGTERM)
            # The server cancels the held call within its stop deadline; the
            # trainer takes that as the loss of ckptd and trains on to its end.
            wait_for("the trainer to go on past the cancelled StepDone",
                     lambda: trainer.proc.poll() is not None)
            open(release, "w").close()
            rc_daemon = daemon.proc.wait(timeout=DEADLINE_S)
            if rc_daemon != 0:
                failures.append("ckptd exited %d after SIGTERM" % rc_daemon)
        elif case.state == "cancelled":
            pass  # ckptd keeps running: the trainer trains on and re-registers
        else:
            trainer.wait_line("pause %s 3" % case.point)
            daemon.proc.send_signal(signal.SIGTERM)
        if case.state in ("in_flight", "cancelled"):
            pass
        elif case.state == "stopping":
            wait_for("ckptd to hold at engine.shutdown.stopping",
                     lambda: file_has_line(delay_log, "engine.shutdown.stopping"))
        else:
            rc = daemon.proc.wait(timeout=DEADLINE_S)
            if rc != 0:
                failures.append("ckptd exited %d after SIGTERM" % rc)
        if case.state not in ("in_flight", "cancelled"):
            trainer.go()
        if case.state == "restarted":
            trainer.wait_line("pause before_fence 6")
            daemon = harness.Daemon(root).start()  # same socket and data directory
            trainer.go()
        rc = trainer.finish()
    finally:
        if trainer.proc.poll() is None:
            trainer.proc.kill()
        if case.state in ("stopping", "in_flight"):
            open(release, "w").close()
    out = "\n".join(trainer.lines)
    if "FAILED_PRECONDITION" in out + trainer.stderr():
        failures.append("a call failed with FAILED_PRECONDITION")
    if case.state in ("in_flight", "cancelled") and "ckptd unreachable" not in trainer.stderr():
        failures.append("the client did not take the call's failure as the loss of ckptd")
    if case.state == "stopping" and "shutting down" not in out + trainer.stderr():
        failures.append("no call was answered by the stopping ckptd")
    done = [l for l in trainer.lines if l.startswith("done ")]
    if case.mode == "continue":
        if rc != 0 or len(done) != 1:
            failures.append("the trainer died (exit %s)" % rc)
        else:
            summary = json.loads(done[0][len("done "):])
            if summary["steps"] != steps_of(case):
                failures.append("trained %d of %d steps" % (summary["steps"], steps_of(case)))
            if case.state == "cancelled":
                if summary["unprotected"]:
                    failures.append("not protected again after the cancelled call: %s" % summary)
            elif case.state == "restarted":
                if summary["unprotected"] or summary["durable"] != 12:
                    failures.append("not protected again after the restart: %s" % summary)
                plan = daemon.ctl("plan", job)
                if plan["target_step"] != 12:
                    failures.append("the new ckptd's plan targets %s, not 12" % plan["target_step"])
            elif not summary["unprotected"] or summary["durable"] is not None:
                failures.append("the run does not say it ended unprotected: %s" % summary)
            if case.state == "cancelled" and "CANCELLED" not in trainer.stderr():
                failures.append("the StepDone did not come back as gRPC's CANCELLED")
    else:
        calls = [l for l in trainer.lines if l.startswith("call ")]
        if rc != STOPPED_ON_LOSS:
            failures.append("exit %s, not the clean stop %d" % (rc, STOPPED_ON_LOSS))
        elif not calls or "UNAVAILABLE" not in calls[-1]:
            failures.append("the failing call was not UNAVAILABLE: %s" % calls)
        elif case.client == "cpp":
            first = "StepDone 3" if case.point == "before_step_done" else "WaitSnapshot 3"
            if not calls[-1].startswith("call " + first + " "):
                failures.append("the first call after the stop was not %s: %s" % (first, calls))
    rc = daemon.stop(timeout=DEADLINE_S)
    if rc != 0:
        failures.append("ckptd exited %s" % rc)
    if failures:
        failures.append("trainer: " + trainer.describe())
    return failures


def torch_env():
    """The environment for the ckpt.torch trainer, or None when torch or the
    module is missing here."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(harness.BUILD, "python")
    env["OMP_NUM_THREADS"] = "1"
    probe = subprocess.run([sys.executable, "-c", "import torch, ckpt.torch"], env=env,
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print("ckpt.torch cases skipped: " + probe.stderr.strip().splitlines()[-1])
        return None
    return env


def main():
    if not os.path.exists(harness.CKPTD) or not os.path.exists(CPP_TRAINER):
        print("skipping: build ckptd and ckpt_shutdown_trainer first")
        return 77
    py_env = torch_env()
    clients = ["cpp"] + (["py"] if py_env else [])
    cases = []
    for client in clients:
        for mode in ("continue", "error"):
            cases.append(Case(client, mode, "stopping", "before_fence"))
            cases.append(Case(client, mode, "stopping", "before_step_done"))
            cases.append(Case(client, mode, "stopped", "before_fence"))
        cases.append(Case(client, "continue", "restarted", "before_fence"))
        cases.append(Case(client, "continue", "cancelled", "step_done"))
        for _ in range(IN_FLIGHT_RUNS):
            cases.append(Case(client, "continue", "in_flight", "step_done"))
    base = harness.tempdir("ckpt-shutdown-")
    tally = {}
    failed = 0
    for i, case in enumerate(cases):
        root = os.path.join(base, str(i))
        failures = run_case(case, root, py_env)
        key = (case.client, case.mode)
        runs, died = tally.get(key, (0, 0))
        tally[key] = (runs + 1, died + (1 if failures else 0))
        print("%-44s %s" % (case.name, "ok" if not failures else "FAILED"))
        for f in failures:
            print("    " + f)
        if failures:
            failed += 1
            print(open(os.path.join(root, "ckptd.log")).read()[-3000:])
    for (client, mode), (runs, died) in sorted(tally.items()):
        print("%s trainers, on daemon loss %s: %d run, %d died" % (client, mode, runs, died))
    if failed == 0:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
