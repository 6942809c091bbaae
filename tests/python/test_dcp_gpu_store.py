"""ckpt.dcp's GpuStore on the CPU: what it asks ckptd to write, and the
digests that decide it.

- digest(): equal bytes give equal sums on every call; every single-bit
  flip of a 13-byte tensor, a sign flip of every element, two sign flips,
  a row swap, pieces swapped across DIGEST_PIECE boundaries, and tensors
  of bf16, bool, int64 and complex64 give other sums; another seed gives
  other sums.
- GpuStore against the client's GPU calls (add_gpu_tensor, register,
  set_cuda_stream, step_done, wait_snapshot, wait_durable), answered by a
  stand-in of ckpt.Client, since CUDA IPC needs a GPU: the first save
  writes every tensor; a save after a change writes only the changed
  tensor, and each WriteResult names the step of the version that holds
  its bytes; a save with nothing changed writes none; tensors of other
  storages register again and write everything; a snapshot ckptd skipped
  fails the save and the next save writes the tensor again; a stage whose
  commit never comes (abandon) does not hold up the next, and a tensor it
  named is written again even when its bytes went back to the older
  version's; a view at a 2-byte offset is digested.
- CkptWriter with both stores (CPU tensors in a real ckptd): a save
  staged and never written holds up only the next stage (refused after
  wait_timeout_s), not the one after; should its write come after all, it
  is refused, as is a write of a save other than the one staged; a
  parameter taken in place is staged as a detached meta tensor.
The same store against a real ckptd on a GPU: tests/gpu/dcp_gpu_check.py.

Run by ctest (PYTHONPATH=<build>/python); exits 77 when torch is missing.
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402

from ckpt.dcp import gpu_store  # noqa: E402
from ckpt.dcp.gpu_store import GpuStore, digest  # noqa: E402


def error_of(fn, *args):
    """The message of the RuntimeError (TimeoutError included) fn(*args)
    raises, or "" when it returns."""
    try:
        fn(*args)
        return ""
    except RuntimeError as e:
        return str(e)
    except TimeoutError as e:
        return str(e)


def sums(t, seed=11):
    return tuple(digest(t.contiguous(), seed).tolist())


def digests_tell_changes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    check(sums(x) == sums(x.clone()) == sums(x), "equal bytes, equal sums, every call")
    check(sums(x, 11) != sums(x, 12), "another seed, other sums")
    base = torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g)
    seen = {sums(base)}
    for i in range(13):
        for bit in range(8):
            y = base.clone()
            y[i] ^= 1 << bit
            seen.add(sums(y))
    check(len(seen) == 1 + 13 * 8, "each of the 104 single-bit flips is told: %d distinct"
          % len(seen))
    check(sums(x) != sums(x.neg()), "every sign flipped")
    y = x.clone()
    y[3], y[700] = -y[3], -y[700]
    check(sums(x) != sums(y), "two sign flips")
    m = torch.randn(64, 48, generator=g)
    check(sums(m) != sums(m[[1, 0] + list(range(2, 64))]), "two rows swapped")
    saved = gpu_store.DIGEST_PIECE
    gpu_store.DIGEST_PIECE = 8  # words: 1000 floats are 125 pieces
    try:
        check(sums(x) == sums(x.clone()), "equal across pieces")
        y = x.clone()
        y[:8], y[8:16] = x[8:16].clone(), x[:8].clone()
        check(sums(x) != sums(y), "two pieces swapped")
        y = x.clone()
        y[0] += 1.0
        y[999] -= 1.0
        check(sums(x) != sums(y), "changes in the first and the last piece")
    finally:
        gpu_store.DIGEST_PIECE = saved
    for t in (torch.randn(33, generator=g).to(torch.bfloat16),
              torch.rand(7, generator=g) > 0.5,
              torch.randint(-5, 5, (9,), dtype=torch.int64, generator=g),
              torch.randn(5, dtype=torch.complex64, generator=g)):
        u = t.clone()
        u.view(-1)[-1] = (~u.view(-1)[-1]) if t.dtype == torch.bool else u.view(-1)[-1] + 1
        check(sums(t) == sums(t.clone()) and sums(t) != sums(u),
              "%s: equal and changed told apart" % t.dtype)
    print("digests: equal bytes equal, 104 bit flips, sign flips, row and piece swaps, "
          "4 dtypes told")


class Client:
    """ckpt.Client's GPU calls as GpuStore makes them, answered as ckptd
    would; every call recorded."""

    instances = []

    def __init__(self, *args, **kwargs):
        self.calls = []
        self.skip = set()  # layers the next snapshot skips
        self.latest_durable_step_at_register = 0
        Client.instances.append(self)

    def add_gpu_tensor(self, ptr, nbytes, name):
        self.calls.append(("add", name))
        return 0, len([c for c in self.calls if c[0] == "add"]) * 4096

    def register(self, spec):
        self.calls.append(("register", spec["job_id"], len(spec["layers"])))

    def set_cuda_stream(self, stream):
        self.calls.append(("stream", stream))

    def step_done(self, step, lr, aux, layers):
        self.calls.append(("step", step, list(layers)))
        self.last = (step, list(layers))

    def wait_snapshot(self, step):
        step_, layers = self.last
        taken = [x for x in layers if x not in self.skip]
        self.skip = set()
        return {"layers": taken, "skipped": len(layers) - len(taken), "lost": False}

    def wait_durable(self, step, tier="local"):
        self.calls.append(("durable", step))
        return step

    def unregister(self, drain=True):
        self.calls.append(("unregister",))

    def steps(self):
        return [c[2] for c in self.calls if c[0] == "step"]


def store_writes_what_changed():
    gpu_store.client_for = Client
    store = GpuStore(None, "job", 0)
    g = torch.Generator().manual_seed(1)
    ts = {"a": torch.randn(100, generator=g), "b": torch.randn(50, generator=g),
          "c": torch.randn(10, generator=g)}

    def save():
        store.stage(ts)
        return store.commit()

    step, where = save()
    c = Client.instances[-1]
    check(c.steps() == [[0, 1, 2]] and step == 1, "the first save writes every tensor: %s"
          % c.calls)
    check(c.calls.index(("stream", 0)) < c.calls.index(("step", 1, [0, 1, 2])),
          "the stream is set before StepDone (its event is recorded there)")
    ts["b"].add_(1.0)
    step, where = save()
    check(c.steps()[-1] == [1], "a save after a change writes that tensor only: %s"
          % c.steps())
    check((where["a"].version, where["b"].version, where["c"].version) == (1, 2, 1) and
          all(w.step == 2 for w in where.values()),
          "each tensor names the step of its version: %s" % where)
    step, where = save()
    check(c.steps()[-1] == [] and where["b"].version == 2, "nothing changed, nothing written")
    ts["c"].mul_(-1.0)
    c.skip = {2}
    err = error_of(store.stage, ts)
    check("staging pool had no room" in err, "a skipped snapshot fails the save: %s" % err)
    step, where = save()
    check(c.steps()[-1] == [2] and where["c"].version == step,
          "the tensor a failed save skipped is written by the next: %s" % c.steps())
    ts["a"].add_(2.0)
    store.stage(ts)
    store.abandon()
    step, where = save()
    check(c.steps()[-1] == [0] and where["a"].version == step,
          "after an abandoned stage the next save goes ahead and writes the change")
    # A step that named a tensor and was abandoned may still become ckptd's
    # newest version of it: with its bytes back as they were, the next save
    # writes it again rather than name the older version.
    before = ts["c"].clone()
    ts["c"].add_(3.0)
    store.stage(ts)
    store.abandon()
    ts["c"].copy_(before)
    step, where = save()
    check(c.steps()[-1] == [2] and where["c"].version == step,
          "a tensor an abandoned step named is written again: %s" % c.steps())
    # A view at an odd byte offset (a slice of a bf16 buffer) is digested.
    buf = torch.randn(11, generator=g).to(torch.bfloat16)
    check(sums(buf[1:]) != sums(buf[:-1]) and sums(buf[1:]) == sums(buf[1:].clone()),
          "a view at a 2-byte offset is digested as its bytes")
    moved = {k: v.clone() for k, v in ts.items()}
    store.stage(moved)
    store.commit()
    c2 = Client.instances[-1]
    check(c2 is not c and ("unregister",) in c.calls and c2.steps() == [[0, 1, 2]],
          "other storages register again and write everything: %s" % c2.calls)
    store.close()
    print("GpuStore: writes the changed tensors only, names each one's version, recovers "
          "from a skipped snapshot and an abandoned stage, registers moved tensors again")


def writer_recovers_from_a_lost_save():
    """CkptWriter with both stores: its CPU tensors in a real ckptd's host
    slots, the tensors it takes "in place" through the stand-in. A save
    staged and never written (DCP failed before write_data) holds up the
    next stage for wait_timeout_s, which is refused; the one after goes
    ahead at once, with neither store still waiting. A parameter staged in
    place comes back as a detached meta tensor (DCP's process pickles it)."""
    import torch.distributed.checkpoint  # noqa: F401 - the writer's imports
    from ckpt.dcp import CkptWriter
    gpu_store.client_for = Client
    root = harness.tempdir("ckpt-dcp-gpu-store-")
    d = harness.Daemon(root).start()
    try:
        writer = CkptWriter("lost", socket_path=d.socket, wait_timeout_s=1.0)
        writer._in_place = lambda ts: {k: t for k, t in ts.items() if k.startswith("w")}
        weight = torch.nn.Parameter(torch.randn(8, 8))
        sd = {"w": weight, "b": torch.randn(8)}
        slots = writer._stage_tensors({k: v for k, v in sd.items()}, tag="s1")
        check(slots["w"].is_meta and not slots["w"].requires_grad and slots["w"].is_leaf,
              "a parameter staged in place is a detached meta tensor")
        check(not slots["b"].is_meta, "the CPU tensor has its host slot")
        err = error_of(writer._stage_tensors, dict(sd), None, "s2")
        check("previous save was staged but not written" in err,
              "a stage after a lost save waits wait_timeout_s and is refused: %s" % err)
        # Nothing commits the lost save: a store still waiting for it would
        # refuse this stage too.
        writer._stage_tensors(dict(sd), tag="s3")
        check(writer._gpu_store.staged_as("s3") and writer._store._turn.tag == "s3",
              "the next stage goes ahead, and both stores hold its tensors")
        # The given-up save's write comes after all: refused, not reported
        # with what save s3 staged; s3's own write goes ahead.
        err = error_of(writer._commit_items, [], {}, {}, [], "s1")
        check("save 's1' was given up" in err, "a given-up save's write is refused: %s" % err)
        err = error_of(writer._commit_items, [], {}, {}, [], "s4")
        check("while save 's3' is staged" in err, "another save's write is refused: %s" % err)
        writer._commit_items([], {}, {}, [], "s3")
        check(not writer._gpu_store.staged_as("s3") and not writer._store._turn.held,
              "s3's write commits both stores")
        # A stage() called by hand (no id, as ckpt.lightning's) is written by
        # the next save, whatever its id.
        writer._stage_tensors(dict(sd))
        check(writer._gpu_store.staged_as("s5"), "a stage without an id is any save's")
        writer._commit_items([], {}, {}, [], "s5")
        check(not writer._gpu_store.staged_as(None) and not writer._store._turn.held,
              "and that save's write commits both stores")
        # async_save from PyTorch 2.10 stages without a reset() on the
        # trainer's thread: the id an earlier dcp.save gave reset() there is
        # not this save's.
        import torch.distributed.checkpoint as dcp
        dcp.save({"b": sd["b"]}, checkpoint_id="s7", storage_writer=writer)
        writer.stage({"w": weight, "b": sd["b"]})
        check(writer._gpu_store.staged_as("s8") and writer._store._turn.tag is None,
              "a stage after a dcp.save on the same thread has no id: %r"
              % writer._store._turn.tag)
        writer._commit_items([], {}, {}, [], "s8")
        writer.close()
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("CkptWriter: a lost save costs the next one wait_timeout_s, the one after nothing")


def main():
    digests_tell_changes()
    store_writes_what_changed()
    writer_recovers_from_a_lost_save()


if __name__ == "__main__":
    main()
