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

void DirectBuffer::Free::operator()(char* p) const { std::free(p); }

absl::StatusOr<DirectBuffer> DirectBuffer::Open(int fd, int flags, size_t bytes) {
  DirectBuffer b;
  b.size_ = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  b.buf_.reset(static_cast<char*>(std::aligned_alloc(kAlign, b.size_)));
  if (b.buf_ == nullptr) return absl::ResourceExhaustedError("no memory for an I/O buffer");
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  b.direct_ = UniqueFd(open(self.c_str(), flags | O_DIRECT | O_CLOEXEC));
  return b;
}

absl::StatusOr<SequentialFileReader> SequentialFileReader::Open(int fd, size_t piece_bytes) {
  CKPT_ASSIGN_OR_RETURN(DirectBuffer io, DirectBuffer::Open(fd, O_RDONLY, piece_bytes));
  return SequentialFileReader(fd, std::move(io));
}

absl::StatusOr<std::string_view> SequentialFileReader::Read(uint64_t offset, size_t n) {
  n = std::min(n, io_.size());
  // O_DIRECT wants aligned offsets and lengths: the pieces are whole
  // multiples of 4 KiB apart, and the last may ask past the end.
  const bool direct = io_.direct() >= 0 && offset % kAlign == 0;
  const int fd = direct ? io_.direct() : fd_;
  const size_t want = direct ? (n + kAlign - 1) / kAlign * kAlign : n;
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(fd, io_.data() + got, want - got, static_cast<off_t>(offset + got));
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
  return std::string_view(io_.data(), n);
}

absl::Status FillFromFile(SequentialFileReader* reader, uint64_t offset, size_t n,
                          std::string* out) {
  out->clear();
  while (out->size() < n) {
    CKPT_ASSIGN_OR_RETURN(std::string_view got,
                          reader->Read(offset + out->size(), n - out->size()));
    out->append(got);
  }
  return absl::OkStatus();
}

namespace {
constexpr size_t kWriteBlock = 1 << 20;
}  // namespace

absl::StatusOr<SequentialFileWriter> SequentialFileWriter::Open(int fd) {
  CKPT_ASSIGN_OR_RETURN(DirectBuffer io, DirectBuffer::Open(fd, O_WRONLY, kWriteBlock));
  return SequentialFileWriter(fd, std::move(io));
}

absl::Status SequentialFileWriter::Flush(size_t n, bool direct) {
  const int fd = direct ? io_.direct() : fd_;
  size_t off = 0;
  while (off < n) {
    ssize_t w = pwrite(fd, io_.data() + off, n - off, static_cast<off_t>(done_ + off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ErrnoStatus(errno, "write an object's bytes");
    off += static_cast<size_t>(w);
  }
  done_ += n;
  std::memmove(io_.data(), io_.data() + n, used_ - n);
  used_ -= n;
  return absl::OkStatus();
}

absl::Status SequentialFileWriter::Append(std::string_view data) {
  while (!data.empty()) {
    const size_t n = std::min(data.size(), kWriteBlock - used_);
    std::memcpy(io_.data() + used_, data.data(), n);
    used_ += n;
    data.remove_prefix(n);
    if (used_ == kWriteBlock) CKPT_RETURN_IF_ERROR(Flush(kWriteBlock, io_.direct() >= 0));
  }
  return absl::OkStatus();
}

absl::Status SequentialFileWriter::Finish() {
  // The whole blocks direct, the rest buffered.
  const size_t whole = io_.direct() >= 0 ? used_ / kAlign * kAlign : 0;
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

absl::Status RemoteStore::PutFilledObserved(const std::string& key, uint64_t, const Filler&,
                                            const Observer&) {
  return absl::UnimplementedError(
      absl::StrCat(Describe(), " stores files, not bytes filled in as they go (", key, ")"));
}

absl::StatusOr<uint64_t> RemoteStore::GetToFileObserved(const std::string& key, int fd,
                                                        uint64_t max_bytes,
                                                        const Observer& observe) {
  CKPT_ASSIGN_OR_RETURN(uint64_t size, GetToFile(key, fd, max_bytes));
  CKPT_RETURN_IF_ERROR(ObserveFile(fd, size, observe));
  return size;
}

}  // namespace ckpt::remote
