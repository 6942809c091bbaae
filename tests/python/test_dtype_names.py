"""ckpt.torch's names of torch dtypes against the extension module's.

ckpt.torch names each torch dtype it maps with the name of one of ckptd's
element types (its _DTYPE_NAMES). The extension module (python/ckpt_module.cc)
parses that name as the API's DTYPE_<name>, and ckpt._ckpt.dtype_sizes() lists
every name it accepts with the bytes per element of base/dtype.h's table.
Every name ckpt.torch uses must be one of them, with the element size torch
gives the dtype: otherwise a registration would be refused or, worse, its
nbytes would not match the tensor's.

Run by ctest (PYTHONPATH=<build>/python); exits 77 (skipped) when torch or
the module is missing.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

harness.require_torch()
import torch  # noqa: E402

from ckpt import _ckpt  # noqa: E402
from ckpt.torch import layout as ckpt_layout  # noqa: E402


def dtype_names():
    """ckpt.torch's {torch dtype: name} (ckpt/torch/layout.py)."""
    return ckpt_layout.DTYPE_NAMES


def main():
    sizes = _ckpt.dtype_sizes()
    check("F32" in sizes and sizes["F32"] == 4,
          "the module names its dtypes with their sizes: %s" % sorted(sizes.items()))
    names = dtype_names()
    check(len(names) > 0, "ckpt.torch maps %d torch dtypes" % len(names))
    for dtype, name in names.items():
        check(name in sizes, "%s is named %r, a dtype the module accepts" % (dtype, name))
        size = torch.empty((), dtype=dtype).element_size()
        check(size == sizes[name],
              "%s has %d bytes per element, as %s has (%d)" % (dtype, size, name, sizes[name]))


if __name__ == "__main__":
    main()
