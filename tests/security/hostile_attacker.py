"""One attack on ckptd, run as an unprivileged uid by test_hostile.py.

    python3 hostile_attacker.py ATTACK SOCKET STOP_FILE [PYTHON_CLIENT_DIR]

Repeats ATTACK until STOP_FILE exists (or 180 s pass), then prints one JSON
line counting what ckptd answered. Only the standard library, except the
attacks that go through ckptd's Python client (aux, big_register,
registrations, held_descriptors, wide). Exits non-zero only when ckptd answers something an attack
must never get (an accepted duplicate descriptor, a handover that is neither
accepted nor refused, an unexpected error code).
"""

import json
import os
import resource
import socket
import struct
import sys
import time

HANDOVER_MAGIC = 0x31484B43  # "CKH1", base/handover_wire.h
REPLY = struct.Struct("<II16s200s")
CODES = {0: "OK", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 8: "RESOURCE_EXHAUSTED"}
MAX_SECONDS = 180
REGIONS_PER_RANK = 30  # held_descriptors: descriptors (and mappings) per registration
WIDE_LAYERS = 1000  # wide: layers of the stale registration, above max_layer_series


class Counter(dict):
    def add(self, key, n=1):
        self[key] = self.get(key, 0) + n


def stopped(stop_file, started):
    return os.path.exists(stop_file) or time.time() - started > MAX_SECONDS


