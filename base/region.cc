#include "base/region.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1
#endif

namespace ckpt {

absl::StatusOr<MemfdRegion> MemfdRegion::Create(const std::string& name, uint64_t bytes,
                                                bool open_to_seals) {
  if (bytes == 0 || bytes > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("region size ", bytes, " out of range"));
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  bytes = (bytes + page - 1) / page * page;
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoStatus(errno, "memfd_create");
  UniqueFd owned(fd);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return ErrnoStatus(errno, "ftruncate");
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | (open_to_seals ? 0 : F_SEAL_SEAL)) !=
      0) {
    return ErrnoStatus(errno, "F_ADD_SEALS");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap memfd");
  MemfdRegion r;
  r.mapping_ = SharedMapping(std::move(owned), p, bytes);
  return r;
}

SharedMapping::~SharedMapping() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

SharedMapping::SharedMapping(SharedMapping&& o) noexcept
    : fd_(std::move(o.fd_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

SharedMapping& SharedMapping::operator=(SharedMapping&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(data_, size_);
    fd_ = std::move(o.fd_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

absl::StatusOr<MappedRegion> MappedRegion::Map(UniqueFd fd) {
  // The seal first: once F_SEAL_SHRINK is on, the size read next cannot
  // shrink before (or after) the mapping, so no access can fault.
  int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError("region fd is not a memfd sealed with F_SEAL_SHRINK");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::InvalidArgumentError("region fd is sealed against writes");
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat region");
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError("region fd is not a regular file");
  struct statfs fs;
  if (::fstatfs(fd.get(), &fs) != 0) return ErrnoStatus(errno, "fstatfs region");
  if (fs.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError("region fd is not a memfd of shared memory (tmpfs)");
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0 || size > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("region size ", size, " out of range"));
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap region");
  MappedRegion r;
  r.mapping_ = SharedMapping(std::move(fd), p, size);
  return r;
}

absl::Status MappedRegion::SealAgainstHoles() const {
  if (::fcntl(mapping_.fd(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE) != 0) {
    return ErrnoStatus(errno, "F_ADD_SEALS F_SEAL_FUTURE_WRITE");
  }
  return absl::OkStatus();
}

bool MappedRegion::LockWhole(uint64_t bytes) const {
  bytes = std::min(bytes, size());
  const off_t hole = ::lseek(mapping_.fd(), 0, SEEK_HOLE);
  if (hole < 0 || static_cast<uint64_t>(hole) < bytes) return false;
  // Locked, the pages can neither be punched (the seal) nor reclaimed to
  // swap under the mapping; mapped in one pass, not a fault per page.
  // munmap unlocks them.
  return ::mlock(data(), bytes) == 0;
}

}  // namespace ckpt
