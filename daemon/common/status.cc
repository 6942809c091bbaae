#include "daemon/common/status.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace ckpt {

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
