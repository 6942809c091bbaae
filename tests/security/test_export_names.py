"""export_into never puts one layer's bytes where another layer's belong.

Two layers of one rank each hold a tensor named "w", with different bytes.
Destinations keyed by the bare name used to be filled twice, silently, and
one layer was restored nowhere. Now:
- a bare name two layers share is refused with FAILED_PRECONDITION naming
  both layers, and the destination is left as it was;
- destinations keyed by (layer name, tensor name) get each layer's own bytes;
- a unique bare name still works next to tuple keys;
- a destination that matches no tensor, and a tensor with no destination,
  are refused;
- `ckptctl layers` prints a layer name's U+202E/U+202C escaped, not raw.

Run by ctest (imports ckpt from <build>/python); exits 77 when it is not built.
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

sys.path.insert(0, os.path.join(harness.BUILD, "python"))
try:
    import ckpt
except ImportError as e:  # pragma: no cover - reported as a skip
    print("skipping: %s" % e)
    sys.exit(77)

N = 1024  # bytes of each tensor (uint8)
# A layer name with a right-to-left override and its pop: printed raw, it
# displays as another name.
BIDI_LAYER = "c\u202eevil\u202c"


def refused(client, dests, needle):
    try:
        client.export_into("dup", 0, 0, dests)
    except ckpt.Error as e:
        return e.code == "FAILED_PRECONDITION" and needle in e.message, e.message
    return False, "accepted"


def main():
    root = harness.tempdir("ckpt-export-names-")
    d = harness.Daemon(root).start()
    try:
        trainer = ckpt.Client(d.socket)
        region = trainer.allocate_region(3 * N)
        view = memoryview(region)
        view[0:N] = bytes([0xA1]) * N
        view[N:2 * N] = bytes([0xB2]) * N
        view[2 * N:3 * N] = bytes([0xC3]) * N
        trainer.register({"job_id": "dup", "layers": [
            {"name": "a", "tensors": [{"name": "w", "shape": [N], "dtype": "U8",
                                       "region": region.index, "offset": 0}]},
            {"name": "b", "tensors": [{"name": "w", "shape": [N], "dtype": "U8",
                                       "region": region.index, "offset": N}]},
            {"name": BIDI_LAYER, "tensors": [{"name": "bias", "shape": [N], "dtype": "U8",
                                       "region": region.index, "offset": 2 * N}]}]})
        trainer.step_done(1, 0.1)
        trainer.wait_durable(1)

        reader = ckpt.Client(d.socket)
        w, bias = bytearray(N), bytearray(N)
        ok, why = refused(reader, {"w": w, "bias": bias}, "layers 'a', 'b'")
        check(ok, "a bare tensor name two layers share is refused naming both: %s" % why)
        check(w == bytearray(N), "the refused destination is left as it was")

        a, b = bytearray(N), bytearray(N)
        plan = reader.export_into("dup", 0, 0, {("a", "w"): a, ("b", "w"): b, "bias": bias})
        check(plan["target_step"] == 1, "the export is of step 1")
        check(a == bytes([0xA1]) * N and b == bytes([0xB2]) * N,
              "destinations keyed by (layer, name) get each layer's own bytes")
        check(bias == bytes([0xC3]) * N, "a unique bare name next to them gets its bytes")

        ok, why = refused(reader, {("a", "w"): a, ("b", "w"): b, "bias": bias,
                                   ("z", "w"): bytearray(N)}, "('z', 'w')")
        check(ok, "a destination of no tensor is refused: %s" % why)
        ok, why = refused(reader, {("a", "w"): a, "bias": bias}, "layer 'b'")
        check(ok, "a tensor without a destination is refused: %s" % why)
        p = d.ctl_raw("layers", "dup")
        check(p.returncode == 0 and "c\\u202eevil\\u202c" in p.stdout and "\u202e" not in p.stdout,
              "ckptctl layers prints the bidirectional controls escaped")
        trainer.unregister()
        assert d.stop() == 0, d.log()[-3000:]
        return 0
    finally:
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
