// FileSystem: the one seam through which ckptd touches files and directories.
//
// Every metadata operation of the commit protocol (create temp, allocate,
// fdatasync, rename, directory fsync, unlink, list) goes through this class so
// that tests can substitute a fault-injecting twin (tests/lib/) that drops
// unsynced data, forgets unsynced renames or fails the n-th call. Bulk data
// moves through IoBackend (io_backend.h).
//
// Names passed as `name` are single path components created by ckptd itself;
// they are opened relative to a directory fd with RESOLVE_BENEATH and
// RESOLVE_NO_SYMLINKS (openat2), so nothing escapes the directory. A symbolic
// link met where a file or directory is opened gives FAILED_PRECONDITION
// ("... is a symbolic link"), never a followed link.
//
// Thread-safety: the default implementation is stateless and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/unique_fd.h"

namespace ckpt {

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // Creates `path` and its parents with mode 0750 when missing; opens it.
  virtual absl::StatusOr<UniqueFd> MakeDirs(const std::string& path);
  // Creates (0750) or opens the subdirectory `name` of `dir_fd`.
  virtual absl::StatusOr<UniqueFd> OpenSubdir(int dir_fd, const std::string& name, bool create);
  // Creates `name` exclusively, for writing and reading back (a version
  // adopted from the remote tier is authenticated through the descriptor it
  // was written through). With `direct` it asks for
  // O_DIRECT; where the file system refuses O_DIRECT (tmpfs) it falls back to
  // buffered I/O and sets *direct_used = false.
  virtual absl::StatusOr<UniqueFd> CreateExclusive(int dir_fd, const std::string& name, bool direct,
                                                   bool* direct_used);
  virtual absl::StatusOr<UniqueFd> OpenForRead(int dir_fd, const std::string& name, bool direct,
                                               bool* direct_used);
  // Reserves `len` bytes (fallocate); ENOSPC surfaces here as RESOURCE_EXHAUSTED.
  virtual absl::Status Allocate(int fd, uint64_t len);
  // fdatasync. A failure is final for the data written through `fd`: callers
  // must not retry and trust it.
  virtual absl::Status DataSync(int fd);
  // renameat2(RENAME_NOREPLACE) inside one directory.
  virtual absl::Status RenameNoReplace(int dir_fd, const std::string& from, const std::string& to);
  // renameat2(RENAME_NOREPLACE) of `from` in `from_dir` to `to` in `to_dir`
  // (both plain names; the entry is moved, a symbolic link included, never
  // followed). Both directories must be fsynced to make the move durable.
  virtual absl::Status MoveNoReplace(int from_dir, const std::string& from, int to_dir,
                                     const std::string& to);
  // Opens `name` for appending, creating it (0640) when missing; refuses
  // (FAILED_PRECONDITION naming `name`) when it is a symbolic link.
  virtual absl::StatusOr<UniqueFd> OpenForAppend(int dir_fd, const std::string& name);
  // Writes all of `data` at the end of the file (O_APPEND).
  virtual absl::Status Append(int fd, absl::string_view data);
  // fsync of the directory itself, making created/renamed/unlinked entries durable.
  virtual absl::Status SyncDir(int dir_fd);
  virtual absl::Status Unlink(int dir_fd, const std::string& name);
  virtual absl::Status RemoveDir(int dir_fd, const std::string& name);
  // Entry names of `dir_fd` except "." and ".."; sets *is_dir per entry when given.
  virtual absl::StatusOr<std::vector<std::string>> List(int dir_fd,
                                                        std::vector<bool>* is_dir = nullptr);
  virtual absl::StatusOr<uint64_t> FileSize(int fd);
  virtual absl::StatusOr<uint64_t> FileSizeAt(int dir_fd, const std::string& name);
  // Free bytes on the file system holding `fd`.
  virtual absl::StatusOr<uint64_t> FreeBytes(int fd);
  // The size of the file system holding `fd`.
  virtual absl::StatusOr<uint64_t> TotalBytes(int fd);
};

// The process-wide default (real syscalls).
FileSystem* DefaultFileSystem();

}  // namespace ckpt
