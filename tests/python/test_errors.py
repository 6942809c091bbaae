"""ckpt.Error carries the typed reason ckptd attached, against real ckptd
processes, so a caller tells a quota refusal from a full disk although both
are RESOURCE_EXHAUSTED:
- a registration past max_registrations_per_uid: reason "QUOTA";
- a registration while the data file system has less free space than
  min_free_disk_bytes keeps for the index: reason "DISK_FULL";
- a plan of a job that does not exist: NOT_FOUND, reason None;
- under CKPT_REWORD_ERRORS=1 (a test build of ckptd rewords every message)
  the codes and reasons are the same: nothing depends on the wording;
- through ckpt.torch (when torch imports): the first step of a second
  attachment past the quota raises the client's ckpt.Error, reason "QUOTA".

Run by ctest (PYTHONPATH=<build>/python); exits 77 (skipped) when the
module is not built.
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

try:
    import ckpt
except ImportError as e:  # pragma: no cover - reported as a skip
    print("skipping: %s" % e)
    sys.exit(77)

NO_ROOM = 1 << 60  # min_free_disk_bytes no data file system has free


def register(client, job):
    """Registers one rank of `job` with one small tensor; the ckpt.Error
    ckptd refused it with, or None."""
    region = client.allocate_region(4096)
    try:
        client.register({"job_id": job, "layers": [{"name": "l0", "tensors": [
            {"name": "w", "shape": [1024], "region": region.index, "offset": 0}]}]})
        return None
    except ckpt.Error as e:
        return e


def quota_and_disk(root, reworded):
    env = {"CKPT_REWORD_ERRORS": "1"} if reworded else None
    how = " (messages reworded)" if reworded else ""
    d = harness.Daemon(os.path.join(root, "quota%d" % reworded), env=env,
                       extra=["--max_registrations_per_uid=1"]).start()
    try:
        first = ckpt.Client(d.socket)
        check(register(first, "a") is None, "the first rank of the uid registers" + how)
        e = register(ckpt.Client(d.socket), "b")
        check(e is not None and e.code == "RESOURCE_EXHAUSTED" and e.reason == "QUOTA",
              "a rank past max_registrations_per_uid: %s reason %s (%s)%s"
              % (e and e.code, e and e.reason, e and e.message, how))
        if reworded and "max_registrations_per_uid" in e.message:
            # A build without kill points (CKPT_KILL_POINTS=OFF) keeps them.
            print("note: this ckptd does not reword messages; the reasons were checked anyway")
        try:
            first.plan(0, job_id="no-such-job")
            raise AssertionError("a plan of a job that does not exist succeeded")
        except ckpt.Error as e:
            check(e.code == "NOT_FOUND" and e.reason is None,
                  "NOT_FOUND without a reason: reason %r%s" % (e.reason, how))
        assert d.stop() == 0, d.log()[-2000:]
    finally:
        d.kill()

    d = harness.Daemon(os.path.join(root, "disk%d" % reworded), env=env,
                       extra=["--min_free_disk_bytes=%d" % NO_ROOM]).start()
    try:
        e = register(ckpt.Client(d.socket), "c")
        check(e is not None and e.code == "RESOURCE_EXHAUSTED" and e.reason == "DISK_FULL",
              "a registration without the index's free space: %s reason %s (%s)%s"
              % (e and e.code, e and e.reason, e and e.message, how))
        assert d.stop() == 0, d.log()[-2000:]
    finally:
        d.kill()


def through_torch(root):
    try:
        import torch
        from ckpt import torch as ckpt_torch
    except ImportError as e:
        print("the ckpt.torch case is skipped: %s" % e)
        return
    d = harness.Daemon(os.path.join(root, "torch"), extra=["--max_registrations_per_uid=1"]).start()
    try:
        runs = []
        for job in ("t1", "t2"):
            model = torch.nn.Linear(4, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            runs.append(ckpt_torch.attach(model, opt, ckpt.Client(d.socket), job_id=job))
            model(torch.ones(1, 4)).sum().backward()
            try:
                opt.step()  # the rank registers in the post-step hook
                error = None
            except ckpt.Error as e:
                error = e
            if job == "t1":
                check(error is None and runs[0].registered, "the first attachment registers")
        check(error is not None and error.code == "RESOURCE_EXHAUSTED" and
              error.reason == "QUOTA" and not runs[1].registered,
              "the second attachment's first step: %s reason %s"
              % (error and error.code, error and error.reason))
        for run in runs:
            run.close(drain=False)
        assert d.stop() == 0, d.log()[-2000:]
    finally:
        d.kill()


def own_errors():
    """An error ckpt.torch raises itself names no reason of ckptd's."""
    e = ckpt.Error("FAILED_PRECONDITION", "made here")
    check(e.reason is None and str(e) == "FAILED_PRECONDITION: made here",
          "ckpt.Error(code, message): reason None, str %r" % str(e))
    e = ckpt.Error("RESOURCE_EXHAUSTED", "full", "DISK_FULL")
    check((e.code, e.message, e.reason) == ("RESOURCE_EXHAUSTED", "full", "DISK_FULL"),
          "ckpt.Error(code, message, reason) keeps all three")


def main():
    root = harness.tempdir("ckpt-errors-")
    try:
        own_errors()
        quota_and_disk(root, reworded=False)
        quota_and_disk(root, reworded=True)
        through_torch(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
