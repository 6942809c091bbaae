"""Silent corruption at rest against a real ckptd (bit rot and truncation in
docs/reliability.md).

A trainer commits versions of two jobs; the bytes of every version are
recorded (sha256 of each tensor, from restores taken before any damage), and
the data directory is kept as a pristine copy. Each trial starts from that
copy and damages it once:

  layer files   flip 1-4 random bits inside the checksummed bytes (prefix,
                header body, tensor payload), flip bits in padding only
                (harmless: nothing reads it as data), truncate, or delete a
                committed file; with the daemon running or stopped
  index         flip bytes in RocksDB's SST, in a WAL record's payload, anywhere
                in the WAL or MANIFEST, truncate the WAL, delete CURRENT,
                MANIFEST or an SST (daemon stopped)

then runs `ckptctl verify --deep`, `ckptctl restore` (at the damaged
version's step and at the latest step) and a client restore (the example
trainer's --restore --verify-log). Each must give an error (DATA_LOSS for
damaged bytes) or bytes equal to the recorded ones of the version the plan
names (an older version when start-up recovery dropped a broken record) --
never wrong bytes. A damaged index makes ckptd exit at once with a clear error
(fail-stop; required for damaged SST blocks and WAL records and missing
files). Damage RocksDB cannot tell from a write torn by a crash (a record
length pointing past the end of the WAL or MANIFEST, a truncated WAL) may
instead open an older state: counted as index_silent_loss, and even then only
verified bytes are served.

Prints the figures (damage injected / detected, served corrupt) on a line
starting with "FIGURES". CKPT_BITROT_TRIALS scales the trial count,
CKPT_BITROT_SEED picks the seed."""

import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time

import harness

