// IoBackend: moves bulk bytes between aligned memory and files.
//
// Two twins, picked at run time: io_uring (the production path, several
// segments in flight per call) and pwrite/pread (the fallback where io_uring
// is unavailable, e.g. under Docker's default seccomp profile). Both run the
// same parameterized test suite.
//
// Contract of WriteAll/ReadAll: every segment is transferred in full (short
// transfers are resubmitted for the remainder) or the call fails with the
// first hard error; EINTR/EAGAIN are retried. The call returns only after every
// submitted operation has completed, so a following fdatasync covers all of
// them (io_uring does not order an fsync after earlier writes).
//
// Thread-safety: one IoBackend per thread; instances are not shared.
#pragma once

#include <cstdint>
#include <functional>
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

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* Name() const = 0;
  virtual absl::Status WriteAll(int fd, absl::Span<const IoSegment> segments) = 0;
  // WriteAll that runs `overlap` on the calling thread while the writes are
  // in flight (io_uring: after the first submission, before the first wait;
  // the pwrite twin runs it first). `overlap` may read the bytes being
  // written, never change them. It has run when the call returns OK.
  virtual absl::Status WriteAllOverlapped(int fd, absl::Span<const IoSegment> segments,
                                          const std::function<void()>& overlap) {
    overlap();
    return WriteAll(fd, segments);
  }
  // A read that hits end of file before a segment is full is DATA_LOSS.
  virtual absl::Status ReadAll(int fd, absl::Span<const IoSegment> segments) = 0;
  // ReadAll that runs `overlap` on the calling thread while the reads are in
  // flight, as WriteAllOverlapped does; `overlap` must not touch the
  // segments' bytes. It has run when the call returns OK.
  //
  // Whether transfers are in flight while `overlap` runs: true for io_uring.
  // The pwrite twin runs it first and then transfers, so a caller gains
  // nothing by holding on to work for it.
  virtual bool Overlaps() const { return false; }
  virtual absl::Status ReadAllOverlapped(int fd, absl::Span<const IoSegment> segments,
                                         const std::function<void()>& overlap) {
    overlap();
    return ReadAll(fd, segments);
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
