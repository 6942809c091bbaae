// RemoteStore: the remote tier's object interface (docs/remote.md).
//
// ckptd copies every durable layer version and each step's manifest to a
// remote tier in the background, and reads them back on a replacement node.
// Two backends implement this interface:
//   s3_store.h     S3-compatible object stores (AWS S3, Ceph RGW, MinIO):
//                  SigV4 over libcurl's multi interface, multipart uploads
//   posix_store.h  a shared POSIX directory (Lustre, GPFS, CephFS, NFS): the
//                  local commit rules (temp, fsync, rename, fsync the dir)
// and faulty_store.h wraps either with injected failures for the tests.
//
// Keys are '/'-separated relative names built by remote_layout.h; a backend
// maps them below its own prefix. Objects are written whole and never
// modified; ckptd checks what it reads against the checksums it wrote, so a
// backend need not (but the S3 one sends each part's SHA-256, which the
// server checks).
//
// Status codes every backend returns, which the uploader and the metrics
// rely on:
//   UNAVAILABLE        the store cannot be reached, or it answered 5xx or
//                      throttled after the retries; worth trying again later
//   PERMISSION_DENIED  credentials refused (403) or a file mode refused
//   UNAUTHENTICATED    the credentials are missing or malformed
//   NOT_FOUND          no such object
//   ALREADY_EXISTS     a conditional create met an existing object
//   DATA_LOSS          the bytes that arrived do not match what was sent
//   INVALID_ARGUMENT   a bad key or size
//   DEADLINE_EXCEEDED  a request ran past its timeout
// Error messages never contain a credential.
//
// Thread-safety: implementations are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::remote {

struct ObjectInfo {
  std::string key;  // relative to the store's prefix, as passed to Put*
  uint64_t size = 0;
};

class RemoteStore {
 public:
  virtual ~RemoteStore() = default;

  // Where the objects go, for logs and `ckptctl status`, e.g.
  // "s3 http://127.0.0.1:7480 bucket ckpt prefix node-a/" or "posix /mnt/x".
  // Never a credential.
  virtual std::string Describe() const = 0;

  // Ends the calls in flight now, at once, with CANCELLED (where the store
  // can: a peer's gRPC calls); later calls run as usual. ckptd calls it
  // when it stops, so a transfer never holds the shutdown to its deadline.
  virtual void CancelCalls() {}

  // Stores the first `size` bytes of `fd` (read with pread from offset 0) as
  // `key`, replacing an object of that name. Nothing is visible under `key`
  // until the whole object is.
  virtual absl::Status PutFile(const std::string& key, int fd, uint64_t size) = 0;

  // Stores `data` as `key`. With `if_absent`, ALREADY_EXISTS when `key`
  // exists (where the store can tell; S3 with If-None-Match: *, POSIX with a
  // no-replace rename).
  virtual absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) = 0;

  // Writes the whole object into `fd` from offset 0 and returns its size.
  // NOT_FOUND when missing; INVALID_ARGUMENT (nothing written past it) when
  // it is larger than `max_bytes`.
  virtual absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd,
                                             uint64_t max_bytes) = 0;

  // The whole object in memory; NOT_FOUND when missing; INVALID_ARGUMENT when
  // larger than `max_bytes`.
  virtual absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max_bytes) = 0;

  // Every object whose key starts with `prefix`, ascending by key.
  virtual absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix) = 0;

  // Removes `key`; OK when it does not exist.
  virtual absl::Status Delete(const std::string& key) = 0;
};

}  // namespace ckpt::remote