def connect(path, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def answered(s):
    """True when ckptd answered `s` or closed it (a read returns bytes, EOF
    or a reset)."""
    s.setblocking(False)
    try:
        s.recv(1)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def hand_over(fds_socket, fds, nfds=None):
    """Sends one handover message and returns ckptd's answer as a code name."""
    try:
        s = connect(fds_socket, timeout=20.0)
    except BlockingIOError:
        return "BACKLOG_FULL"
    try:
        header = struct.pack("<II", HANDOVER_MAGIC, len(fds) if nfds is None else nfds)
        try:
            socket.send_fds(s, [header], fds)
        except (BrokenPipeError, ConnectionResetError):
            # Closed before the message was read: ckptd may answer a
            # connection over a per-uid limit at once.
            pass
        data = b""
        while len(data) < REPLY.size:
            try:
                chunk = s.recv(REPLY.size - len(data))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return "CLOSED"
            data += chunk
        magic, code, _, message = REPLY.unpack(data)
        if magic != HANDOVER_MAGIC:
            return "BAD_MAGIC"
        answer = CODES.get(code, "code %d" % code)
        if "handover_max_connections_per_uid" in message.decode(errors="replace"):
            answer += " handover_max_connections_per_uid"
        return answer
    finally:
        s.close()


def raise_fd_limit():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def idle_connections(path, stop_file, started, count):
    """Opens `count` connections to `path` that never send a byte, holds them
    until stopped, and counts how many ckptd closed."""
    raise_fd_limit()
    held, c = [], Counter()
    for _ in range(count):
        try:
            held.append(connect(path, timeout=2.0))
            c.add("opened")
        except OSError as e:
            c.add("connect failed: " + type(e).__name__)
    while not stopped(stop_file, started):
        time.sleep(0.2)
    c["answered_or_closed"] = sum(answered(s) for s in held)
    for s in held:
        s.close()
    return c


def once_served(fds_socket, fds, nfds=None):
    """One more message once this uid's other attacks no longer hold its
    handover limits (they stop with it, and unclaimed handovers expire):
    ckptd's answer to the message itself rather than to a limit."""
    deadline = time.time() + 60
    while True:
        answer = hand_over(fds_socket, fds, nfds)
        if not answer.startswith("RESOURCE_EXHAUSTED") or time.time() > deadline:
            return answer
        time.sleep(0.05)


def handover_duplicates(fds_socket, stop_file, started):
    """One memfd listed 250 times per message: refused, every time."""
    c = Counter()
    fd = os.memfd_create("dup")
    os.ftruncate(fd, 4096)
    while not stopped(stop_file, started):
        c.add(hand_over(fds_socket, [fd] * 250))
    c.add("last: " + once_served(fds_socket, [fd] * 250))
    if c.get("OK"):
        raise SystemExit("a message with 250 copies of one descriptor was accepted: %r" % c)
    return c


def handover_pending(fds_socket, stop_file, started):
    """Hands over distinct regions and never claims them: the uid's pending
    table fills and further handovers are refused."""
    c = Counter()
    while not stopped(stop_file, started):
        fd = os.memfd_create("pending")
        os.ftruncate(fd, 4096)
        try:
            c.add(hand_over(fds_socket, [fd]))
        finally:
            os.close(fd)
    return c


def handover_lies(fds_socket, stop_file, started):
    """Headers that announce more descriptors than they carry, or none."""
    c = Counter()
    fd = os.memfd_create("lie")
    while not stopped(stop_file, started):
        c.add("announce 250 carry 1: " + hand_over(fds_socket, [fd], nfds=250))
        c.add("announce 0: " + hand_over(fds_socket, [], nfds=0))
    c.add("last: announce 250 carry 1: " + once_served(fds_socket, [fd], nfds=250))
    c.add("last: announce 0: " + once_served(fds_socket, [], nfds=0))
    for key, n in c.items():
        if key.endswith(": OK") or key == "OK":
            raise SystemExit("a malformed handover was accepted: %r" % c)
    return c


def client_attack(name, sock, stop_file, started, client_dir):
    sys.path.insert(0, client_dir)
    import ckpt
    c = Counter()

    def call(fn):
        try:
            fn()
            c.add("OK")
        except ckpt.Error as e:
            c.add(e.code)
            for option in ("max_index_bytes_per_uid", "max_queued_steps_per_rank",
                           "max_queued_steps_per_uid", "max_disk_bytes_per_uid",
                           "max_registrations_per_uid", "max_large_calls", "max_request_bytes",
                           "handover_max_"):
                if option in e.message:
                    c.add(e.code + " " + option)

    def register(client, spec):
        """Registers, waiting while this uid's own handover attacks hold
        its handover limits; False when stopped first."""
        while not stopped(stop_file, started):
            try:
                client.register(spec)
                return True
            except ckpt.Error as e:
                if e.code != "RESOURCE_EXHAUSTED" or "handover_max_" not in e.message:
                    raise
                c.add("register waited: " + e.message.rsplit("(", 1)[-1].rstrip(")"))
                time.sleep(0.05)
        return False

    if name == "aux":
        # 1 MiB aux blobs as fast as StepDone takes them, never waiting.
        client = ckpt.Client(sock)
        region = client.allocate_region(4096)
        register(client, {"job_id": "aux-flood", "layers": [{"name": "l0", "tensors": [
            {"name": "w", "shape": [1024], "region": region.index, "offset": 0}]}]})
        open(stop_file + ".registered-aux", "w").close()
        aux = os.urandom(1 << 20)
        step = 0
        while not stopped(stop_file, started):
            step += 1
            call(lambda: client.step_done(step, 0.1, aux))
    elif name == "disk":
        # Two 8 MiB layers written every step, as fast as ckptd takes them:
        # layer files until max_disk_bytes_per_uid refuses more.
        client = ckpt.Client(sock)
        region = client.allocate_region(16 << 20)
        register(client, {"job_id": "disk-flood", "layers": [
            {"name": "l%d" % i, "tensors": [{"name": "w", "shape": [2 << 20],
                                             "region": region.index, "offset": i << 23}]}
            for i in range(2)]})
        open(stop_file + ".registered-disk", "w").close()
        step = 0
        while not stopped(stop_file, started):
            step += 1
            call(lambda: client.step_done(step, 0.1, b""))
    elif name == "big_register":
        # A 1 MiB layer name, and tensor tables of about 12 MiB (above
        # max_request_bytes, so each is a large call) that fail validation.
        client = ckpt.Client(sock, call_timeout_s=60.0)
        region = client.allocate_region(4096)
        huge_name = {"job_id": "big", "layers": [{"name": "n" * (1 << 20), "tensors": [
            {"name": "w", "shape": [1], "region": region.index, "offset": 0}]}]}
        table = {"job_id": "big", "layers": [{"name": "l%d" % i, "tensors": [
            {"name": "t" * 200, "shape": [1 << 20], "region": region.index, "offset": 0}]}
            for i in range(50000)]}
        while not stopped(stop_file, started):
            call(lambda: client.register(huge_name))
            call(lambda: client.register(table))
        if c.get("OK"):
            raise SystemExit("an invalid registration was accepted: %r" % c)
    elif name == "registrations":
        # More ranks than max_registrations_per_uid, each holding its region,
        # once the aux and disk floods have their ranks.
        while not all(os.path.exists(stop_file + ".registered-" + a) for a in ("aux", "disk")) \
                and not stopped(stop_file, started):
            time.sleep(0.05)
        clients = []
        i = 0
        while not stopped(stop_file, started) and i < 64:
            client = ckpt.Client(sock)
            region = client.allocate_region(4096)
            spec = {"job_id": "reg-%d" % i, "layers": [{"name": "l0", "tensors": [
                {"name": "w", "shape": [1024], "region": region.index, "offset": 0}]}]}
            try:
                if register(client, spec):
                    c.add("OK")
                    clients.append(client)
            except ckpt.Error as e:
                c.add(e.code + (" max_registrations_per_uid"
                                if "max_registrations_per_uid" in e.message else ""))
            i += 1
        while not stopped(stop_file, started):
            time.sleep(0.2)
    elif name == "wide":
        # One registration of more layers than max_layer_series, kept
        # registered and never stepped (a stale job): each of its layers
        # asks for a per-layer metric series at every scrape.
        client = ckpt.Client(sock)
        region = client.allocate_region(WIDE_LAYERS * 64)
        register(client, {"job_id": "wide", "layers": [
            {"name": "l%d" % i, "tensors": [{"name": "w", "shape": [16],
                                             "region": region.index, "offset": i * 64}]}
            for i in range(WIDE_LAYERS)]})
        c.add("OK")
        c.add("layers", WIDE_LAYERS)
        open(stop_file + ".registered-wide", "w").close()
        while not stopped(stop_file, started):
            time.sleep(0.2)
    elif name == "held_descriptors":
        # Registrations of many regions each, kept alive: each region is a
        # descriptor and a mapping ckptd holds for as long as the
        # registration lives, so they must count against the uid's cap.
        clients = []
        i = 0
        while not stopped(stop_file, started) and i < 64:
            client = ckpt.Client(sock)
            regions = [client.allocate_region(4096) for _ in range(REGIONS_PER_RANK)]
            spec = {"job_id": "held-%d" % i, "layers": [
                {"name": "l%d" % j, "tensors": [{"name": "w", "shape": [1024],
                                                "region": r.index, "offset": 0}]}
                for j, r in enumerate(regions)]}
            try:
                client.register(spec)
                c.add("OK")
                clients.append(client)
            except ckpt.Error as e:
                c.add(e.code + (" handover_max_fds_per_uid"
                                if "handover_max_fds_per_uid" in e.message else ""))
                time.sleep(0.05)
            i += 1
        c.add("regions_per_rank", REGIONS_PER_RANK)
        while not stopped(stop_file, started):
            time.sleep(0.2)
    else:
        raise SystemExit("unknown attack " + name)
    return c


def main():
    name, sock, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
    started = time.time()
    fds_socket = sock + ".fds"
    if name == "grpc_connections":
        c = idle_connections(sock, stop_file, started, 2000)
    elif name == "handover_connections":
        c = idle_connections(fds_socket, stop_file, started, 200)
    elif name == "handover_duplicates":
        c = handover_duplicates(fds_socket, stop_file, started)
    elif name == "handover_pending":
        c = handover_pending(fds_socket, stop_file, started)
    elif name == "handover_lies":
        c = handover_lies(fds_socket, stop_file, started)
    else:
        c = client_attack(name, sock, stop_file, started, sys.argv[4])
    print(json.dumps({"attack": name, "answers": c, "seconds": round(time.time() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
