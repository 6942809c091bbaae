"""A damaged index never deletes acknowledged data (docs/reliability.md).

Two jobs commit versions through a real ckptd; job A's records are flushed
into an SST by a restart, job B's stay in the live WAL. The bytes of every
acknowledged version are recorded (a restore at its step), ckptd is stopped,
and the data directory kept. Each case starts from that copy and damages one
length field of a RocksDB log record, as a torn-looking record does:

  wal_length       a record in the middle of the newest WAL claims more bytes
                   than the file has: RocksDB takes it for a crash-torn tail
                   and opens the index without it and every later record
  manifest_length  the newest MANIFEST's edit that names the SST (the flush
                   that moved job A's records out of a WAL that is gone)
                   likewise: the index opens without job A
  manifest_head    the MANIFEST's first record: RocksDB cannot open the
                   index at all; ckptd refuses (exit 78) naming `ckptctl
                   repair`, which moves the index aside and builds a new one

Then: ckptd starts on the damaged index (or refuses, naming `ckptctl
repair`); every layer file it finds without a record is moved to
quarantine/, never deleted (checked: every file of the pristine copy is
still on disk, byte for byte). ckptd is stopped, `ckptctl repair
--data-dir` rebuilds the index, ckptd starts again, and every acknowledged
version is restored at its step and compared with the recorded bytes.
Prints per case: versions acknowledged, files quarantined, records added by
repair, versions lost (must be 0). Also: repair is refused while ckptd runs.
"""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

STEPS = 10
TRAINER = ["--layers=4", "--layer-bytes=64K,128K", "--policy=explicit"]
JOBS = {"ix-a": 1, "ix-b": 2}  # job -> trainer seed
DAEMON_EXTRA = ["--gc_interval_s=0"]


