// IoBackend: moves bulk bytes between aligned memory and files.
//
// Two twins, picked at run time: io_uring (the production path, several
// segments in flight) and pwrite/pread (the fallback where io_uring is
// unavailable, e.g. under Docker's default seccomp profile). Both run the
// same parameterized test suite.
//
// The caller drives a transfer: Submit starts it and returns, the caller
// does other work (checksums, a copy out of another buffer) while the
// segments are in flight, then Wait completes it. Nothing is called back.
// Every segment is transferred in full (short transfers are resubmitted for
// the remainder) or the transfer fails with the first hard error;
// EINTR/EAGAIN are retried. Wait returns only after every submitted
// operation has completed, so a following fdatasync covers all of them
// (io_uring does not order an fsync after earlier writes).
//
// Thread-safety: one IoBackend per thread; instances are not shared.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace ckpt {

struct IoSegment {
  void* buf;        // O_DIRECT: aligned to 4096
  uint64_t len;     // O_DIRECT: multiple of 4096
  uint64_t offset;  // file offset; O_DIRECT: multiple of 4096
};

enum class IoDirection { kRead, kWrite };

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* Name() const = 0;

  // Starts transferring `segments` between `fd` and memory and returns at
  // once: io_uring submits as many as its queue holds; the pwrite twin only
  // takes note (its transfer runs inside Wait). A write's bytes may be read
  // meanwhile, never changed; a read's must not be touched. The segment list
  // is copied; the buffers and `fd` must stay valid until Wait returns.
  // REQUIRES: no transfer outstanding (each Submit is followed by one Wait).
  virtual void Submit(IoDirection direction, int fd, absl::Span<const IoSegment> segments) = 0;
  // Completes the transfer Submit started. OK when every segment went in
  // full; else the first error, returned only once nothing is in flight any
  // more (errors while submitting included). A read that hits end of file
  // before a segment is full is DATA_LOSS.
  virtual absl::Status Wait() = 0;
  // Whether transfers are under way between Submit and Wait: true for
  // io_uring. The pwrite twin transfers inside Wait, so a caller gains
  // nothing by holding on to work for the time between.
  virtual bool Overlaps() const { return false; }

  // Submit, then Wait.
  absl::Status WriteAll(int fd, absl::Span<const IoSegment> segments) {
    Submit(IoDirection::kWrite, fd, segments);
    return Wait();
  }
  absl::Status ReadAll(int fd, absl::Span<const IoSegment> segments) {
    Submit(IoDirection::kRead, fd, segments);
    return Wait();
  }
};

enum class IoBackendKind { kAuto, kUring, kPwrite };

// Parses "auto" | "io_uring" | "pwrite"; IoBackendKindName is the inverse.
absl::StatusOr<IoBackendKind> ParseIoBackendKind(const std::string& s);
const char* IoBackendKindName(IoBackendKind kind);

// kUring fails with UNAVAILABLE where the kernel or seccomp refuses io_uring;
// kAuto then falls back to pwrite (the caller logs the choice once).
absl::StatusOr<std::unique_ptr<IoBackend>> MakeIoBackend(IoBackendKind kind, unsigned queue_depth);
std::unique_ptr<IoBackend> MakePwriteBackend();
absl::StatusOr<std::unique_ptr<IoBackend>> MakeUringBackend(unsigned queue_depth);

inline constexpr uint64_t kDirectAlignment = 4096;
inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ckpt
