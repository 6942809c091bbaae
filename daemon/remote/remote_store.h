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
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/unique_fd.h"

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

  // Sees an object's bytes in order, each once, as they pass (the object's
  // MAC is taken this way); an error stops the transfer.
  using Observer = std::function<absl::Status(std::string_view bytes)>;

  // PutFile, with `observe` shown every byte that is stored, in order,
  // before OK is returned. A store that sends the file in one ordered pass
  // shows the bytes as it sends them (the file is read once); this default
  // reads the file once for `observe`, then PutFile reads it again.
  virtual absl::Status PutFileObserved(const std::string& key, int fd, uint64_t size,
                                       const Observer& observe);

  // Puts `n` bytes of an object, those at `offset`, into `*out` (replacing
  // what it held). Called in order, each offset the previous one plus its n.
  using Filler = std::function<absl::Status(uint64_t offset, size_t n, std::string* out)>;

  // Whether PutFilledObserved stores bytes as they are filled in, without
  // first writing them anywhere (a peer): the uploader then sends a version
  // the memory tier holds from memory instead of reading its file.
  virtual bool PutsFromMemory() const { return false; }

  // PutFileObserved for an object of `size` bytes that `fill` gives, in
  // pieces the store chooses; each piece is shown to `observe` once it is
  // filled. UNIMPLEMENTED where PutsFromMemory() is false.
  virtual absl::Status PutFilledObserved(const std::string& key, uint64_t size, const Filler& fill,
                                         const Observer& observe);

  // Stores `data` as `key`. With `if_absent`, ALREADY_EXISTS when `key`
  // exists (where the store can tell; S3 with If-None-Match: *, POSIX with a
  // no-replace rename).
  virtual absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) = 0;

  // Writes the whole object into `fd` from offset 0 and returns its size.
  // NOT_FOUND when missing; INVALID_ARGUMENT (nothing written past it) when
  // it is larger than `max_bytes`.
  virtual absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd,
                                             uint64_t max_bytes) = 0;

  // GetToFile, with `observe` shown every byte written to `fd`, in order.
  // This default reads `fd` back after GetToFile; a store that receives in
  // order shows the bytes as they arrive.
  virtual absl::StatusOr<uint64_t> GetToFileObserved(const std::string& key, int fd,
                                                     uint64_t max_bytes, const Observer& observe);

  // The whole object in memory; NOT_FOUND when missing; INVALID_ARGUMENT when
  // larger than `max_bytes`.
  virtual absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max_bytes) = 0;

  // Every object whose key starts with `prefix`, ascending by key.
  virtual absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix) = 0;

  // Removes `key`; OK when it does not exist.
  virtual absl::Status Delete(const std::string& key) = 0;
};

// A file's O_DIRECT twin and an aligned buffer, for the sequential reader
// and writer below: the descriptor reopened through /proc/self/fd with
// O_DIRECT (none where the file system refuses it), and `bytes` of
// 4 KiB-aligned memory. Move-only; owns both.
class DirectBuffer {
 public:
  static absl::StatusOr<DirectBuffer> Open(int fd, int flags, size_t bytes);
  int direct() const { return direct_.get(); }  // -1 when there is none
  char* data() const { return buf_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(char* p) const;
  };
  UniqueFd direct_;
  std::unique_ptr<char, Free> buf_;
  size_t size_ = 0;
};

// Reads a file in order, from any offset on, through one aligned buffer, with
// O_DIRECT where the file's file system allows it: a version written with
// O_DIRECT is not in the page cache, and reading it through the cache would
// fill it with pages read once. Falls back to pread on the descriptor.
class SequentialFileReader {
 public:
  // `piece_bytes` is the most one Read asks for (rounded up to 4 KiB).
  static absl::StatusOr<SequentialFileReader> Open(int fd, size_t piece_bytes);

  // The `n` bytes at `offset` (fewer when n > piece_bytes), valid until
  // the next Read. Offsets should go in order, each the previous one plus
  // its n; the first may be any (4 KiB-aligned ones are read with O_DIRECT).
  // DATA_LOSS when the file ends first.
  absl::StatusOr<std::string_view> Read(uint64_t offset, size_t n);
  bool direct() const { return io_.direct() >= 0; }

 private:
  SequentialFileReader(int fd, DirectBuffer io) : fd_(fd), io_(std::move(io)) {}
  int fd_;  // not owned
  DirectBuffer io_;
};

// A RemoteStore::Filler's work from `reader`: the n bytes at `offset` into
// `*out`, in as many reads as its buffer takes.
absl::Status FillFromFile(SequentialFileReader* reader, uint64_t offset, size_t n,
                          std::string* out);

// Writes a file in order, from offset 0, with O_DIRECT where its file
// system allows it: whole aligned blocks go straight to the disk through an
// aligned buffer, the tail through the descriptor itself (buffered), so the
// caller's fsync has only the tail left to write back. A pulled version is
// written once and fsynced: through the page cache, its write-back was the
// pull's bottleneck on the VMs the figures come from.
class SequentialFileWriter {
 public:
  static absl::StatusOr<SequentialFileWriter> Open(int fd);

  // Appends `data`.
  absl::Status Append(std::string_view data);
  // Writes what is held back (less than a block); call once, at the end.
  absl::Status Finish();
  uint64_t written() const { return done_ + used_; }

 private:
  SequentialFileWriter(int fd, DirectBuffer io) : fd_(fd), io_(std::move(io)) {}
  absl::Status Flush(size_t n, bool direct);

  int fd_;  // not owned
  DirectBuffer io_;
  size_t used_ = 0;
  uint64_t done_ = 0;  // bytes written to the file
};

// Shows `observe` the first `size` bytes of `fd` (pread from offset 0) in
// pieces of 1 MiB. DATA_LOSS when the file is shorter.
absl::Status ObserveFile(int fd, uint64_t size, const RemoteStore::Observer& observe);

}  // namespace ckpt::remote
