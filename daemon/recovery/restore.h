// Verified restore of a composite plan (SPEC §6): the one loop through which
// every byte leaves ckptd's history, for Restore into a trainer's buffers and
// for Export.
//
// RestoreInto reads each planned version through the store and writes it
// into the destination tensors, verifying every checksum on the way. It fails
// closed: DATA_LOSS names the first layer that does not verify (the bytes of
// the tensor that did not verify may already be in its destination, as are
// the layers before it and maybe some after it: after a failed restore the
// destination holds nothing a trainer may use); FAILED_PRECONDITION when the plan is incomplete or the destination
// table does not match the stored tensors (count, name, dtype, size); ABORTED
// when a planned version vanished (plan again); CANCELLED between layers once
// `cancelled` returns true (daemon shutdown).
//
// Thread-safety: free functions; safe to call concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/plan.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

// Where restored bytes go: the destination of tensor `tensor` of `layer`
// (REQUIRES: it is nbytes long, as registered).
using TensorDestination = std::function<char*(uint32_t layer, uint32_t tensor)>;
// Copies n host bytes to a destination address (GPU memory, for example).
using CopyToDestination = std::function<absl::Status(char* dst, const char* src, uint64_t n)>;

struct RestoreDestination {
  RestoreDestination(TensorDestination w) : where(std::move(w)) {}  // NOLINT: memcpy there
  RestoreDestination(TensorDestination w, CopyToDestination c, bool cpu)
      : where(std::move(w)), copy(std::move(c)), copy_on_cpu(cpu) {}

  TensorDestination where;
  CopyToDestination copy;  // null = memcpy
  // Whether `copy` is done by this CPU (memcpy into host memory). Then a
  // version read from disk is checksummed and copied a small piece at a
  // time, so the copy reads each piece from the cache the checksum just
  // brought it into, and `copy` may run on several threads at once (into
  // different tensors). Else (a DMA engine copies to a GPU) pieces are a
  // staging chunk and one `copy` runs at a time.
  bool copy_on_cpu = true;
};

struct RestoreStats {
  uint64_t bytes = 0;
  uint64_t memory_bytes = 0;  // of `bytes`, served from a MemorySource
  uint64_t memory_layers = 0;
  double seconds = 0;
  // Of `seconds`, how long some thread was in a read call (with io_uring,
  // the copy it overlaps runs while that call's reads are in flight): the
  // rest the disk was idle. An upper bound on the disk's busy time, close
  // for versions the read queue holds whole (io_queue_depth x the staging
  // chunk); for larger ones the queue drains before the copy ends.
  double reading_seconds = 0;

  // reading_seconds as a share of seconds (0 for a restore that took none).
  double ReadingShare() const { return seconds > 0 ? reading_seconds / seconds : 0; }
};

// The committed file image of a version held in memory (the engine's memory
// tier), or null when it is not there. It is checked like a file read from
// disk (every checksum, the record's header_xxh3, job/rank/layer/step)
// before a byte is copied out; an image that does not check is not used and
// the version is read from disk instead.
using MemorySource = std::function<std::shared_ptr<const StagingLease>(
    const VersionKey& key, const store::VersionRecord& rec)>;

// `io` holds one backend per thread: each thread reads, checks and copies
// every n-th version, and (on a backend that Overlaps()) checks and copies
// one version out while the reads of its next are in flight (RestoreInto
// uses each backend on one thread of its own). A restore holds at most two
// staging leases per thread, one on a backend that does not overlap.
absl::StatusOr<RestoreStats> RestoreInto(const CompositePlan& plan, const store::RankRecord& table,
                                         const RestoreDestination& dest, Index* index,
                                         LayerStore* store, absl::Span<IoBackend* const> io,
                                         StagingPool* pool, absl::Duration timeout,
                                         const std::function<bool()>& cancelled = nullptr,
                                         const MemorySource& memory = nullptr);

}  // namespace ckpt
