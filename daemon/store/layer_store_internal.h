// What LayerStore's sources (layer_store.cc, layer_store_commit.cc,
// layer_store_read.cc, layer_store_reconcile.cc) share: the I/O segments of
// a staging lease, the temp name a file is written under, and how a status
// names its path. Internal to LayerStore.
#pragma once

#include <sys/random.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/io/io_backend.h"
#include "daemon/staging/staging_pool.h"

namespace ckpt::layer_store_internal {

// The I/O segments of [begin, end) of a lease's image, one per chunk piece
// (4096-aligned wherever begin and end are).
inline std::vector<IoSegment> LeaseSegments(const StagingLease& lease, uint64_t begin,
                                            uint64_t end) {
  std::vector<IoSegment> segments;
  const uint64_t chunk = lease.chunk_bytes();
  for (uint64_t off = begin; off < end;) {
    const uint64_t in = off % chunk;
    const uint64_t n = std::min(chunk - in, end - off);
    segments.push_back(IoSegment{lease.chunk(off / chunk) + in, n, off});
    off += n;
  }
  return segments;
}

// `s` with `path` in front of its message (same code), so a start-up
// failure names where in the data directory it happened.
inline absl::Status AtPath(const absl::Status& s, const std::string& path) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

// "tmp.<final_name>.<nonce:16>", the name a layer file has until its
// rename; the nonce is random (the clock's nanoseconds when getrandom fails),
// so two tries at one version never meet.
inline std::string TempName(const std::string& final_name) {
  uint64_t nonce = 0;
  if (::getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce)) {
    nonce = absl::ToUnixNanos(absl::Now());
  }
  return absl::StrFormat("tmp.%s.%016x", final_name, nonce);
}

}  // namespace ckpt::layer_store_internal