def safetensors_hashes(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack_from("<Q", raw, 0)[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    return {name: hashlib.sha256(body[m["data_offsets"][0]:m["data_offsets"][1]]).hexdigest()
            for name, m in header.items() if name != "__metadata__"}


def restore_layers(d, job, step, out_dir):
    """{(layer, step): {tensor: sha256}} of a ckptctl restore at `step`, or None."""
    shutil.rmtree(out_dir, ignore_errors=True)
    r = d.ctl_raw("--json", "--timeout=60", "restore", job, "--out=" + out_dir, "--step=%d" % step)
    if r.returncode != 0:
        return None
    rank = json.loads(r.stdout)["ranks"][0]
    hashes = safetensors_hashes(os.path.join(out_dir, rank["file"]))
    return {(l["layer"], l["step"]): {t: hashes[t] for t in l["tensors"]} for l in rank["layers"]}


def layer_files(data):
    """{relative path under jobs/: sha256} of every committed layer file."""
    out = {}
    root = os.path.join(data, "jobs")
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".ckv"):
                p = os.path.join(dirpath, f)
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def files_anywhere(data):
    """sha256 of every layer file under jobs/ and quarantine/ (by content)."""
    seen = set()
    for sub in ("jobs", "quarantine"):
        for dirpath, _, files in os.walk(os.path.join(data, sub)):
            for f in files:
                if ".ckv" in f:
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        seen.add(hashlib.sha256(fh.read()).hexdigest())
    return seen


def log_records(path):
    """(offset of the record header, payload length) of each record of a
    RocksDB log file (WAL or MANIFEST): 32 KiB blocks of crc32c(4)
    length(2) type(1) payload."""
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
            break
        out.append((off, length))
        off += 7 + length
    return out


def set_length(path, rec_off, length):
    with open(path, "r+b") as f:
        f.seek(rec_off + 4)
        f.write(struct.pack("<H", length))


def newest(idx, pred):
    names = [n for n in os.listdir(idx) if pred(n) and os.path.getsize(os.path.join(idx, n))]
    return os.path.join(idx, max(names, key=lambda n: int("".join(c for c in n if c.isdigit()))))


class Bench:
    def __init__(self, root):
        self.root = root
        self.pristine = os.path.join(root, "pristine")
        self.refs = {}  # job -> {(layer, step): {tensor: sha256}}

    def daemon(self):
        return harness.Daemon(os.path.join(self.root, "d"), extra=DAEMON_EXTRA)

    def train(self, d, job):
        out = harness.run_trainer(d, job, "--steps=%d" % STEPS, "--seed=%d" % JOBS[job], *TRAINER)
        assert out.returncode == 0, out.stdout + out.stderr
        deadline = time.time() + 60
        while d.ctl("plan", job)["target_step"] < STEPS:
            assert time.time() < deadline, "job %s never became durable" % job
            time.sleep(0.1)

    def record(self, d, job):
        refs = {}
        for step in range(1, STEPS + 1):
            got = restore_layers(d, job, step, os.path.join(self.root, "ref"))
            if got:
                refs.update(got)
        self.refs[job] = refs

    def setup(self):
        d = self.daemon()
        d.start()
        jobs = list(JOBS)
        self.train(d, jobs[0])
        assert d.stop() == 0, d.log()
        d.start()  # job A's records move from the WAL into an SST
        self.train(d, jobs[1])
        for job in jobs:
            self.record(d, job)
        assert d.stop() == 0, d.log()
        shutil.copytree(d.data, self.pristine, symlinks=True)
        self.files = layer_files(d.data)
        acked = sum(len(r) for r in self.refs.values())
        assert acked == len(self.files), (acked, len(self.files))
        return acked

    def repair_refused_while_running(self):
        d = self.daemon()
        self.reset(d)
        d.start()
        try:
            r = subprocess.run([harness.CKPTCTL, "repair", "--data-dir=" + d.data],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 5, (r.returncode, r.stdout, r.stderr)
            assert "FAILED_PRECONDITION" in r.stderr and "ckptd.lock" in r.stderr, r.stderr
            print("repair while ckptd runs: refused: %s" % r.stderr.strip())
        finally:
            assert d.stop() == 0, d.log()

    def reset(self, d):
        shutil.rmtree(d.root, ignore_errors=True)
        os.makedirs(d.root)
        shutil.copytree(self.pristine, d.data, symlinks=True)

    def case(self, kind):
        d = self.daemon()
        self.reset(d)
        idx = os.path.join(d.data, "index")
        if kind == "wal_length":
            wal = newest(idx, lambda n: n.endswith(".log"))
            recs = log_records(wal)
            off, _ = recs[len(recs) // 2]
            set_length(wal, off, 0xffff)
        elif kind == "manifest_length":
            # The newest edit that names SST files (the largest of the last
            # records; the very last one only moves the log number on).
            man = newest(idx, lambda n: n.startswith("MANIFEST-"))
            recs = log_records(man)
            off, _ = max(recs[len(recs) // 2:], key=lambda r: (r[1], r[0]))
            set_length(man, off, 0xffff)
        elif kind == "manifest_head":
            man = newest(idx, lambda n: n.startswith("MANIFEST-"))
            set_length(man, log_records(man)[0][0], 0xffff)
        else:
            raise ValueError(kind)
        # 1. Start-up on the damaged index: never deletes a layer file.
        before = files_anywhere(d.data)
        started = True
        try:
            d.start()
        except RuntimeError:
            started = False
            assert d.proc.returncode == 78, d.proc.returncode
            assert "ckptctl repair --data-dir=" in d.log(), d.log()
        quarantined = 0
        if started:
            status = d.ctl("status")
            quarantined = int(status.get("files_quarantined", 0))
            assert d.stop() == 0, d.log()
        after = files_anywhere(d.data)
        deleted = len(before - after)
        print("%s: ckptd %s; files quarantined %d, layer files deleted %d" % (
            kind, "started on the damaged index" if started else "refused to start",
            quarantined, deleted))
        assert deleted == 0, "start-up deleted %d layer files" % deleted
        assert set(self.files.values()) <= after, "a layer file of the pristine copy is gone"
        # 2. Offline repair.
        r = subprocess.run([harness.CKPTCTL, "--json", "repair", "--data-dir=" + d.data],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        rep = json.loads(r.stdout)
        # 3. Every acknowledged version restores with its recorded bytes.
        d.start()
        try:
            lost = 0
            acked = 0
            for job, refs in self.refs.items():
                got_at = {}
                for (layer, step), want in sorted(refs.items()):
                    acked += 1
                    if step not in got_at:
                        got_at[step] = restore_layers(d, job, step, os.path.join(self.root, "out"))
                    got = (got_at[step] or {}).get((layer, step))
                    if got != want:
                        lost += 1
                        print("LOST: %s: job %s layer %d step %d" % (kind, job, layer, step))
                v = d.ctl_raw("--json", "verify", job, "--deep")
                assert v.returncode == 0, v.stdout + v.stderr
        finally:
            assert d.stop() == 0, d.log()
        print("FIGURES %s: acknowledged=%d quarantined=%d repair_records_added=%d "
              "repair_files_unquarantined=%d repair_events_added=%d index_rebuilt=%s lost=%d" % (
                  kind, acked, quarantined, rep["records_added"], rep["files_unquarantined"],
                  rep["events_added"], rep["index_rebuilt"], lost))
        assert lost == 0, "%d acknowledged versions lost after repair" % lost
        return quarantined, rep


def main():
    root = harness.tempdir("ckpt-ixrepair-")
    try:
        b = Bench(root)
        acked = b.setup()
        print("acknowledged %d versions of %d jobs" % (acked, len(JOBS)))
        b.repair_refused_while_running()
        for kind in ("wal_length", "manifest_length", "manifest_head"):
            quarantined, rep = b.case(kind)
            # The damage must have bitten: the index lost records that only
            # the files could give back.
            assert rep["records_added"] > 0, "%s: the damage had no effect: %s" % (kind, rep)
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
