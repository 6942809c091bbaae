#include "daemon/io/io_backend.h"

#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt {
namespace {

// ---- pwrite/pread twin ----

class PwriteBackend final : public IoBackend {
 public:
  const char* Name() const override { return "pwrite"; }

  void Submit(IoDirection direction, int fd, absl::Span<const IoSegment> segments) override {
    direction_ = direction;
    fd_ = fd;
    segments_.assign(segments.begin(), segments.end());
  }

  absl::Status Wait() override {
    absl::Status s = direction_ == IoDirection::kWrite ? Write() : Read();
    segments_.clear();
    return s;
  }

 private:
  absl::Status Write() {
    for (const IoSegment& s : segments_) {
      uint64_t done = 0;
      while (done < s.len) {
        ssize_t n = ::pwrite(fd_, static_cast<char*>(s.buf) + done, s.len - done,
                             static_cast<off_t>(s.offset + done));
        if (n < 0) {
          if (errno == EINTR || errno == EAGAIN) continue;
          return ErrnoStatus(errno, "pwrite");
        }
        if (n == 0) return absl::InternalError("pwrite wrote 0 bytes");
        done += static_cast<uint64_t>(n);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Read() {
    for (const IoSegment& s : segments_) {
      uint64_t done = 0;
      while (done < s.len) {
        ssize_t n = ::pread(fd_, static_cast<char*>(s.buf) + done, s.len - done,
                            static_cast<off_t>(s.offset + done));
        if (n < 0) {
          if (errno == EINTR || errno == EAGAIN) continue;
          return ErrnoStatus(errno, "pread");
        }
        if (n == 0) {
          return absl::DataLossError(
              absl::StrCat("file ends at ", s.offset + done, "; expected ", s.offset + s.len));
        }
        done += static_cast<uint64_t>(n);
      }
    }
    return absl::OkStatus();
  }

  IoDirection direction_ = IoDirection::kRead;
  int fd_ = -1;
  std::vector<IoSegment> segments_;
};

// ---- io_uring twin ----

// Keeps up to depth_ operations in flight; a short transfer is resubmitted
// for its remainder. On a hard error it stops submitting, reaps everything
// still in flight (the buffers must not be reused while the kernel owns
// them) and returns the first error.
class UringBackend final : public IoBackend {
 public:
  UringBackend() = default;
  ~UringBackend() override { ::io_uring_queue_exit(&ring_); }
  UringBackend(const UringBackend&) = delete;
  UringBackend& operator=(const UringBackend&) = delete;

  absl::Status Init(unsigned depth) {
    depth_ = depth == 0 ? 1 : depth;
    int rc = ::io_uring_queue_init(depth_, &ring_, 0);
    if (rc < 0) return ErrnoStatus(-rc, "io_uring_queue_init");
    slots_.resize(depth_);
    return absl::OkStatus();
  }

  const char* Name() const override { return "io_uring"; }
  bool Overlaps() const override { return true; }

  void Submit(IoDirection direction, int fd, absl::Span<const IoSegment> segments) override {
    write_ = direction == IoDirection::kWrite;
    fd_ = fd;
    todo_.clear();
    for (const IoSegment& s : segments) {
      if (s.len > 0) todo_.push_back(Op{static_cast<char*>(s.buf), s.len, s.offset});
    }
    free_slots_.clear();
    for (unsigned i = 0; i < depth_; ++i) free_slots_.push_back(depth_ - 1 - i);
    in_flight_ = 0;
    unsubmitted_ = 0;
    fatal_ = false;
    first_error_ =
        broken_ ? absl::UnavailableError("io_uring ring failed earlier") : absl::OkStatus();
    if (first_error_.ok()) Pump();
  }

  absl::Status Wait() override {
    while (!fatal_ &&
           ((!todo_.empty() && first_error_.ok()) || in_flight_ > 0 || unsubmitted_ > 0)) {
      Pump();
      if (fatal_) break;
      if (in_flight_ == 0) {
        if (unsubmitted_ > 0) continue;  // transient submit failure: retry
        break;
      }
      struct io_uring_cqe* cqe = nullptr;
      int rc = ::io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // Operations still in flight own their buffers: reap them before the
        // caller can reuse the memory.
        broken_ = true;
        return DrainAfterFailure(ErrnoStatus(-rc, "io_uring_wait_cqe"));
      }
      Complete(cqe);
    }
    // The ring is unusable. Operations already in flight still own their
    // buffers: reap them before returning.
    if (fatal_) return DrainAfterFailure(first_error_);
    return first_error_;
  }

 private:
  struct Op {
    char* buf;
    uint64_t len;  // remaining
    uint64_t offset;
  };

  // Queues what fits in the ring and submits it. A submission that fails
  // for good breaks the ring (fatal_).
  void Pump() {
    unsigned queued = 0;
    while (first_error_.ok() && !todo_.empty() && !free_slots_.empty()) {
      struct io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      unsigned slot = free_slots_.back();
      free_slots_.pop_back();
      slots_[slot] = todo_.front();
      todo_.pop_front();
      // Single transfers are capped below 2 GiB like read(2)/write(2).
      unsigned len = static_cast<unsigned>(std::min<uint64_t>(slots_[slot].len, 1u << 30));
      if (write_) {
        ::io_uring_prep_write(sqe, fd_, slots_[slot].buf, len, slots_[slot].offset);
      } else {
        ::io_uring_prep_read(sqe, fd_, slots_[slot].buf, len, slots_[slot].offset);
      }
      ::io_uring_sqe_set_data64(sqe, slot);
      ++queued;
    }
    unsubmitted_ += queued;
    if (unsubmitted_ == 0) return;
    int rc = ::io_uring_submit(&ring_);
    if (rc >= 0) {
      in_flight_ += static_cast<unsigned>(rc);
      unsubmitted_ -= static_cast<unsigned>(rc);
    } else if (rc != -EAGAIN && rc != -EBUSY && rc != -EINTR) {
      broken_ = true;
      fatal_ = true;
      if (first_error_.ok()) first_error_ = ErrnoStatus(-rc, "io_uring_submit");
    }
  }

  // One completion: done, resubmitted for its remainder, or an error.
  void Complete(struct io_uring_cqe* cqe) {
    unsigned slot = static_cast<unsigned>(::io_uring_cqe_get_data64(cqe));
    int res = cqe->res;
    ::io_uring_cqe_seen(&ring_, cqe);
    --in_flight_;
    Op& op = slots_[slot];
    if (res == -EINTR || res == -EAGAIN) {
      todo_.push_front(op);
    } else if (res < 0) {
      if (first_error_.ok())
        first_error_ = ErrnoStatus(-res, write_ ? "io_uring write" : "io_uring read");
    } else if (res == 0) {
      if (first_error_.ok()) {
        first_error_ = write_ ? absl::InternalError("io_uring write made no progress")
                              : absl::DataLossError(absl::StrCat(
                                    "file ends at ", op.offset, "; expected ", op.offset + op.len));
      }
    } else if (static_cast<uint64_t>(res) < op.len) {
      op.buf += res;
      op.len -= static_cast<uint64_t>(res);
      op.offset += static_cast<uint64_t>(res);
      todo_.push_front(op);  // short transfer: the remainder goes again
    }
    free_slots_.push_back(slot);
  }

  absl::Status DrainAfterFailure(absl::Status error) {
    while (in_flight_ > 0) {
      struct io_uring_cqe* cqe = nullptr;
      int rc = ::io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // The kernel may still write into buffers we cannot reclaim: returning
        // would let the caller hand them out again. Fail-stop instead.
        CKPT_LOG(ERROR) << "io_uring: cannot reap " << in_flight_ << " operations in flight ("
                        << std::strerror(-rc) << "); aborting";
        std::abort();
      }
      ::io_uring_cqe_seen(&ring_, cqe);
      --in_flight_;
    }
    return error;
  }

  unsigned depth_ = 0;
  bool broken_ = false;
  struct io_uring ring_ {};
  // The transfer between Submit and Wait.
  bool write_ = false;
  int fd_ = -1;
  std::deque<Op> todo_;
  std::vector<Op> slots_;
  std::vector<unsigned> free_slots_;
  unsigned in_flight_ = 0;
  unsigned unsubmitted_ = 0;
  bool fatal_ = false;  // the ring failed to submit: drain and stop
  absl::Status first_error_;
};

}  // namespace

absl::StatusOr<IoBackendKind> ParseIoBackendKind(const std::string& s) {
  if (s == "auto") return IoBackendKind::kAuto;
  if (s == "io_uring" || s == "uring") return IoBackendKind::kUring;
  if (s == "pwrite") return IoBackendKind::kPwrite;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown io backend '", s, "'; expected auto, io_uring or pwrite"));
}

const char* IoBackendKindName(IoBackendKind kind) {
  switch (kind) {
    case IoBackendKind::kAuto:
      return "auto";
    case IoBackendKind::kUring:
      return "io_uring";
    case IoBackendKind::kPwrite:
      return "pwrite";
  }
  return "unknown";
}

std::unique_ptr<IoBackend> MakePwriteBackend() { return std::make_unique<PwriteBackend>(); }

absl::StatusOr<std::unique_ptr<IoBackend>> MakeUringBackend(unsigned queue_depth) {
  auto b = std::make_unique<UringBackend>();
  absl::Status s = b->Init(queue_depth);
  if (!s.ok()) return absl::UnavailableError(std::string(s.message()));
  return std::unique_ptr<IoBackend>(std::move(b));
}

absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackend(IoBackendKind kind, unsigned queue_depth) {
  switch (kind) {
    case IoBackendKind::kPwrite:
      return MakePwriteBackend();
    case IoBackendKind::kUring:
      return MakeUringBackend(queue_depth);
    case IoBackendKind::kAuto: {
      auto uring = MakeUringBackend(queue_depth);
      if (uring.ok()) return uring;
      return MakePwriteBackend();
    }
  }
  return absl::InvalidArgumentError("bad io backend kind");
}

}  // namespace ckpt
