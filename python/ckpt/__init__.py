"""ckpt: the Python client of ckptd, the node-local checkpoint daemon.

    import ckpt
    client = ckpt.Client("/run/ckptd/ckptd.sock")

`ckpt.Client` is the C++ client library (ckpt/client.h); its requests and
replies are typed dicts (see ckpt/_ckpt.pyi). `ckpt.torch.attach` builds on it
for PyTorch models and returns typed results (dataclasses).

Every failed call raises `ckpt.Error`, with
- `code`: the status code name ("NOT_FOUND", "INVALID_ARGUMENT",
  "UNAVAILABLE", "RESOURCE_EXHAUSTED", ...), which says what to do (retry,
  restart, free room, fix the request);
- `message`: why, for people (the wording may change; never parse it);
- `reason`: where the code alone does not say enough, the reason ckptd gave,
  a stable name: "QUOTA" (the caller's uid reached one of its quotas),
  "DISK_FULL" (the disk bound, the free-space reserve or ENOSPC), "FSYNC",
  "INDEX", "WRITE", "SNAPSHOT_COPY", "NOT_REGISTERED", "STALE_GENERATION",
  "SHUTTING_DOWN", "REPAIRED" (an export found a damaged version that a
  tier's intact copy replaced: read again), "LOST_VERSION" (a version the
  step needs was damaged and no tier holds a copy: restore(older_within=)
  takes the previous one); None when ckptd gave none (and for the errors
  ckpt.torch raises itself). A RESOURCE_EXHAUSTED with reason "QUOTA" is
  this user's limit; with "DISK_FULL" the node's disk.

`ckpt.__version__` is the project's version, the one ckptd's Status reports.
"""


class Error(Exception):
    """A call to ckptd failed: `code` names the status, `message` says why,
    `reason` is the ErrorReason ckptd attached ("QUOTA", "DISK_FULL", ...)
    or None."""

    def __init__(self, code, message, reason=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reason = reason


from ckpt._ckpt import Client, Region, __version__  # noqa: E402  (Error must exist first)

__all__ = ["Client", "Error", "Region"]
