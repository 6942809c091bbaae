#include "base/unique_fd.h"

#include <cerrno>

#include "base/status.h"

namespace ckpt {

absl::Status UniqueFd::Close() {
  if (fd_ < 0) return absl::OkStatus();
  int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0 && errno != EINTR) return ErrnoStatus(errno, "close");
  return absl::OkStatus();
}

}  // namespace ckpt
