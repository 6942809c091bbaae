"""Every resource attack at once, while another user trains.

ckptd runs as root with small, explicit bounds. uid 4242 trains 300 steps
with the example trainer and waits for every step to become durable. At the
same time uid 4243, in the socket's group like any trainer, runs every
resource attack that was ever reproduced against ckptd, each in its own
process, until the victim is done:

  aux                  1 MiB aux blobs through StepDone, never waiting
  disk                 16 MiB of layers per step, never waiting
  big_register         a 1 MiB layer name and ~12 MiB tensor tables, again and again
  registrations        more ranks than max_registrations_per_uid
  held_descriptors     registrations of 30 memfd regions each, kept alive
                       (a third uid): live registrations' descriptors and
                       mappings count against handover_max_fds_per_uid
  wide                 a stale registration of 1,000 layers, more than
                       max_layer_series: the victim's layers keep their series
  grpc_connections     2,000 idle connections to the gRPC socket
  handover_connections 200 idle connections to the handover socket
  handover_duplicates  one memfd listed 250 times per handover message
  handover_pending     handovers that are never claimed
  handover_lies        headers announcing descriptors they do not carry
  verify               `ckptctl verify --deep` and `status`, 8 at a time
                       (max_heavy_calls refuses them in the ordered check
                       that follows: two held at their slots, a third refused)

While they run, ckptd's RSS, open descriptors, mappings and data-directory
bytes are sampled every 0.1 s, and each uid's disk and index bytes and the
per-layer metric series at every scrape; all must stay under bounds derived
from the configuration (all printed). Afterwards: the victim kept every
step, each attack was refused by the bound meant for it, ckptd gives back
the attacker's descriptors, still serves, and stops cleanly. Last, a third
uid pushes three times the memory tier's budget through it: the victim's
restore still comes from memory in full.

Needs root and setpriv (two uids) and the Python client; exits 77 otherwise.
"""

import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

# The victim; the user whose calls attack through ckptd's API; the user
# who floods its sockets (a second attacker, so that the floods, which are
# refused per uid, do not only shut out the first one's calls).
VICTIM, ATTACKER, FLOODER, HOLDER, GROUP = 4242, 4243, 4245, 4246, 0
STEPS = 300
MiB = 1 << 20

BOUNDS = {
    "staging_pool_bytes": 32 * MiB,
    "max_message_bytes": 16 * MiB,
    "max_request_bytes": 3 * MiB,
    "max_large_calls": 2,
    "max_heavy_calls": 2,
    "max_calls_per_uid": 16,
    "max_connections_per_uid": 24,
    "max_connections": 64,
    "handover_max_connections_per_uid": 4,
    "handover_max_connections": 32,
    "handover_max_pending_per_uid": 16,
    "handover_max_fds_per_uid": 64,
    "handover_connection_deadline_ms": 1000,
    # Unclaimed handovers expire soon, so that the last handover of each
    # attack is answered for what it is rather than for the full table.
    "handover_token_ttl_s": 2,
    "max_registrations_per_uid": 8,
    "max_index_bytes_per_uid": 16 * MiB,
    "max_disk_bytes_per_uid": 96 * MiB,
    "max_queued_steps_per_rank": 8,
    "max_queued_steps_per_uid": 16,
    "max_layer_series": 256,
    "memory_tier_bytes": 8 * MiB,
}
VICTIM_LAYERS, VICTIM_LAYER_BYTES = 4, 64 << 10

ATTACKS = [(ATTACKER, "aux"), (ATTACKER, "disk"), (ATTACKER, "big_register"), (ATTACKER, "registrations"),
           (FLOODER, "grpc_connections"), (FLOODER, "handover_connections"),
           (FLOODER, "handover_duplicates"), (FLOODER, "handover_pending"),
           (FLOODER, "handover_lies"), (HOLDER, "held_descriptors"), (ATTACKER, "wide")]

