"""ckptctl reaches a busy ckptd: while ckptd's listen queue is full (another
user connecting faster than ckptd accepts), a new connection fails at once
with EAGAIN and gRPC reports it as UNAVAILABLE. ckptctl tries again until its
deadline while something listens on the socket, and fails at once only when
nothing does.

ckptd is stopped (SIGSTOP) so that it accepts nothing, its queue is filled
with connections, `ckptctl status` is started, and after it has had a second
to give up (which it did before the fix) the queue is drained and ckptd
continued: ckptctl must then succeed. A socket with no ckptd behind it still
fails at once with exit 3.
"""

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import harness


def fill_queue(path):
    """Connects until the listen queue of the stopped ckptd is full."""
    held = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return held
        held.append(s)
        if len(held) > 100000:
            raise AssertionError("the listen queue never filled")


def main():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = harness.tempdir("ckpt-busy-")
    d = harness.Daemon(root).start()
    held = []
    try:
        d.proc.send_signal(signal.SIGSTOP)
        held = fill_queue(d.socket)
        print("ok: the listen queue holds %d connections and refuses more" % len(held))
        ctl = subprocess.Popen([harness.CKPTCTL, "--socket=" + d.socket, "--json", "--timeout=60",
                                "status"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        try:
            ctl.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        assert ctl.returncode is None, "ckptctl gave up on a busy ckptd (exit %d): %s" % (
            ctl.returncode, ctl.stderr.read())
        for s in held:
            s.close()
        d.proc.send_signal(signal.SIGCONT)
        out, err = ctl.communicate(timeout=90)
        assert ctl.returncode == 0, (ctl.returncode, err)
        print("ok: ckptctl waited for the busy ckptd and got its status")
    finally:
        for s in held:
            s.close()
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
        d.stop()

    # Nothing listens any more: ckptctl fails at once.
    t0 = time.monotonic()
    p = subprocess.run([harness.CKPTCTL, "--socket=" + d.socket, "--timeout=60", "status"],
                       capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert p.returncode == 3 and "cannot reach ckptd" in p.stderr, (p.returncode, p.stderr)
    assert took < 30, "ckptctl waited %.1f s for a socket nobody listens on" % took
    print("ok: no ckptd: exit 3 after %.2f s" % took)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
