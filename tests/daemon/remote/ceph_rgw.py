#!/usr/bin/env python3
"""A throwaway one-node Ceph cluster (one monitor, one BlueStore OSD, radosgw)
serving S3 on 127.0.0.1, for ckptd's remote-tier tests.

Standard library only: it runs under any python3 >= 3.8 with or without a
virtual environment. It needs Debian's ceph-mon, ceph-osd, radosgw and
ceph-common packages.

Everything lives under one root directory: ceph.conf, keyrings, monitor and
OSD data (BlueStore on a sparse file), logs, pid files, admin sockets and a
state file (cluster.json). Nothing is written under /etc/ceph, /var/lib/ceph
or /var/log/ceph.

Module use:

    with CephRgw(tmpdir) as c:
        c.write_credentials(path)            # for ckptd
        c.endpoint, c.bucket, c.region       # "http://127.0.0.1:PORT", ...
        c.kill_rgw(); c.start_rgw()          # crash/restart the S3 server
        status, hdrs, body = c.s3("GET", "some/key")

CLI:

    ceph_rgw.py start ROOT [--rgw-port P] [--mon-port P] [--timeout S]
        start (or restart) the cluster, print one JSON line
        {endpoint, bucket, access_key, secret_key, region}, leave it running
    ceph_rgw.py stop ROOT        stop the daemons recorded in ROOT/pids.json
    ceph_rgw.py selftest [--keep]
        cold start in a temporary directory, 10 MiB PUT/GET/LIST/DELETE,
        radosgw SIGKILL + restart, durability check, timings

SigV4 region: radosgw verifies the signature with whatever region the
request's credential scope names, so any string signs correctly (checked on
16.2.15: "us-east-1", "default", "xx-test-1" and "" all work). `region` is
"us-east-1", what S3 clients assume by default. Only CreateBucket looks at
regions: a LocationConstraint body must name the zonegroup ("default"; a
"us-east-1" constraint gets 400), and no body at all is accepted.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import datetime
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid

__all__ = ["CephRgw", "CephRgwError", "sigv4_request"]

MON_ID = "a"
OSD_ID = 0
RGW_NAME = "client.rgw.gw"
DAEMONS = ("mon", "osd", "rgw")
DEFAULT_BLOCK_BYTES = 8 << 30  # sparse; only what is written takes disk space


class CephRgwError(RuntimeError):
    pass


# --------------------------------------------------------------------------
# small helpers

def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (all held open while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cephx_key() -> str:
    """A new cephx secret: CryptoKey{type=AES(1), created, len=16, secret}."""
    now = time.time()
    raw = struct.pack("<HIIH", 1, int(now), int((now % 1) * 1e9), 16)
    return base64.b64encode(raw + secrets.token_bytes(16)).decode()


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"({path}: {e.strerror})"
    return "\n".join(data.splitlines()[-lines:])


def _write_file(path: str, text: str, mode: int = 0o644) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _pid_state(pid: int) -> str | None:
    """The /proc state letter of pid, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:][:1].decode()


def _pid_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return []


def _admin_socket(path: str, prefix: str, timeout: float = 2.0) -> dict | None:
    """One command on a Ceph admin socket; None if the daemon is not there."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(json.dumps({"prefix": prefix, "format": "json"}).encode() + b"\0")
            buf = b""
            while len(buf) < 4:
                chunk = s.recv(4 - len(buf))
                if not chunk:
                    return None
                buf += chunk
            (length,) = struct.unpack(">I", buf)
            out = b""
            while len(out) < length:
                chunk = s.recv(length - len(out))
                if not chunk:
                    return None
                out += chunk
        return json.loads(out or b"{}")
    except (OSError, ValueError):
        return None


def _clean_env() -> dict:
    """Environment for the Ceph tools: nothing from a venv, a sanitizer run or
    the caller's Ceph settings leaks in."""
    env = dict(os.environ)
    for k in ("PYTHONHOME", "PYTHONPATH", "LD_PRELOAD", "LD_LIBRARY_PATH",
              "CEPH_ARGS", "CEPH_CONF", "CEPH_KEYRING"):
        env.pop(k, None)
    env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin:" + env.get("PATH", "")
    return env