# What each attack must have been answered with at least once: the bound
# that was meant for it (a code, or a code and the option it names).
EXPECTED = {
    "aux": "RESOURCE_EXHAUSTED max_",
    "disk": "RESOURCE_EXHAUSTED max_",
    "big_register": "INVALID_ARGUMENT",
    "registrations": "RESOURCE_EXHAUSTED max_registrations_per_uid",
    "held_descriptors": "RESOURCE_EXHAUSTED handover_max_fds_per_uid",
    "handover_duplicates": "last: INVALID_ARGUMENT",
    "handover_pending": "RESOURCE_EXHAUSTED",
    "handover_lies": "last: announce 250 carry 1: INVALID_ARGUMENT",
}


def setpriv(uid):
    return ["setpriv", "--reuid=%d" % uid, "--regid=%d" % GROUP, "--clear-groups", "--"]


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def mappings(pid):
    with open("/proc/%d/maps" % pid) as f:
        return sum(1 for _ in f)


def verify_flood(d, stop_file):
    """uid ATTACKER's admin calls, 8 at a time, until stopped: yields
    (calls, refused, other failures, their messages)."""
    ctl = setpriv(ATTACKER) + [harness.CKPTCTL, "--socket=" + d.socket, "--timeout=60"]
    calls = refused = failed = 0
    errors = {}
    while not os.path.exists(stop_file):
        batch = [subprocess.Popen(ctl + (["verify", "aux-flood", "--deep"] if i % 2 == 0
                                         else ["status"]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(8)]
        for p in batch:
            _, err = p.communicate(timeout=120)
            calls += 1
            if "RESOURCE_EXHAUSTED" in err:
                refused += 1
            elif "cannot reach ckptd" in err:
                # This uid's own connections are over max_connections_per_uid
                # for a moment (its other attacks hold some): ckptd closes
                # the new one, which the client reports as UNAVAILABLE.
                refused += 1
            elif p.returncode != 0 and "does not exist" not in err:
                failed += 1
                errors[err.strip()[-200:]] = errors.get(err.strip()[-200:], 0) + 1
        yield calls, refused, failed, errors


def lines_in(path):
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def check_heavy_cap(d, hold_log, release):
    """max_heavy_calls, ordered rather than raced: with `release` removed,
    ckptd holds each heavy call it admits at the delay point
    rpc.heavy_call (a line in `hold_log`). Two `verify --deep` take both
    slots; a third is refused naming the option; once released, the two
    finish."""
    ctl = setpriv(ATTACKER) + [harness.CKPTCTL, "--socket=" + d.socket, "--timeout=60"]
    verify = ctl + ["verify", "aux-flood", "--deep"]
    cap = BOUNDS["max_heavy_calls"]
    os.unlink(release)
    held = []
    try:
        seen = lines_in(hold_log)
        held = [subprocess.Popen(verify, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(cap)]
        harness.wait_for(lambda: lines_in(hold_log) >= seen + cap, 60,
                         "%d verify calls held at their slots" % cap)
        third = subprocess.run(verify, capture_output=True, text=True, timeout=60)
    finally:
        with open(release, "w"):
            pass
    for p in held:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, "a held verify failed once released: " + err[-2000:]
    print("max_heavy_calls %d: %d calls held, the next answered %r"
          % (cap, cap, third.stderr.strip()[-160:]))
    assert third.returncode != 0 and "RESOURCE_EXHAUSTED" in third.stderr and \
        "max_heavy_calls" in third.stderr, (third.returncode, third.stderr[-2000:])


def check_memory_tier_share(d):
    """The victim trains two more steps (their versions go into the memory
    tier); a third uid then commits steps of more layers than the tier
    holds. The victim's versions stay in memory, so its restore reads them
    all from there (oldest-first eviction once left it nothing)."""
    def trainer(uid, job, layers, layer_bytes, steps, *extra):
        out = subprocess.run(setpriv(uid) + harness.trainer_cmd(
            d, job, "--layers=%d" % layers, "--layer-bytes=%d" % layer_bytes,
            "--steps=%d" % steps, "--policy=all", "--durable-every=1", *extra),
            capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    # A snapshot waiting for the pool takes the tier's room (by design), so
    # nothing but the tier's own images may hold the pool: the attacks'
    # queued steps drain first.
    address = d.ctl("status")["metrics_address"]
    deadline = time.monotonic() + 120
    while True:
        m = harness.scrape(address)
        staged = m[("ckpt_staging_pool_in_use_bytes", "")] - m[("ckpt_memory_tier_bytes", "")]
        if staged <= 0:
            break
        assert time.monotonic() < deadline, \
            "the attacks' queued steps never drained: %d bytes staged" % staged
        time.sleep(0.1)
    trainer(VICTIM, "victim", VICTIM_LAYERS, VICTIM_LAYER_BYTES, STEPS + 2, "--restore")
    # More layers than the tier holds (each entry takes whole 1 MiB chunks),
    # in steps small enough that the staging pool never needs the tier's
    # room: the trainer waits for step t-1 after reporting t, so two steps
    # (2 x 10 MiB) and the full tier (8 MiB) stay under the 32 MiB pool.
    # With 12 layers they filled it exactly, and a slow commit made the
    # snapshot take the victim's oldest entry.
    flood_layers, flood_bytes, flood_steps = 10, 512 << 10, 3
    trainer(HOLDER, "memory-flood", flood_layers, flood_bytes, flood_steps)
    out = trainer(VICTIM, "victim", VICTIM_LAYERS, VICTIM_LAYER_BYTES, STEPS + 2, "--restore")
    line = [x for x in out.splitlines() if "bytes from the memory tier" in x]
    assert line, out
    from_memory = int(line[0].rsplit(",", 1)[1].split()[0])
    print("memory tier: another uid committed %d steps of %d layers of %d bytes through a "
          "%d-byte tier; the victim's restore took %d of %d bytes from memory"
          % (flood_steps, flood_layers, flood_bytes, BOUNDS["memory_tier_bytes"], from_memory,
             VICTIM_LAYERS * VICTIM_LAYER_BYTES))
    assert from_memory == VICTIM_LAYERS * VICTIM_LAYER_BYTES, out


def main():
    unavailable = harness.other_uids_unavailable(python_client=True)
    if unavailable:
        print("skipping: " + unavailable)
        return 77
    client_dir = os.path.join(harness.BUILD, "python")
    root = harness.tempdir("ckpt-hostile-")
    os.chmod(root, 0o750)  # group 0 may traverse to the socket directory
    work = os.path.join(root, "work")
    os.makedirs(work)
    os.chmod(work, 0o777)
    attacker_py = os.path.join(work, "attacker.py")
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_attacker.py"),
                attacker_py)
    os.chmod(attacker_py, 0o644)
    stop_file = os.path.join(work, "stop")
    # Heavy calls pass the delay point rpc.heavy_call at once while this
    # file exists (check_heavy_cap removes it to hold two).
    hold_log = os.path.join(work, "heavy-calls.log")
    release = os.path.join(work, "heavy-calls.release")
    with open(release, "w"):
        pass

    pool = BOUNDS["staging_pool_bytes"]
    d = harness.Daemon(root, pool_bytes=pool, extra=[
        "--%s=%d" % (k, v) for k, v in BOUNDS.items() if k != "staging_pool_bytes"] +
        ["--gc_interval_s=2", "--keep_last_events=20"],
        env={"CKPT_DELAY_AT": "rpc.heavy_call:120000", "CKPT_DELAY_LOG": hold_log,
             "CKPT_DELAY_UNTIL": release})
    d.start()
    attackers = []
    victim = None
    try:
        pid = d.proc.pid
        rss0, fds0, maps0 = harness.rss_bytes(pid), open_fds(pid), mappings(pid)
        # What each of the four uids can make ckptd hold (the victim's
        # share is a few connections and descriptors), the descriptors of
        # the one handover message being examined (up to 250, before a
        # duplicate is found and they are closed), and slack for RocksDB,
        # io_uring and gRPC's threads.
        fd_bound = fds0 + 4 * (BOUNDS["max_connections_per_uid"] +
                               BOUNDS["handover_max_connections_per_uid"] +
                               BOUNDS["handover_max_fds_per_uid"]) + 250 + 64
        # The staging pool, each uid's index quota in memory (memtables,
        # queued aux blobs), the large calls in flight (received bytes and
        # their parsed copy), plus slack for gRPC's buffers and the
        # attacker's connections.
        rss_bound = (rss0 + pool + 2 * BOUNDS["max_index_bytes_per_uid"] +
                     2 * BOUNDS["max_large_calls"] * BOUNDS["max_message_bytes"] +
                     BOUNDS["max_calls_per_uid"] * 2 * BOUNDS["max_request_bytes"] + 160 * MiB)
        disk_bound = 2 * BOUNDS["max_disk_bytes_per_uid"] + 32 * MiB
        # Each registered region is one mapping, and every uid's regions
        # are bounded by its descriptor cap; plus the gRPC and RocksDB
        # threads' stacks and arenas.
        maps_bound = maps0 + 4 * BOUNDS["handover_max_fds_per_uid"] + 256

        env = dict(os.environ, PYTHONPATH=client_dir)
        for uid, name in ATTACKS:
            attackers.append((name, subprocess.Popen(
                setpriv(uid) + [sys.executable, attacker_py, name, d.socket, stop_file,
                                     client_dir],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
        # The stale wide registration holds every series it can get before
        # the victim registers.
        harness.wait_for(lambda: os.path.exists(stop_file + ".registered-wide"), 60,
                         "the wide registration")
        address = d.ctl("status")["metrics_address"]
        taken = sum(name == "ckpt_layer_staleness_steps" for name, _ in harness.scrape(address))
        assert taken == BOUNDS["max_layer_series"], taken
        ack_log = os.path.join(work, "acks.jsonl")
        victim = subprocess.Popen(setpriv(VICTIM) + harness.trainer_cmd(
            d, "victim", "--layers=%d" % VICTIM_LAYERS, "--layer-bytes=%d" % VICTIM_LAYER_BYTES,
            "--steps=%d" % STEPS,
            "--compute-ms=20", "--policy=all", "--durable-every=1", "--ack-log=" + ack_log),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        peak = {"rss": 0, "fds": 0, "maps": 0, "disk": 0, "uid_disk": {}, "uid_index": {},
                "series": 0, "victim_series": 0}
        flood = verify_flood(d, stop_file)
        calls = (0, 0, 0, {})
        while victim.poll() is None:
            calls = next(flood)
            for _ in range(3):
                peak["rss"] = max(peak["rss"], harness.rss_bytes(pid))
                peak["fds"] = max(peak["fds"], open_fds(pid))
                peak["maps"] = max(peak["maps"], mappings(pid))
                peak["disk"] = max(peak["disk"], harness.dir_bytes(d.data, allocated=True))
                time.sleep(0.1)
            scraped = harness.scrape(address)
            for (name, labels), value in scraped.items():
                for key, metric in (("uid_disk", "ckpt_uid_disk_used_bytes"),
                                    ("uid_index", "ckpt_uid_index_used_bytes")):
                    if name == metric:
                        peak[key][labels] = max(peak[key].get(labels, 0), value)
            series = [labels for name, labels in scraped if name == "ckpt_layer_staleness_steps"]
            peak["series"] = max(peak["series"], len(series))
            peak["victim_series"] = max(peak["victim_series"],
                                        sum('ckpt_job="victim"' in labels for labels in series))
        with open(stop_file, "w"):
            pass
        vout, verr = victim.communicate(timeout=60)
        answers = {}
        for name, p in attackers:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, "attack %s: exit %d\n%s" % (name, p.returncode, err[-3000:])
            answers[name] = json.loads(out.strip().splitlines()[-1])["answers"]
            print("attack %-21s answers %s" % (name, json.dumps(answers[name], sort_keys=True)))
        print("attack %-21s %d calls, %d refused, %d other failures %s"
              % ("verify", *calls))

        assert victim.returncode == 0, "the victim's training failed:\n" + verr[-3000:]
        acked = set(r["durable"] for r in harness.read_jsonl(ack_log))
        missing = sorted(set(range(1, STEPS)) - acked)
        assert not missing, "victim steps not acknowledged durable: %s" % missing[:20]
        plan = d.ctl("plan", "victim")
        assert plan["target_step"] == STEPS and plan["complete"], plan

        for name, needle in EXPECTED.items():
            assert any(k.startswith(needle) for k in answers[name]), \
                "attack %s was never answered %r: %s" % (name, needle, answers[name])
        # Idle connections beyond the per-uid caps were closed (gRPC) or
        # answered and closed (handover); at most the cap stays open.
        g = answers["grpc_connections"]
        assert g.get("answered_or_closed", 0) >= g.get("opened", 0) - BOUNDS[
            "max_connections_per_uid"], g
        h = answers["handover_connections"]
        assert h.get("answered_or_closed", 0) >= h.get("opened", 0) - BOUNDS[
            "handover_max_connections_per_uid"], h
        # Whether a verify of the flood met both slots taken is up to
        # timing; check_heavy_cap below orders it. Here none may fail.
        assert calls[0] > 0 and calls[2] == 0, calls
        held = answers["held_descriptors"]
        held_fds = held.get("OK", 0) * held["regions_per_rank"]
        print("held descriptors: %d registrations of %d regions live, %d descriptors, cap %d" %
              (held.get("OK", 0), held["regions_per_rank"], held_fds,
               BOUNDS["handover_max_fds_per_uid"]))
        assert held_fds <= BOUNDS["handover_max_fds_per_uid"], held
        print("per-layer metric series: peak %d, bound max_layer_series %d; the victim's %d "
              "layers had %d (a stale registration of %d layers held the rest)"
              % (peak["series"], BOUNDS["max_layer_series"], VICTIM_LAYERS,
                 peak["victim_series"], answers["wide"]["layers"]))
        assert peak["series"] <= BOUNDS["max_layer_series"], peak
        assert peak["victim_series"] == VICTIM_LAYERS, peak

        print("FIGURES hostile: victim %d of %d steps acknowledged durable; ckptd rss start %d "
              "peak %d bound %d; fds start %d peak %d bound %d; mappings start %d peak %d "
              "bound %d; data dir peak %d bound %d"
              % (len(acked & set(range(1, STEPS + 1))), STEPS, rss0, peak["rss"], rss_bound,
                 fds0, peak["fds"], fd_bound, maps0, peak["maps"], maps_bound, peak["disk"],
                 disk_bound))
        m = harness.scrape(address)
        refused = {labels: int(v) for (name, labels), v in m.items()
                   if name == "ckpt_quota_refused_total"}
        print("per-uid peaks (metrics): disk %s (limit %d), index %s (limit %d); "
              "ckpt_quota_refused_total %s" % (peak["uid_disk"], BOUNDS["max_disk_bytes_per_uid"],
                                               peak["uid_index"],
                                               BOUNDS["max_index_bytes_per_uid"], refused))
        for labels, used in peak["uid_disk"].items():
            assert used <= BOUNDS["max_disk_bytes_per_uid"], (labels, used)
        for labels, used in peak["uid_index"].items():
            assert used <= BOUNDS["max_index_bytes_per_uid"], (labels, used)
        assert peak["rss"] <= rss_bound, ("rss", peak["rss"], rss_bound)
        assert peak["fds"] <= fd_bound, ("fds", peak["fds"], fd_bound)
        assert peak["maps"] <= maps_bound, ("mappings", peak["maps"], maps_bound)
        assert peak["disk"] <= disk_bound, ("disk", peak["disk"], disk_bound)

        # The attacker is gone: its connections, handovers and registered
        # regions are given back (pidfd and the handover TTL are not
        # waited for: the attackers' registrations were released when
        # their processes exited, and unclaimed handovers hold descriptors
        # until their TTL, so bound rather than equate).
        deadline = time.time() + 30
        while open_fds(pid) > fds0 + BOUNDS["handover_max_pending_per_uid"] + 16 and \
                time.time() < deadline:
            time.sleep(0.2)
        fds_after = open_fds(pid)
        print("ckptd descriptors after the attack: %d (start %d)" % (fds_after, fds0))
        assert fds_after <= fds0 + BOUNDS["handover_max_pending_per_uid"] + 16, fds_after
        p = d.ctl_raw("verify", "victim", "--deep")
        assert p.returncode == 0, p.stdout + p.stderr
        check_heavy_cap(d, hold_log, release)
        check_memory_tier_share(d)
        assert d.stop() == 0, d.log()[-3000:]
        return 0
    finally:
        with open(stop_file, "w"):
            pass
        harness.kill_processes([p for _, p in attackers] + [victim])
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
