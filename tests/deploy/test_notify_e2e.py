"""End to end: a real ckptd reports to a fake service manager.

Starts the built ckptd with NOTIFY_SOCKET on a datagram socket this test binds
and WATCHDOG_USEC set, then checks: READY=1 arrives within 30 s and the gRPC
socket accepts connections by then; WATCHDOG=1 pings follow; after SIGTERM,
STOPPING=1 arrives and the process exits 0. Standard library only.

  test_notify_e2e.py CKPTD
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

WATCHDOG_USEC = 1000000  # pings every 0.5 s


def receive(sock, deadline):
    """The next datagram before `deadline` (time.time()), or None."""
    left = deadline - time.time()
    if left <= 0:
        return None
    sock.settimeout(left)
    try:
        return sock.recv(4096).decode(errors="replace")
    except socket.timeout:
        return None


def wait_for(sock, key, seconds, proc, seen):
    """Reads datagrams until one has the line `key`; records all in `seen`."""
    deadline = time.time() + seconds
    while True:
        msg = receive(sock, min(deadline, time.time() + 0.5))
        if msg is not None:
            seen.append(msg)
            if key in msg.split("\n"):
                return msg
        elif time.time() >= deadline:
            return None
        elif proc.poll() is not None and key != "STOPPING=1":
            return None


def main():
    ckptd = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="ckpt-notify-") as root:
        notify_path = os.path.join(root, "notify")
        mgr = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        mgr.bind(notify_path)
        grpc_socket = os.path.join(root, "run", "ckptd.sock")
        args = [ckptd, "--socket=" + grpc_socket, "--data_dir=" + os.path.join(root, "data"),
                "--staging_pool_bytes=67108864", "--shutdown_grace_ms=5000",
                "--metrics_address=127.0.0.1:0"]
        env = dict(os.environ)
        env["NOTIFY_SOCKET"] = notify_path
        env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        env.pop("WATCHDOG_PID", None)
        log_path = os.path.join(root, "ckptd.log")
        log = open(log_path, "w")
        proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
        seen = []
        failures = []
        try:
            ready = wait_for(mgr, "READY=1", 30, proc, seen)
            if ready is None:
                failures.append("no READY=1 within 30 s (ckptd %s)"
                                % ("exited %d" % proc.returncode if proc.poll() is not None
                                   else "still running"))
            else:
                print("ready: %r" % ready)
                if "STATUS=serving on " + grpc_socket not in ready.split("\n"):
                    failures.append("READY=1 without STATUS=serving on %s" % grpc_socket)
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    c.connect(grpc_socket)
                except OSError as e:
                    failures.append("READY=1 sent before %s accepts: %s" % (grpc_socket, e))
                finally:
                    c.close()
                pings = 0
                deadline = time.time() + 5
                while pings < 2 and time.time() < deadline:
                    if wait_for(mgr, "WATCHDOG=1", deadline - time.time(), proc, seen):
                        pings += 1
                print("watchdog pings: %d" % pings)
                if pings < 2:
                    failures.append("fewer than 2 WATCHDOG=1 in 5 s with WATCHDOG_USEC=%d"
                                    % WATCHDOG_USEC)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                stopping = wait_for(mgr, "STOPPING=1", 30, proc, seen)
                if stopping is None:
                    failures.append("no STOPPING=1 within 30 s of SIGTERM")
                else:
                    print("stopping: %r" % stopping)
                try:
                    rc = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                    failures.append("ckptd did not exit within 60 s of SIGTERM")
                if rc != 0:
                    failures.append("ckptd exited %d after SIGTERM" % rc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            mgr.close()
        if failures:
            print("FAILED:\n  " + "\n  ".join(failures))
            print("datagrams received: %r" % seen)
            with open(log_path) as f:
                print("ckptd log:\n" + f.read())
            return 1
        print("ok: READY=1, WATCHDOG=1 and STOPPING=1 arrived; ckptd exited 0")
        return 0


if __name__ == "__main__":
    sys.exit(main())
