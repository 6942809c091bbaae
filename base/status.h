// Status helpers shared by every ckptd subsystem.
//
// Errors are values (absl::Status / absl::StatusOr). Debian's Abseil
// (20220623) has no status macros, so they are defined once here. An error is
// swallowed only through IgnoreError(), which names the reason.
//
// A status that a caller acts on beyond its code (the client deciding that
// ckptd lost its registration, a metric label naming what failed) carries a
// machine-readable ErrorReason as a payload. Code never branches on message
// text: messages are for people and may be reworded at any time.
#pragma once

#include <cerrno>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define CKPT_STATUS_CONCAT_INNER_(a, b) a##b
#define CKPT_STATUS_CONCAT_(a, b) CKPT_STATUS_CONCAT_INNER_(a, b)

// Returns from the current function when `expr` (an absl::Status) is not OK.
#define CKPT_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status ckpt_status_ = (expr);        \
    if (!ckpt_status_.ok()) return ckpt_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define CKPT_ASSIGN_OR_RETURN(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL_(CKPT_STATUS_CONCAT_(ckpt_statusor_, __LINE__), lhs, expr)
#define CKPT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

namespace ckpt {

// Maps an errno value to the status code a caller should act on:
// ENOSPC/EDQUOT -> RESOURCE_EXHAUSTED, ENOENT -> NOT_FOUND,
// EEXIST -> ALREADY_EXISTS, EINVAL -> INVALID_ARGUMENT, EACCES/EPERM ->
// PERMISSION_DENIED, EAGAIN/EINTR -> UNAVAILABLE, EIO and the rest -> INTERNAL.
absl::Status ErrnoStatus(int err, absl::string_view what);

// Why a call failed, where the code alone does not say enough. The numbers
// are the wire values of ckpt.v1.ErrorReason (ckpt.proto); append only.
enum class ErrorReason : int {
  kUnspecified = 0,
  kNotRegistered = 1,    // ckptd has no live registration of the rank (it restarted)
  kStaleGeneration = 2,  // a newer registration of the rank replaced this one
  kShuttingDown = 3,     // ckptd is stopping; the call will not succeed here
  kDiskFull = 4,         // the disk bound, the free-space reserve or ENOSPC
  kFsync = 5,            // fdatasync/fsync of a layer version or directory failed
  kIndex = 6,            // the RocksDB index failed
  kWrite = 7,            // creating or writing a layer version's file failed
  kSnapshotCopy = 8,     // copying a snapshot out of the trainer's memory failed
  kQuota = 9,            // the caller's uid reached one of its quotas (bytes or queued steps)
  kRepaired = 10,        // a tier's intact copy replaced a damaged version: read again
  kLostVersion = 11,     // a version the plan needs was damaged and no tier holds a copy
};
inline constexpr int kErrorReasonCount = 12;

// `status` with `reason` attached (OK stays OK). Replaces an earlier reason.
absl::Status WithReason(absl::Status status, ErrorReason reason);
// The attached reason, kUnspecified when there is none.
ErrorReason ReasonOf(const absl::Status& status);
// A short snake_case name ("not_registered", "fsync", ...), for metric
// labels and logs; "unspecified" for kUnspecified.
const char* ReasonName(ErrorReason reason);

// Drops `status` on purpose; `why` documents the reason at the call site.
inline void IgnoreError(const absl::Status& status, const char* why) {
  (void)status;
  (void)why;
}

}  // namespace ckpt