SEED = int(os.environ.get("CKPT_BITROT_SEED", "7"))
FILE_TRIALS = int(os.environ.get("CKPT_BITROT_TRIALS", "12"))
INDEX_TRIALS = max(8, FILE_TRIALS // 2)
STEPS = 24
TRAINER = ["--layers=4", "--layer-bytes=64K,128K", "--policy=explicit"]
JOBS = {"rot-a": 1, "rot-b": 2}  # job -> trainer seed
DAEMON_EXTRA = ["--gc_interval_s=0"]


def safetensors_hashes(path):
    """sha256 of every tensor of a safetensors file, by name."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack_from("<Q", raw, 0)[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        out[name] = hashlib.sha256(body[begin:end]).hexdigest()
    return out


def ctl_restore(d, job, out_dir, step=None):
    """ckptctl restore; returns (returncode, manifest or None, stderr)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    args = ["--json", "--timeout=60", "restore", job, "--out=" + out_dir]
    if step:
        args.append("--step=%d" % step)
    r = d.ctl_raw(*args)
    manifest = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
    return r.returncode, manifest, r.stderr


def rank_dir(data, job):
    return os.path.join(data, "jobs", job, "rank-00000000")


def version_files(data, job):
    """{(layer, step): path} of the committed files of a job."""
    out = {}
    rd = rank_dir(data, job)
    for name in sorted(os.listdir(rd)):
        if name.endswith(".ckv"):
            out[(int(name[1:9], 16), int(name[11:27], 16))] = os.path.join(rd, name)
    return out


def regions(path):
    """(checksummed, padding) byte ranges of a layer file (daemon/store/format.h);
    the example trainer has one tensor per layer, at payload offset 0."""
    with open(path, "rb") as f:
        prefix = f.read(64)
    size = os.path.getsize(path)
    header_bytes, body_len = struct.unpack_from("<II", prefix, 12)
    payload = struct.unpack_from("<Q", prefix, 24)[0]
    covered = [(0, 64 + body_len), (header_bytes, header_bytes + payload)]
    padding = [(a, b) for a, b in [(64 + body_len, header_bytes), (header_bytes + payload, size)]
               if b > a]
    return covered, padding


def flip_bits(path, ranges, count, rng):
    total = sum(b - a for a, b in ranges)
    with open(path, "r+b") as f:
        for _ in range(count):
            k = rng.randrange(total)
            for a, b in ranges:
                if k < b - a:
                    off = a + k
                    break
                k -= b - a
            f.seek(off)
            c = f.read(1)[0]
            f.seek(off)
            f.write(bytes([c ^ (1 << rng.randrange(8))]))
        f.flush()
        os.fsync(f.fileno())


def flip_bytes(path, count, rng, lo=0):
    size = os.path.getsize(path)
    if size <= lo:
        return False
    with open(path, "r+b") as f:
        for _ in range(count):
            off = rng.randrange(lo, size)
            f.seek(off)
            c = f.read(1)[0]
            f.seek(off)
            f.write(bytes([c ^ (1 + rng.randrange(255))]))
    return True


def wal_payloads(path):
    """(offset, length) of each record payload of a RocksDB WAL (32 KiB blocks
    of records: crc32c(4) length(2) type(1) payload)."""
    with open(path, "rb") as f:
        data = f.read()
    out, off = [], 0
    while off + 7 <= len(data):
        left = 32768 - off % 32768
        if left < 7:
            off += left
            continue
        length = data[off + 4] | data[off + 5] << 8
        if data[off + 6] == 0 and length == 0:
            break  # preallocated zeros
        if length:
            out.append((off + 7, length))
        off += 7 + length
    return out


# Index damage ckptd must refuse to start on (the rest may also open to an
# older state -- a record length pointing past the end of the WAL or MANIFEST
# is indistinguishable from a write torn by a crash -- but never serve wrong
# bytes).
MUST_FAIL_STOP = {"flip_sst", "flip_wal_payload", "delete_current", "delete_sst",
                  "delete_manifest"}


class Bench:
    """The pristine data directory, the recorded bytes, and the trials."""

    def __init__(self, root):
        self.root = root
        self.rng = random.Random(SEED)
        self.fig = {}
        self.logs = {}
        self.refs = {}          # job -> {(layer, step): {tensor: sha256}}
        self.latest_plan = {}   # job -> {layer: step}
        self.latest_step = {}
        self.pristine = os.path.join(root, "pristine")

    def count(self, key, n=1):
        self.fig[key] = self.fig.get(key, 0) + n

    def daemon(self):
        return harness.Daemon(os.path.join(self.root, "d"), extra=DAEMON_EXTRA)

    def setup(self):
        d = self.daemon()
        d.start()
        jobs = list(JOBS)
        self.train(d, jobs[0])
        # A restart moves job A's records from the WAL into an SST; job B's
        # then stay in the live WAL: the index trials hit both.
        assert d.stop() == 0, d.log()
        d.start()
        self.train(d, jobs[1])
        for job in jobs:
            self.record(d, job)
        assert d.stop() == 0, d.log()
        shutil.copytree(d.data, self.pristine, symlinks=True)
        idx = os.listdir(os.path.join(d.data, "index"))
        assert any(f.endswith(".sst") for f in idx) and any(f.endswith(".log") for f in idx), idx

    def train(self, d, job):
        log = os.path.join(self.root, job + ".jsonl")
        self.logs[job] = log
        out = harness.run_trainer(d, job, "--steps=%d" % STEPS, "--seed=%d" % JOBS[job],
                                  "--log=" + log, *TRAINER)
        assert out.returncode == 0, out.stdout + out.stderr
        # Everything staged is durable before the references are taken.
        deadline = time.time() + 60
        while d.ctl("plan", job)["target_step"] < STEPS:
            assert time.time() < deadline, "job %s never became durable at step %d" % (job, STEPS)
            time.sleep(0.1)

    def record(self, d, job):
        refs = {}
        out_dir = os.path.join(self.root, "ref")
        for step in range(1, STEPS + 1):
            rc, m, err = ctl_restore(d, job, out_dir, step)
            if rc != 0:
                assert "NOT_FOUND" in err, err  # a step without an event
                continue
            rank = m["ranks"][0]
            hashes = safetensors_hashes(os.path.join(out_dir, rank["file"]))
            for l in rank["layers"]:
                refs[(l["layer"], l["step"])] = {t: hashes[t] for t in l["tensors"]}
            if step == STEPS:
                self.latest_plan[job] = {l["layer"]: l["step"] for l in rank["layers"]}
        files = version_files(d.data, job)
        assert set(files) == set(refs), "every version appears in some plan: %s vs %s" % (
            sorted(files), sorted(refs))
        self.refs[job] = refs

    def reset(self, d):
        shutil.rmtree(d.data, ignore_errors=True)
        shutil.copytree(self.pristine, d.data, symlinks=True)

    # ---- checks: never wrong bytes ----

    def check_ctl_restore(self, d, job, step):
        """Returns 'ok', 'older' (a verified fallback), 'error:CODE' or 'corrupt'."""
        rc, m, err = ctl_restore(d, job, os.path.join(self.root, "out"), step)
        if rc != 0:
            code = re.search(r"ckptctl: ([A-Z_]+):", err)
            assert rc == 1, (rc, err)
            return "error:" + (code.group(1) if code else "?")
        rank = m["ranks"][0]
        hashes = safetensors_hashes(os.path.join(self.root, "out", rank["file"]))
        older = False
        for l in rank["layers"]:
            want = self.refs[job].get((l["layer"], l["step"]))
            if want is None or any(hashes[t] != want[t] for t in l["tensors"]):
                print("SERVED CORRUPT: job %s layer %d step %d" % (job, l["layer"], l["step"]))
                return "corrupt"
            if step == STEPS or step is None:
                older |= self.latest_plan[job].get(l["layer"]) != l["step"]
        return "older" if older else "ok"

    def check_client_restore(self, d, job):
        out = harness.run_trainer(d, job, "--restore", "--steps=0", "--seed=%d" % JOBS[job],
                                  "--verify-log=" + self.logs[job], *TRAINER)
        if out.returncode == 3 or "MISMATCH" in out.stdout:
            print("SERVED CORRUPT to a client: job %s\n%s" % (job, out.stdout))
            return "corrupt"
        if out.returncode != 0:
            m = re.search(r"restore: ([A-Z_]+):", out.stderr)
            return "error:" + (m.group(1) if m else out.stderr.strip()[-80:])
        assert "verify: 4 of 4 layers match" in out.stdout, out.stdout
        return "ok"

    def tally(self, what, outcome):
        self.count("%s_%s" % (what, outcome.split(":")[0]))
        if outcome == "corrupt":
            self.count("served_corrupt")

    # ---- trials on layer files ----

    def file_trial(self, i):
        kinds = ["flip", "truncate", "flip", "delete", "flip_padding", "flip"]
        kind = kinds[i % len(kinds)]
        running = (i + i // len(kinds)) % 2 == 0  # every kind both ways over 12 trials
        job = self.rng.choice(list(JOBS))
        d = self.daemon()
        self.reset(d)
        files = version_files(d.data, job)
        latest = [(l, s) for l, s in self.latest_plan[job].items()]
        victim = self.rng.choice(latest) if self.rng.random() < 0.6 else self.rng.choice(sorted(files))
        path = files[victim]
        if running:
            d.start()

        covered, padding = regions(path)
        if kind == "flip":
            flip_bits(path, covered, 1 + self.rng.randrange(4), self.rng)
        elif kind == "flip_padding":
            if not padding:
                kind = "flip"
                flip_bits(path, covered, 1, self.rng)
            else:
                flip_bits(path, padding, 1 + self.rng.randrange(4), self.rng)
        elif kind == "truncate":
            with open(path, "r+b") as f:
                f.truncate(self.rng.randrange(os.path.getsize(path)))
        elif kind == "delete":
            os.unlink(path)
        harmful = kind != "flip_padding"
        self.count("file_damage_%s_%s" % (kind, "running" if running else "stopped"))
        if harmful:
            self.count("damage_injected")
        if not running:
            d.start()
        try:
            detected = False
            st = d.ctl("status")
            if st.get("dangling_records_removed", 0) > 0:
                detected = True  # start-up recovery dropped the broken record
                self.count("detected_at_start")
                assert "BUG ALARM" in d.log()
            v = d.ctl_raw("--json", "verify", job, "--deep")
            assert v.returncode in (0, 4), (v.returncode, v.stderr)
            if v.returncode == 4:
                fails = json.loads(v.stdout)["failures"]
                assert any((f["layer"], f["step"]) == victim for f in fails), fails
                detected = True
                self.count("detected_by_verify")
                if not harmful:
                    self.count("padding_flip_flagged")
            r = self.check_ctl_restore(d, job, victim[1])
            self.tally("ctl_restore_at_victim", r)
            detected |= r == "error:DATA_LOSS"
            r = self.check_ctl_restore(d, job, STEPS)
            self.tally("ctl_restore_latest", r)
            r = self.check_client_restore(d, job)
            self.tally("client_restore", r)
            detected |= r == "error:DATA_LOSS"
            if harmful and detected:
                self.count("damage_detected")
            elif harmful:
                print("UNDETECTED: %s of job %s layer %d step %d (%s)" %
                      (kind, job, victim[0], victim[1], "running" if running else "stopped"))
            # Other versions are untouched and verify.
            for other in (j for j in JOBS if j != job):
                assert d.ctl("verify", other, "--deep")["failures"] == []
        finally:
            assert d.stop() == 0, d.log()

    # ---- trials on the index ----

    def index_trial(self, i):
        kinds = ["flip_sst", "flip_wal_payload", "flip_manifest", "truncate_wal", "delete_current",
                 "delete_sst", "delete_manifest", "flip_wal"]
        kind = kinds[i % len(kinds)]
        d = self.daemon()
        self.reset(d)
        idx = os.path.join(d.data, "index")
        names = sorted(os.listdir(idx))
        pick = lambda suffix: os.path.join(idx, self.rng.choice(
            [n for n in names if n.endswith(suffix) or n.startswith(suffix)]))
        if kind == "flip_sst":
            flip_bytes(pick(".sst"), 1 + self.rng.randrange(3), self.rng)
        elif kind == "flip_wal_payload":
            wals = [n for n in names if n.endswith(".log") and os.path.getsize(os.path.join(idx, n))]
            p = os.path.join(idx, self.rng.choice(wals))
            off, length = self.rng.choice(wal_payloads(p))
            with open(p, "r+b") as f:
                f.seek(off + self.rng.randrange(length))
                c = f.read(1)[0]
                f.seek(-1, 1)
                f.write(bytes([c ^ (1 << self.rng.randrange(8))]))
        elif kind == "flip_wal":
            wals = [n for n in names if n.endswith(".log") and os.path.getsize(os.path.join(idx, n))]
            flip_bytes(os.path.join(idx, self.rng.choice(wals)), 1 + self.rng.randrange(3), self.rng)
        elif kind == "flip_manifest":
            flip_bytes(pick("MANIFEST-"), 1 + self.rng.randrange(3), self.rng)
        elif kind == "truncate_wal":
            wals = [n for n in names if n.endswith(".log") and os.path.getsize(os.path.join(idx, n))]
            p = os.path.join(idx, self.rng.choice(wals))
            os.truncate(p, self.rng.randrange(os.path.getsize(p)))
        elif kind == "delete_current":
            os.unlink(os.path.join(idx, "CURRENT"))
        elif kind == "delete_sst":
            os.unlink(pick(".sst"))
        elif kind == "delete_manifest":
            os.unlink(pick("MANIFEST-"))
        self.count("index_damage_" + kind)
        self.count("index_damage_injected")
        try:
            d.start(timeout=60)
        except RuntimeError as e:
            rc = d.proc.returncode
            log = d.log()
            # Fail-stop: an exit with an error status (no signal, no hang)
            # and a line naming what failed.
            assert rc is not None and rc > 0, "ckptd did not exit cleanly: %s\n%s" % (rc, log)
            assert re.search(r"(index|start-up reconciliation): [A-Z_]+: ", log), log
            print("index %s: ckptd refused to start: %s" % (kind, [
                l for l in log.splitlines() if "index" in l or "reconciliation" in l][-1][:200]))
            self.count("index_fail_stop")
            return
        if kind in MUST_FAIL_STOP:
            self.count("index_damage_accepted")
            print("INDEX DAMAGE ACCEPTED: %s; ckptd started" % kind)
        try:
            self.count("index_started")
            outcomes = []
            for job in JOBS:
                v = d.ctl_raw("--json", "verify", job, "--deep")
                if v.returncode == 4:
                    self.count("index_verify_failures")
                r = self.check_ctl_restore(d, job, STEPS)
                self.tally("index_ctl_restore", r)
                outcomes.append(r)
                r = self.check_client_restore(d, job)
                self.tally("index_client_restore", r)
                outcomes.append(r)
            lost = [o for o in outcomes if o != "ok"]
            if lost and "corrupt" not in lost:
                # Acknowledged records are gone but nothing wrong is served.
                self.count("index_silent_loss")
                print("index %s: started; restores gave %s" % (kind, outcomes))
            else:
                self.count("index_no_effect" if not lost else "index_served_corrupt")
        finally:
            d.stop()


def main():
    root = harness.tempdir("ckpt-rot-")
    try:
        b = Bench(root)
        b.setup()
        print("recorded %d versions of %d jobs; seed %d" %
              (sum(len(r) for r in b.refs.values()), len(JOBS), SEED))
        for i in range(FILE_TRIALS):
            b.file_trial(i)
        for i in range(INDEX_TRIALS):
            b.index_trial(i)
        fig = b.fig
        print("FIGURES bitrot: " + " ".join("%s=%d" % kv for kv in sorted(fig.items())))
        assert fig.get("served_corrupt", 0) == 0, "wrong bytes were served"
        assert fig.get("damage_detected", 0) == fig.get("damage_injected", 0), \
            "damage went undetected: %s" % fig
        assert fig.get("index_damage_accepted", 0) == 0, "ckptd started on a damaged index"
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
