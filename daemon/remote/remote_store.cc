#include "daemon/remote/remote_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt::remote {

namespace {
constexpr size_t kAlign = 4096;
}  // namespace

absl::StatusOr<SequentialFileReader> SequentialFileReader::Open(int fd, size_t piece_bytes) {
  SequentialFileReader r;
  r.fd_ = fd;
  r.cap_ = std::max<size_t>(kAlign, (piece_bytes + kAlign - 1) / kAlign * kAlign);
  r.buf_ = static_cast<char*>(std::aligned_alloc(kAlign, r.cap_));
  if (r.buf_ == nullptr) return absl::ResourceExhaustedError("no memory for a read buffer");
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  r.direct_ = open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  return r;
}

SequentialFileReader& SequentialFileReader::operator=(SequentialFileReader&& other) noexcept {
  if (this != &other) {
    if (direct_ >= 0) close(direct_);
    std::free(buf_);
    fd_ = other.fd_;
    direct_ = std::exchange(other.direct_, -1);
    buf_ = std::exchange(other.buf_, nullptr);
    cap_ = other.cap_;
  }
  return *this;
}

SequentialFileReader::~SequentialFileReader() {
  if (direct_ >= 0) close(direct_);
  std::free(buf_);
}

absl::StatusOr<std::string_view> SequentialFileReader::Read(uint64_t offset, size_t n) {
  n = std::min(n, cap_);
  // O_DIRECT wants aligned offsets and lengths: the pieces are whole
  // multiples of 4 KiB apart, and the last may ask past the end.
  const bool direct = direct_ >= 0 && offset % kAlign == 0;
  const int fd = direct ? direct_ : fd_;
  const size_t want = direct ? (n + kAlign - 1) / kAlign * kAlign : n;
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(fd, buf_ + got, want - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(errno, "read an object's bytes");
    if (r == 0) {
      return absl::DataLossError(
          absl::StrCat("short file: ", offset + got, " bytes, ", n - got, " more expected"));
    }
    got += static_cast<size_t>(r);
    if (direct && got % kAlign != 0 && got < n) {
      return absl::DataLossError("a direct read ended inside a block");
    }
  }
  return std::string_view(buf_, n);
}

namespace {
constexpr size_t kWriteBlock = 1 << 20;
}  // namespace

absl::StatusOr<SequentialFileWriter> SequentialFileWriter::Open(int fd) {
  SequentialFileWriter w;
  w.fd_ = fd;
  w.buf_ = static_cast<char*>(std::aligned_alloc(kAlign, kWriteBlock));
  if (w.buf_ == nullptr) return absl::ResourceExhaustedError("no memory for a write buffer");
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  w.direct_ = open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  return w;
}

SequentialFileWriter& SequentialFileWriter::operator=(SequentialFileWriter&& other) noexcept {
  if (this != &other) {
    if (direct_ >= 0) close(direct_);
    std::free(buf_);
    fd_ = other.fd_;
    direct_ = std::exchange(other.direct_, -1);
    buf_ = std::exchange(other.buf_, nullptr);
    used_ = other.used_;
    done_ = other.done_;
  }
  return *this;
}

SequentialFileWriter::~SequentialFileWriter() {
  if (direct_ >= 0) close(direct_);
  std::free(buf_);
}

absl::Status SequentialFileWriter::Flush(size_t n, bool direct) {
  const int fd = direct ? direct_ : fd_;
  size_t off = 0;
  while (off < n) {
    ssize_t w = pwrite(fd, buf_ + off, n - off, static_cast<off_t>(done_ + off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ErrnoStatus(errno, "write an object's bytes");
    off += static_cast<size_t>(w);
  }
  done_ += n;
  std::memmove(buf_, buf_ + n, used_ - n);
  used_ -= n;
  return absl::OkStatus();
}

absl::Status SequentialFileWriter::Append(std::string_view data) {
  while (!data.empty()) {
    const size_t n = std::min(data.size(), kWriteBlock - used_);
    std::memcpy(buf_ + used_, data.data(), n);
    used_ += n;
    data.remove_prefix(n);
    if (used_ == kWriteBlock) CKPT_RETURN_IF_ERROR(Flush(kWriteBlock, direct_ >= 0));
  }
  return absl::OkStatus();
}

absl::Status SequentialFileWriter::Finish() {
  // The whole blocks direct, the rest buffered.
  const size_t whole = direct_ >= 0 ? used_ / kAlign * kAlign : 0;
  if (whole > 0) CKPT_RETURN_IF_ERROR(Flush(whole, true));
  if (used_ > 0) CKPT_RETURN_IF_ERROR(Flush(used_, false));
  return absl::OkStatus();
}

absl::Status ObserveFile(int fd, uint64_t size, const RemoteStore::Observer& observe) {
  std::string buf(static_cast<size_t>(std::min<uint64_t>(size, 1 << 20)), '\0');
  uint64_t done = 0;
  while (done < size) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    ssize_t r = pread(fd, buf.data(), want, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(errno, "read an object's bytes");
    if (r == 0)
      return absl::DataLossError(absl::StrCat("short file: ", done, " of ", size, " bytes"));
    CKPT_RETURN_IF_ERROR(observe(std::string_view(buf.data(), static_cast<size_t>(r))));
    done += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

absl::Status RemoteStore::PutFileObserved(const std::string& key, int fd, uint64_t size,
                                          const Observer& observe) {
  CKPT_RETURN_IF_ERROR(ObserveFile(fd, size, observe));
  return PutFile(key, fd, size);
}

absl::StatusOr<uint64_t> RemoteStore::GetToFileObserved(const std::string& key, int fd,
                                                        uint64_t max_bytes,
                                                        const Observer& observe) {
  CKPT_ASSIGN_OR_RETURN(uint64_t size, GetToFile(key, fd, max_bytes));
  CKPT_RETURN_IF_ERROR(ObserveFile(fd, size, observe));
  return size;
}

}  // namespace ckpt::remote
