// PosixStore: the remote tier on a shared POSIX directory (Lustre, GPFS,
// CephFS, NFS mounts), with the local store's commit rules.
//
// An object `a/b/c` is the file <root>/a/b/c. PutFile/PutBytes write
// <dir>/.tmp.<name>.<unique>, fsync it, rename it over (or, with if_absent,
// link it to, which fails on an existing name) the final name, and fsync the
// directory; so a reader sees the whole object or none, after a crash too.
// Temp files a crash left behind are skipped by List (and may be removed by
// hand: no object is ever named .tmp.*). Keys must be relative, '/'-separated, without empty,
// "." or ".." components (INVALID_ARGUMENT); no component is followed
// through a symbolic link (FAILED_PRECONDITION).
//
// Trust: only ckptd may write the directory. Open refuses a root that
// another uid could change (owned by someone else, writable by its group or
// by others, or under a directory that is, unless that one is sticky and
// root's, like /tmp); and every directory and file read below it must be
// owned by ckptd's uid and writable by it alone, and be what it claims (a
// FIFO or a device planted as an object is refused without being opened for
// I/O, so it can never block a thread). What ckptd wrote is authenticated
// on top of that (remote_auth.h).
//
// Thread-safety: thread-safe (no state beyond the root's fd).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "base/unique_fd.h"
#include "daemon/remote/remote_store.h"

namespace ckpt::remote {

class PosixStore final : public RemoteStore {
 public:
  // Opens `root` (creating it, 0750, when missing). FAILED_PRECONDITION
  // when it is not a directory, or another uid could write it or a
  // directory above it (the message says which and what to change); the
  // errno's code otherwise.
  static absl::StatusOr<std::unique_ptr<PosixStore>> Open(const std::string& root);

  std::string Describe() const override;
  absl::Status PutFile(const std::string& key, int fd, uint64_t size) override;
  absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) override;
  absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd, uint64_t max_bytes) override;
  absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max_bytes) override;
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix) override;
  absl::Status Delete(const std::string& key) override;

  // Publishes `key` (as PutFile does) from what `write` puts into the temp
  // file it is handed. With `direct` that file is opened O_DIRECT where the
  // file system allows it (fcntl(F_GETFL) tells `write`): its writes must
  // then be aligned to 4096 bytes in offset, length and address, and it
  // sets the object's size with ftruncate.
  absl::Status PutWith(const std::string& key, bool if_absent, bool direct,
                       const std::function<absl::Status(int fd)>& write);
  // Removes the temp files a crash left anywhere below the root. Only for a
  // directory that this process alone writes: another writer's temp file
  // may be one it is still filling.
  absl::Status RemoveTempFiles();
  // The object `key` opened for reading, with its size; INVALID_ARGUMENT
  // when larger than `max_bytes`.
  absl::StatusOr<UniqueFd> OpenObject(const std::string& key, uint64_t max_bytes,
                                      uint64_t* size) const;

 private:
  PosixStore(std::string root, UniqueFd root_fd)
      : root_(std::move(root)), root_fd_(std::move(root_fd)) {}
  // The directory holding `key` (created when `create`) and the key's last
  // component.
  absl::StatusOr<UniqueFd> OpenParent(const std::string& key, bool create, std::string* name) const;
  // Writes a temp file in `dir` with `write` filling it, fsyncs it and
  // publishes it as `name`.
  absl::Status Publish(int dir, const std::string& name, bool if_absent, bool direct,
                       const std::function<absl::Status(int fd)>& write) const;

  const std::string root_;
  const UniqueFd root_fd_;
};

}  // namespace ckpt::remote
