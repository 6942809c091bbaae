// Verified restore of a composite plan: the one loop through which every
// byte leaves ckptd's history, for Restore into a trainer's buffers and for
// Export (export.h).
//
// RestoreInto reads each planned version from the first of its sources that
// holds it (an in-memory source such as the memory tier, else the local
// store) and writes it into the target's tensors, verifying every checksum
// on the way. It fails closed: DATA_LOSS names the first layer that does not
// verify (the bytes of the tensor that did not verify may already be in its
// destination, as are the layers before it and maybe some after it: after a
// failed restore the target holds nothing a trainer may use);
// FAILED_PRECONDITION when the plan is incomplete or the target's table
// does not match the stored tensors (count, name, dtype, size); ABORTED when
// a planned version vanished (plan again); CANCELLED once
// `sources.cancelled` is set (daemon shutdown); DEADLINE_EXCEEDED past
// `sources.timeout`.
//
// The restore drives its own reads: it submits a version's reads to an
// IoBackend, checks and copies out the version it read before while they
// are in flight, then waits for them (nothing calls back into it).
//
// Thread-safety: free functions; safe to call concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/plan.h"
#include "daemon/shm/rank_memory.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

// Where restored bytes go.
struct RestoreTarget {
  // tensors[layer][i]: where tensor i of `layer` (in the table's order)
  // goes, nbytes long as registered; an address inside `memory`.
  std::vector<std::vector<char*>> tensors;
  // The rank's memory, written with its CopyIn (a GPU's DMA engine, or
  // non-temporal stores into a memfd); null: plain host memory, memcpy.
  // Host copies run on several threads at once, into different tensors,
  // each piece right after its checksum (from the cache); copies into GPU
  // memory go one at a time, a staging chunk each.
  RankMemory* memory = nullptr;
};

// A place besides the local store that may hold a committed version's file
// image in memory (the memory tier).
class VersionSource {
 public:
  virtual ~VersionSource() = default;
  // The image of exactly the version `rec` names, or null. A restore checks
  // it like a file read from disk: its header (the record's header_xxh3,
  // job/rank/layer/step) before using it, an image whose header does not
  // check is not used and the next source is asked; every tensor's checksum
  // as it copies the tensor out, on the restore's threads (the whole-image
  // pass inside the restore's turn order serialized them). An image whose
  // tensors do not check is given to Drop and fails the restore (see
  // RestoreInto's `damaged_images`).
  virtual std::shared_ptr<const StagingLease> FindImage(const VersionKey& key,
                                                        const store::VersionRecord& rec) = 0;
  // The image FindImage gave for `key` did not verify: it is not to be given
  // again (the version is read from the next source, or disk).
  virtual void Drop(const VersionKey& key, const store::VersionRecord& rec) {}
};

// What a restore, verify or export reads committed versions from, and its
// bounds. For each version it asks the `in_memory` sources in order, then
// reads the local store.
struct RecoverySources {
  Index* index = nullptr;       // the plan's records
  LayerStore* store = nullptr;  // the local store
  StagingPool* pool = nullptr;  // room for versions read from disk
  // One backend per restore thread: thread k reads, checks and copies
  // versions k, k + n, ... and (on a backend that Overlaps()) checks and
  // copies one version out while the reads of its next are in flight. A
  // restore holds at most two staging leases per thread, one on a backend
  // that does not overlap. Verify and export use the first.
  std::vector<IoBackend*> readers;
  std::vector<VersionSource*> in_memory;
  absl::Duration timeout = absl::Minutes(30);
  // Set once the reader must stop (ckptd is shutting down); may be null.
  const std::atomic<bool>* cancelled = nullptr;
};

struct RestoreStats {
  uint64_t bytes = 0;
  uint64_t memory_bytes = 0;  // of `bytes`, served from an in-memory source
  uint64_t memory_layers = 0;
  // Per layer of the plan (in its order): served from an in-memory source.
  std::vector<bool> from_memory;
  double seconds = 0;
  // Of `seconds`, how long some thread had reads submitted and not yet
  // waited for (with io_uring, the copy it overlaps runs meanwhile): the
  // rest the disk was idle. An upper bound on the disk's busy time, close
  // for versions the read queue holds whole (io_queue_depth x the staging
  // chunk); for larger ones the queue drains before the copy ends.
  double reading_seconds = 0;

  // reading_seconds as a share of seconds (0 for a restore that took none).
  double ReadingShare() const { return seconds > 0 ? reading_seconds / seconds : 0; }
};

// What an engine's Restore wrote: the restore's figures (memory_bytes: from
// the memory tier) and the plan it followed.
struct Restored : RestoreStats {
  CompositePlan plan;
  // Layers whose damaged version on disk a tier's copy replaced: the tier.
  std::map<uint32_t, std::string> repaired_from;
};

// With `damaged`, every planned version read from the local store that did
// not verify (DATA_LOSS: missing, short, a checksum) is added to it, so the
// caller can take it out of the history and plan again. With
// `damaged_images`, every version whose in-memory image did not verify is
// added to it (the image was dropped from its source): restoring again
// reads that version from the next source or the disk.
absl::StatusOr<RestoreStats> RestoreInto(const CompositePlan& plan, const store::RankRecord& table,
                                         const RestoreTarget& target,
                                         const RecoverySources& sources,
                                         std::vector<VersionKey>* damaged = nullptr,
                                         std::vector<VersionKey>* damaged_images = nullptr);

}  // namespace ckpt