# --------------------------------------------------------------------------
# S3 SigV4 (enough for tests: path-style, single-shot requests)

def sigv4_request(endpoint: str, region: str, access_key: str, secret_key: str,
                  method: str, path: str, body: bytes = b"",
                  query: dict | None = None, headers: dict | None = None,
                  timeout: float = 60.0) -> tuple[int, dict, bytes]:
    """Sends one SigV4-signed S3 request; returns (status, headers, body).
    path is "/bucket" or "/bucket/key" (not yet percent-encoded)."""
    u = urllib.parse.urlsplit(endpoint)
    host = u.netloc
    payload_hash = hashlib.sha256(body).hexdigest()
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    hdrs = {k.lower(): str(v) for k, v in (headers or {}).items()}
    hdrs.update({"host": host, "x-amz-date": amz_date,
                 "x-amz-content-sha256": payload_hash})
    enc = lambda s: urllib.parse.quote(s, safe="-_.~")  # noqa: E731
    canon_uri = urllib.parse.quote(path, safe="/-_.~")
    canon_query = "&".join(f"{enc(k)}={enc(v)}"
                           for k, v in sorted((query or {}).items()))
    signed = sorted(hdrs)
    canon_headers = "".join(f"{k}:{' '.join(hdrs[k].split())}\n" for k in signed)
    creq = "\n".join([method, canon_uri, canon_query, canon_headers,
                      ";".join(signed), payload_hash])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(creq.encode()).hexdigest()])
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    hdrs["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                             f"SignedHeaders={';'.join(signed)}, Signature={sig}")
    target = canon_uri + ("?" + canon_query if canon_query else "")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request(method, target, body=body or None, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


# --------------------------------------------------------------------------

class CephRgw:
    """One monitor, one BlueStore OSD and radosgw under `root`.

    start() makes a fresh cluster (S3 user and bucket included) on an empty
    root and restarts the daemons of an existing one. Ports, keys and the
    bucket of an existing root are read from ROOT/cluster.json, so they stay
    the same across restarts and across processes."""

    region = "us-east-1"

    def __init__(self, root: str, rgw_port: int | None = None,
                 mon_port: int | None = None, *, bucket: str = "ckpt",
                 block_bytes: int = DEFAULT_BLOCK_BYTES,
                 stop_at_exit: bool = True):
        self.root = os.path.abspath(root)
        self.conf = os.path.join(self.root, "ceph.conf")
        self._state_path = os.path.join(self.root, "cluster.json")
        self._pids_path = os.path.join(self.root, "pids.json")
        self._stop_at_exit = stop_at_exit
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.RLock()
        self._atexit_registered = False
        self._owner_pid = os.getpid()
        self._env = _clean_env()

        state = self._load_state()
        if state is None:
            picked = _free_ports(2)
            state = {
                "fsid": str(uuid.uuid4()),
                "osd_uuid": str(uuid.uuid4()),
                "mon_port": mon_port or picked[0],
                "rgw_port": rgw_port or picked[1],
                "bucket": bucket,
                "access_key": "CKPT" + secrets.token_hex(8).upper(),
                "secret_key": secrets.token_hex(20),
                "block_bytes": int(block_bytes),
                "keys": {"mon.": _cephx_key(), "client.admin": _cephx_key(),
                         RGW_NAME: _cephx_key(), f"osd.{OSD_ID}": _cephx_key()},
                "setup_done": False,
            }
            if state["mon_port"] == state["rgw_port"]:
                raise ValueError("rgw_port and mon_port must differ")
        else:
            if mon_port and mon_port != state["mon_port"]:
                raise CephRgwError(f"{self.root} was created with monitor port "
                                   f"{state['mon_port']}, not {mon_port}")
            if rgw_port:
                state["rgw_port"] = rgw_port
        self._state = state

    # -- public attributes --------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    @property
    def rgw_port(self) -> int:
        return self._state["rgw_port"]

    @property
    def mon_port(self) -> int:
        return self._state["mon_port"]

    @property
    def bucket(self) -> str:
        return self._state["bucket"]

    @property
    def access_key(self) -> str:
        return self._state["access_key"]

    @property
    def secret_key(self) -> str:
        return self._state["secret_key"]

    def info(self) -> dict:
        return {"endpoint": self.endpoint, "bucket": self.bucket,
                "access_key": self.access_key, "secret_key": self.secret_key,
                "region": self.region}

    def write_credentials(self, path: str) -> None:
        _write_file(path, f"access_key_id = {self.access_key}\n"
                          f"secret_access_key = {self.secret_key}\n", 0o600)

    def s3(self, method: str, key: str = "", body: bytes = b"",
           query: dict | None = None, headers: dict | None = None,
           bucket: str | None = None, timeout: float = 60.0):
        """A signed request on bucket/key; returns (status, headers, body)."""
        path = "/" + (bucket or self.bucket) + ("/" + key if key else "")
        return sigv4_request(self.endpoint, self.region, self.access_key,
                             self.secret_key, method, path, body, query,
                             headers, timeout)

    def __enter__(self) -> "CephRgw":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- lifecycle ----------------------------------------------------------
    def start(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            self._register_atexit()
            try:
                if not self._state.get("setup_done"):
                    self._fresh_start(deadline)
                else:
                    self._restart(deadline)
            except BaseException:
                self.kill_all()  # a half-started cluster is of no use
                raise

    def start_rgw(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            self._register_atexit()
            self._spawn("rgw")
            try:
                self._wait_rgw(deadline)
            except BaseException:
                self.kill_rgw()
                raise

    def kill_rgw(self) -> None:
        with self._lock:
            self._signal_and_wait(["rgw"], signal.SIGKILL, 10.0)

    def kill_all(self) -> None:
        with self._lock:
            self._signal_and_wait(list(DAEMONS), signal.SIGKILL, 10.0)

    def stop(self) -> None:
        """SIGTERM radosgw, then the OSD, then the monitor (radosgw hangs in
        its shutdown when the OSD goes first); SIGKILL whatever is still there
        after a bounded wait. Safe to call any number of times."""
        with self._lock:
            for name in ("rgw", "osd", "mon"):
                if self._signal_and_wait([name], signal.SIGTERM, 10.0):
                    self._signal_and_wait([name], signal.SIGKILL, 10.0)

    def running(self) -> dict:
        """{daemon: pid} of the daemons alive now."""
        return {n: p for n, p in self._pids().items() if self._alive(n, p)}

    # -- setup --------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _load_state(self) -> dict | None:
        try:
            with open(self._state_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise CephRgwError(f"{self._state_path}: {e}") from None

    def _save_state(self) -> None:
        _write_file(self._state_path, json.dumps(self._state, indent=1) + "\n", 0o600)

    def _write_conf(self) -> None:
        r, s = self.root, self._state
        conf = f"""\
[global]
fsid = {s['fsid']}
mon host = [v2:127.0.0.1:{s['mon_port']}]
public addr = 127.0.0.1
ms bind msgr1 = false
ms bind msgr2 = true
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {r}/keyring
run dir = {r}/run
crash dir = {r}/crash
pid file = {r}/run/$name.pid
log file = {r}/log/$name.log
mon cluster log file = {r}/log/cluster.log
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
paxos propose interval = 0.01
paxos min wait = 0.01
rgw_rados_pool_pg_num_min = 8
# PGs of a killed OSD wait out the read lease (ratio x heartbeat grace,
# 16 s by default) before serving; one OSD needs no lease.
osd pool default read lease ratio = 0.05

[mon]
admin socket = {r}/run/$name.asok
mon data = {r}/mon/$id

[osd]
admin socket = {r}/run/$name.asok
osd data = {r}/osd/$id
keyring = $osd_data/keyring
osd objectstore = bluestore
bluestore block create = true
bluestore block size = {s['block_bytes']}
bluestore fsck on mkfs = false
bluestore fsck on mount = false
bluestore cache autotune = false
bluestore cache size = 134217728
osd memory target = 939524096
osd op num shards = 2
osd op num threads per shard = 2

[{RGW_NAME}]
admin socket = {r}/run/$name.asok
rgw data = {r}/rgw
rgw frontends = beast endpoint=127.0.0.1:{s['rgw_port']}
rgw thread pool size = 128
# Ask the monitor for a new OSD map soon when an op stalls (10 s by default).
objecter timeout = 2
objecter tick interval = 1
"""
        _write_file(self.conf, conf)

    def _write_keyring(self) -> None:
        k = self._state["keys"]
        caps = {
            "mon.": {"mon": "allow *"},
            "client.admin": {"mon": "allow *", "osd": "allow *",
                             "mds": "allow *", "mgr": "allow *"},
            RGW_NAME: {"mon": "allow rw", "osd": "allow rwx", "mgr": "allow rw"},
        }
        text = ""
        for name, c in caps.items():
            text += f"[{name}]\n\tkey = {k[name]}\n"
            text += "".join(f'\tcaps {t} = "{v}"\n' for t, v in c.items())
        _write_file(self._path("keyring"), text, 0o600)

    def _run(self, argv: list[str], deadline: float, what: str,
             stdin: str | None = None) -> str:
        remaining = max(1.0, deadline - time.monotonic())
        try:
            p = subprocess.run(argv, input=stdin, capture_output=True, text=True,
                               env=self._env, timeout=remaining)
        except subprocess.TimeoutExpired:
            raise CephRgwError(f"{what}: timed out: {' '.join(argv)}") from None
        if p.returncode != 0:
            raise CephRgwError(f"{what} failed (exit {p.returncode}): "
                               f"{' '.join(argv)}\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def _ceph(self, args: list[str], deadline: float, what: str,
              stdin: str | None = None) -> str:
        t = int(max(2, min(60, deadline - time.monotonic())))
        return self._run(["ceph", "-c", self.conf, "--connect-timeout", str(t)]
                         + args, deadline, what, stdin)

    def _wipe_partial(self) -> None:
        """Remove what an interrupted fresh start left (only our own names)."""
        self._signal_and_wait(list(DAEMONS), signal.SIGKILL, 10.0)
        for d in ("mon", "osd", "rgw", "run", "crash"):
            shutil.rmtree(self._path(d), ignore_errors=True)
        for f in ("monmap", "keyring", "ceph.conf", "pids.json"):
            try:
                os.unlink(self._path(f))
            except FileNotFoundError:
                pass

    def _fresh_start(self, deadline: float) -> None:
        os.makedirs(self.root, exist_ok=True)
        if os.path.exists(self._path("mon")):
            self._wipe_partial()
        for d in ("run", "log", "crash", "rgw", "mon", f"osd/{OSD_ID}"):
            os.makedirs(self._path(d), exist_ok=True)
        self._save_state()
        self._write_conf()
        self._write_keyring()
        s = self._state
        osd_dir = self._path("osd", str(OSD_ID))
        _write_file(os.path.join(osd_dir, "keyring"),
                    f"[osd.{OSD_ID}]\n\tkey = {s['keys'][f'osd.{OSD_ID}']}\n", 0o600)

        # The OSD's mkfs needs no monitor: run it while the monitor starts.
        with open(self._path("log", "osd-mkfs.out"), "wb") as out:
            osd_mkfs = subprocess.Popen(
                ["ceph-osd", "-c", self.conf, "-i", str(OSD_ID), "--mkfs",
                 "--osd-uuid", s["osd_uuid"], "--no-mon-config"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self._env, start_new_session=True)
        try:
            monmap = self._path("monmap")
            self._run(["monmaptool", "--create", "--clobber", "--fsid", s["fsid"],
                       "--addv", MON_ID, f"[v2:127.0.0.1:{s['mon_port']}]", monmap],
                      deadline, "monmaptool")
            self._run(["ceph-mon", "-c", self.conf, "-i", MON_ID, "--mkfs",
                       "--monmap", monmap, "--keyring", self._path("keyring")],
                      deadline, "ceph-mon --mkfs")
            self._spawn("mon")
            self._wait_mon(deadline)
            secret = json.dumps({"cephx_secret": s["keys"][f"osd.{OSD_ID}"]})
            self._ceph(["osd", "new", s["osd_uuid"], str(OSD_ID), "-i", "-"],
                       deadline, "ceph osd new", stdin=secret)
            try:
                rc = osd_mkfs.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise self._error("ceph-osd --mkfs timed out", "osd-mkfs")
            if rc != 0:
                raise self._error(f"ceph-osd --mkfs failed (exit {rc})", "osd-mkfs")
        finally:
            if osd_mkfs.poll() is None:
                osd_mkfs.kill()
                osd_mkfs.wait()
        self._spawn("osd")
        self._spawn("rgw")
        self._wait_osd(deadline)
        self._wait_rgw(deadline)

        self._run(["radosgw-admin", "-c", self.conf, "user", "create",
                   "--uid", "ckpt", "--display-name", "ckpt tests",
                   "--access-key", s["access_key"], "--secret", s["secret_key"]],
                  deadline, "radosgw-admin user create")
        self._create_bucket(deadline)
        s["setup_done"] = True
        self._save_state()

    def _create_bucket(self, deadline: float) -> None:
        # A user created a moment ago may take a moment to reach radosgw's cache.
        last = None
        while True:
            try:
                st, _, body = self.s3("PUT", timeout=max(1.0, deadline - time.monotonic()))
                if st in (200, 409) and (st == 200 or b"BucketAlreadyOwnedByYou" in body):
                    return
                last = f"HTTP {st}: {body[:500]!r}"
            except OSError as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise self._error(f"creating bucket {self.bucket}: {last}", "rgw")
            time.sleep(0.2)

    def _restart(self, deadline: float) -> None:
        self._save_state()  # rgw_port may have been changed
        self._write_conf()
        # The OSD waits for the monitor itself. radosgw starts once the OSD is
        # up: before that the OSD map still names the previous OSD's address.
        self._spawn("mon")
        self._spawn("osd")
        self._wait_mon(deadline)
        self._wait_osd(deadline)
        self._spawn("rgw")
        self._wait_rgw(deadline)

    # -- daemons ------------------------------------------------------------
    def _argv(self, name: str) -> list[str]:
        base = {"mon": ["ceph-mon", "-i", MON_ID],
                "osd": ["ceph-osd", "-i", str(OSD_ID)],
                "rgw": ["radosgw", "-n", RGW_NAME]}[name]
        return base + ["-f", "-c", self.conf]

    def _log(self, name: str) -> str:
        return self._path("log", {"mon": f"mon.{MON_ID}.log",
                                  "osd": f"osd.{OSD_ID}.log",
                                  "rgw": f"{RGW_NAME}.log"}.get(name, name + ".log"))

    def _error(self, msg: str, name: str) -> CephRgwError:
        parts = [msg]
        log = self._log(name)
        if os.path.exists(log):
            parts.append(f"--- tail of {log}\n{_tail(log)}")
        out = self._path("log", name + ".out")
        if os.path.exists(out) and os.path.getsize(out):
            parts.append(f"--- tail of {out}\n{_tail(out, 20)}")
        return CephRgwError("\n".join(parts))

    def _pids(self) -> dict:
        try:
            with open(self._pids_path) as f:
                return {k: int(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            return {}

    def _save_pids(self, pids: dict) -> None:
        _write_file(self._pids_path, json.dumps(pids) + "\n")

    def _alive(self, name: str, pid: int) -> bool:
        proc = self._procs.get(name)
        if proc is not None and proc.pid == pid:
            return proc.poll() is None
        st = _pid_state(pid)
        if st is None or st in "ZX":
            return False
        # Guard against pid reuse: it must be our daemon on our conf.
        cmd = _pid_cmdline(pid)
        prog = os.path.basename(cmd[0]) if cmd else ""
        return self.conf in cmd and prog in (self._argv(name)[0], "setpriv")

    def _spawn(self, name: str) -> None:
        pids = self._pids()
        if name in pids and self._alive(name, pids[name]):
            return  # already running
        argv = self._argv(name)
        # Die with this process if it is killed outright (only where the
        # parent-death signal is tied to a thread that lives as long as the
        # process, i.e. when spawned from the main thread).
        if (self._stop_at_exit and shutil.which("setpriv")
                and threading.current_thread() is threading.main_thread()):
            argv = ["setpriv", "--pdeathsig", "KILL", "--"] + argv
        with open(self._path("log", name + ".out"), "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self._env,
                                    cwd=self.root, start_new_session=True,
                                    close_fds=True)
        self._procs[name] = proc
        pids[name] = proc.pid
        self._save_pids(pids)

    def _signal_and_wait(self, names: list[str], sig: int, wait: float) -> list[str]:
        """Sends sig to the named daemons; returns those still alive after
        `wait` seconds. Never raises for daemons that are already gone."""
        pids = self._pids()
        targets = {}
        for n in names:
            pid = pids.get(n)
            if pid is None and n in self._procs:
                pid = self._procs[n].pid
            if pid is not None and self._alive(n, pid):
                try:
                    os.kill(pid, sig)
                    targets[n] = pid
                except ProcessLookupError:
                    pass
        end = time.monotonic() + wait
        while targets and time.monotonic() < end:
            targets = {n: p for n, p in targets.items() if self._alive(n, p)}
            if targets:
                time.sleep(0.05)
        gone = [n for n in names if n not in targets]
        for n in gone:
            proc = self._procs.pop(n, None)
            if proc is not None:
                try:
                    proc.wait(1)
                except subprocess.TimeoutExpired:
                    pass
            pids.pop(n, None)
        if os.path.isdir(self.root):
            self._save_pids(pids)
        return list(targets)

    def _register_atexit(self) -> None:
        if self._stop_at_exit and not self._atexit_registered:
            self._owner_pid = os.getpid()
            atexit.register(self._atexit_stop)
            self._atexit_registered = True

    def _atexit_stop(self) -> None:
        try:
            # Not in a forked child that exits through sys.exit().
            if self._procs and os.getpid() == self._owner_pid:
                self.stop()
        except Exception:  # never fail interpreter exit
            pass

    # -- readiness ----------------------------------------------------------
    def _check_alive(self, names: tuple) -> None:
        pids = self._pids()
        for n in names:
            if n in pids and not self._alive(n, pids[n]):
                proc = self._procs.get(n)
                rc = proc.returncode if proc is not None else "?"
                raise self._error(f"{n} daemon exited (status {rc})", n)

    def _wait(self, deadline: float, what: str, log: str, check, watch: tuple) -> None:
        delay = 0.02
        while True:
            if check():
                return
            self._check_alive(watch)
            if time.monotonic() > deadline:
                raise self._error(f"timed out waiting for {what}", log)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _wait_mon(self, deadline: float) -> None:
        asok = self._path("run", f"mon.{MON_ID}.asok")

        def ok():
            st = _admin_socket(asok, "mon_status")
            return bool(st) and st.get("state") == "leader"
        self._wait(deadline, "the monitor to form a quorum", "mon", ok, ("mon",))

    def _wait_osd(self, deadline: float) -> None:
        asok = self._path("run", f"osd.{OSD_ID}.asok")

        def ok():
            st = _admin_socket(asok, "status")
            return bool(st) and st.get("state") == "active"
        self._wait(deadline, "the OSD to be up", "osd", ok, ("mon", "osd"))

    def _rgw_serves(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.rgw_port, timeout=2)
            try:
                conn.request("GET", "/")
                return b"ListAllMyBucketsResult" in conn.getresponse().read()
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            return False

    def _wait_rgw(self, deadline: float) -> None:
        self._wait(deadline, f"radosgw to serve HTTP on port {self.rgw_port}",
                   "rgw", self._rgw_serves, ("mon", "osd", "rgw"))


# --------------------------------------------------------------------------
# CLI

def _selftest(keep: bool) -> int:
    root = tempfile.mkdtemp(prefix="ceph_rgw_selftest.")
    size = 10 << 20
    data = os.urandom(size)
    key = "selftest/obj 1+x"
    c = CephRgw(root)
    t = {}
    try:
        t0 = time.monotonic()
        c.start()
        t["cold_start_s"] = time.monotonic() - t0
        st, _, body = c.s3("PUT", key, data)
        assert st == 200, (st, body)
        t["cold_start_to_first_put_s"] = time.monotonic() - t0
        st, h, body = c.s3("GET", key)
        assert st == 200 and body == data, (st, len(body))
        st, _, body = c.s3("GET", query={"list-type": "2", "prefix": "selftest/"})
        assert st == 200 and b"<Key>selftest/obj 1+x</Key>" in body, (st, body)

        c.kill_rgw()
        assert not c._rgw_serves()
        t1 = time.monotonic()
        c.start_rgw()
        t["rgw_restart_s"] = time.monotonic() - t1
        st, _, body = c.s3("GET", key)
        assert st == 200 and body == data, ("after rgw restart", st, len(body))

        c.kill_all()
        t2 = time.monotonic()
        c.start()
        t["restart_after_kill_all_s"] = time.monotonic() - t2
        st, _, body = c.s3("GET", key)
        assert st == 200 and body == data, ("after kill_all", st, len(body))

        st, _, body = c.s3("DELETE", key)
        assert st == 204, (st, body)
        st, _, _ = c.s3("HEAD", key)
        assert st == 404, st
        creds = os.path.join(root, "credentials")
        c.write_credentials(creds)
        assert os.stat(creds).st_mode & 0o777 == 0o600

        t3 = time.monotonic()
        c.stop()
        t["stop_s"] = time.monotonic() - t3
        assert not c.running(), c.running()
        c.stop()  # second stop is a no-op
        t["ok"] = True
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                          for k, v in t.items()}))
        return 0
    finally:
        c.stop()
        if keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start")
    p.add_argument("root")
    p.add_argument("--rgw-port", type=int)
    p.add_argument("--mon-port", type=int)
    p.add_argument("--timeout", type=float, default=90)
    p = sub.add_parser("stop")
    p.add_argument("root")
    p = sub.add_parser("selftest")
    p.add_argument("--keep", action="store_true", help="keep the temporary root")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "start":
            c = CephRgw(a.root, a.rgw_port, a.mon_port, stop_at_exit=False)
            c.start(a.timeout)
            print(json.dumps(c.info()), flush=True)
        elif a.cmd == "stop":
            if os.path.exists(os.path.join(a.root, "cluster.json")):
                CephRgw(a.root, stop_at_exit=False).stop()
        else:
            return _selftest(a.keep)
    except CephRgwError as e:
        print(f"ceph_rgw: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
