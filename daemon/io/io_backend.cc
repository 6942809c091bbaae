#include "daemon/io/io_backend.h"

#include <liburing.h>
#include <unistd.h>

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

  absl::Status WriteAll(int fd, absl::Span<const IoSegment> segments) override {
    for (const IoSegment& s : segments) {
      uint64_t done = 0;
      while (done < s.len) {
        ssize_t n = ::pwrite(fd, static_cast<char*>(s.buf) + done, s.len - done,
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

  absl::Status ReadAll(int fd, absl::Span<const IoSegment> segments) override {
    for (const IoSegment& s : segments) {
      uint64_t done = 0;
      while (done < s.len) {
        ssize_t n = ::pread(fd, static_cast<char*>(s.buf) + done, s.len - done,
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
};

// ---- io_uring twin ----

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
    return absl::OkStatus();
  }

  const char* Name() const override { return "io_uring"; }
  bool Overlaps() const override { return true; }

  absl::Status WriteAll(int fd, absl::Span<const IoSegment> segments) override {
    return Run(fd, segments, /*write=*/true, nullptr);
  }
  absl::Status WriteAllOverlapped(int fd, absl::Span<const IoSegment> segments,
                                  const std::function<void()>& overlap) override {
    return Run(fd, segments, /*write=*/true, &overlap);
  }
  absl::Status ReadAll(int fd, absl::Span<const IoSegment> segments) override {
    return Run(fd, segments, /*write=*/false, nullptr);
  }
  absl::Status ReadAllOverlapped(int fd, absl::Span<const IoSegment> segments,
                                 const std::function<void()>& overlap) override {
    return Run(fd, segments, /*write=*/false, &overlap);
  }

 private:
  struct Op {
    char* buf;
    uint64_t len;  // remaining
    uint64_t offset;
  };

  // Keeps up to depth_ operations in flight; a short transfer is resubmitted
  // for its remainder. On a hard error it stops submitting, reaps everything
  // still in flight (the buffers must not be reused while the kernel owns
  // them) and returns the first error.
  absl::Status Run(int fd, absl::Span<const IoSegment> segments, bool write,
                   const std::function<void()>* overlap) {
    std::deque<Op> todo;
    for (const IoSegment& s : segments) {
      if (s.len > 0) todo.push_back(Op{static_cast<char*>(s.buf), s.len, s.offset});
    }
    std::vector<Op> slots(depth_);
    std::vector<unsigned> free_slots;
    for (unsigned i = 0; i < depth_; ++i) free_slots.push_back(depth_ - 1 - i);
    unsigned in_flight = 0;
    unsigned unsubmitted = 0;
    absl::Status first_error;
    if (broken_) return absl::UnavailableError("io_uring ring failed earlier");

    while ((!todo.empty() && first_error.ok()) || in_flight > 0 || unsubmitted > 0) {
      unsigned queued = 0;
      while (first_error.ok() && !todo.empty() && !free_slots.empty()) {
        struct io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
        if (sqe == nullptr) break;
        unsigned slot = free_slots.back();
        free_slots.pop_back();
        slots[slot] = todo.front();
        todo.pop_front();
        // Single transfers are capped below 2 GiB like read(2)/write(2).
        unsigned len = static_cast<unsigned>(std::min<uint64_t>(slots[slot].len, 1u << 30));
        if (write) {
          ::io_uring_prep_write(sqe, fd, slots[slot].buf, len, slots[slot].offset);
        } else {
          ::io_uring_prep_read(sqe, fd, slots[slot].buf, len, slots[slot].offset);
        }
        ::io_uring_sqe_set_data64(sqe, slot);
        ++queued;
      }
      unsubmitted += queued;
      if (unsubmitted > 0) {
        int rc = ::io_uring_submit(&ring_);
        if (rc >= 0) {
          in_flight += static_cast<unsigned>(rc);
          unsubmitted -= static_cast<unsigned>(rc);
        } else if (rc != -EAGAIN && rc != -EBUSY && rc != -EINTR) {
          // The ring is unusable. Operations already in flight still own
          // their buffers: reap them before returning.
          broken_ = true;
          if (first_error.ok()) first_error = ErrnoStatus(-rc, "io_uring_submit");
          return DrainAfterFailure(in_flight, first_error);
        }
      }
      if (overlap != nullptr) {
        // Once, while the first transfers are in flight.
        (*overlap)();
        overlap = nullptr;
      }
      if (in_flight == 0) {
        if (unsubmitted > 0) continue;  // transient submit failure: retry
        break;
      }
      struct io_uring_cqe* cqe = nullptr;
      int rc = ::io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // Operations still in flight own their buffers: reap them before the
        // caller can reuse the memory.
        broken_ = true;
        return DrainAfterFailure(in_flight, ErrnoStatus(-rc, "io_uring_wait_cqe"));
      }
      unsigned slot = static_cast<unsigned>(::io_uring_cqe_get_data64(cqe));
      int res = cqe->res;
      ::io_uring_cqe_seen(&ring_, cqe);
      --in_flight;
      Op& op = slots[slot];
      if (res == -EINTR || res == -EAGAIN) {
        todo.push_front(op);
      } else if (res < 0) {
        if (first_error.ok()) first_error = ErrnoStatus(-res, write ? "io_uring write" : "io_uring read");
      } else if (res == 0) {
        if (first_error.ok()) {
          first_error = write ? absl::InternalError("io_uring write made no progress")
                              : absl::DataLossError(absl::StrCat(
                                    "file ends at ", op.offset, "; expected ", op.offset + op.len));
        }
      } else if (static_cast<uint64_t>(res) < op.len) {
        op.buf += res;
        op.len -= static_cast<uint64_t>(res);
        op.offset += static_cast<uint64_t>(res);
        todo.push_front(op);  // short transfer: the remainder goes again
      }
      free_slots.push_back(slot);
    }
    if (overlap != nullptr && first_error.ok()) (*overlap)();  // nothing was submitted
    return first_error;
  }

  absl::Status DrainAfterFailure(unsigned in_flight, absl::Status error) {
    while (in_flight > 0) {
      struct io_uring_cqe* cqe = nullptr;
      int rc = ::io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // The kernel may still write into buffers we cannot reclaim: returning
        // would let the caller hand them out again. Fail-stop instead.
        CKPT_LOG(ERROR) << "io_uring: cannot reap " << in_flight
                        << " operations in flight (" << std::strerror(-rc) << "); aborting";
        std::abort();
      }
      ::io_uring_cqe_seen(&ring_, cqe);
      --in_flight;
    }
    return error;
  }

  unsigned depth_ = 0;
  bool broken_ = false;
  struct io_uring ring_ {};
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

absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackend(IoBackendKind kind,
                                                         unsigned queue_depth) {
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
