#include "base/status.h"

#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ckpt {
namespace {

// The payload's type URL; its value is the reason's number in decimal.
constexpr absl::string_view kReasonUrl = "type.googleapis.com/ckpt.v1.ErrorInfo";

}  // namespace

absl::Status WithReason(absl::Status status, ErrorReason reason) {
  if (status.ok()) return status;
  status.SetPayload(kReasonUrl, absl::Cord(absl::StrCat(static_cast<int>(reason))));
  return status;
}

ErrorReason ReasonOf(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kReasonUrl);
  int value = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &value) || value < 0 ||
      value >= kErrorReasonCount) {
    return ErrorReason::kUnspecified;
  }
  return static_cast<ErrorReason>(value);
}

const char* ReasonName(ErrorReason reason) {
  switch (reason) {
    case ErrorReason::kUnspecified:
      return "unspecified";
    case ErrorReason::kNotRegistered:
      return "not_registered";
    case ErrorReason::kStaleGeneration:
      return "stale_generation";
    case ErrorReason::kShuttingDown:
      return "shutting_down";
    case ErrorReason::kDiskFull:
      return "disk_full";
    case ErrorReason::kFsync:
      return "fsync";
    case ErrorReason::kIndex:
      return "index";
    case ErrorReason::kWrite:
      return "write";
    case ErrorReason::kSnapshotCopy:
      return "snapshot_copy";
    case ErrorReason::kQuota:
      return "quota";
    case ErrorReason::kRepaired:
      return "repaired";
    case ErrorReason::kLostVersion:
      return "lost_version";
  }
  return "unspecified";
}

absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    case ENOENT:
      return absl::NotFoundError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case EINVAL:
      return absl::InvalidArgumentError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case EAGAIN:
    case EINTR:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace ckpt
