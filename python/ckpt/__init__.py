"""ckpt: the Python client of ckptd, the node-local checkpoint daemon.

    import ckpt
    client = ckpt.Client("/run/ckptd/ckptd.sock")

`ckpt.Client` is the C++ client library (ckpt/client.h); its requests and
replies are typed dicts (see ckpt/_ckpt.pyi). `ckpt.torch.attach` builds on it
for PyTorch models and returns typed results (dataclasses).
Every failed call raises `ckpt.Error`, whose `code` is the status code name
("NOT_FOUND", "INVALID_ARGUMENT", "UNAVAILABLE", ...).

`ckpt.__version__` is the project's version, the one ckptd's Status reports.
"""


class Error(Exception):
    """A call to ckptd failed; `code` names the status, `message` says why."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


from ckpt._ckpt import Client, Region, __version__  # noqa: E402  (Error must exist first)

__all__ = ["Client", "Error", "Region"]
