// Offline index repair: rebuilds the RocksDB index of a data directory from
// the self-describing layer-version files (format.h) in jobs/ and in
// quarantine/ (layer_store.h).
//
// Who calls it: `ckptctl repair --data-dir=DIR`, with ckptd stopped. It takes
// the index's flock (index/ckptd.lock) like ckptd does and refuses while
// another process holds it.
//
// What a layer file says about itself, and so what repair recovers: job,
// rank, layer, layer name, step, generation, the tensor table (name, dtype,
// shape, role, optimizer group, offset, size, XXH3-64) and the group steps.
// Every file whose header and tensor checksums verify and whose name matches
// its header becomes a version record again (moved back from quarantine/
// when it was there). What only the index held and repair cannot recover
// when the index is lost: the checkpoint events' aux blobs (the data
// position), learning rates, LayerCheck's lr reference and failed/skipped
// counts; the registered layer tables beyond what the files carry (region,
// buffer offsets, layer kind, optimizer hyper-parameters); a layer of which
// no version file exists; and job owners (given by RepairOptions).
//
// Events: for every rank, each step after its newest surviving event record
// (every step when none survives) that has a version gets a synthesized
// event, so those steps are restore targets again. A step whose versions
// were written but whose event was never written (never acknowledged) is
// therefore restorable after repair too; it is a composite like any other.
//
// Nothing is deleted. Files that do not verify are left where they are and
// listed. An index that cannot be opened at all is renamed to
// index.damaged-<unix seconds> and a new one is built.
//
// Thread-safety: not for concurrent use; one repair per data directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/io/file_system.h"

namespace ckpt {

struct RepairOptions {
  // Owner of a job whose job record repair has to create (the uid is not in
  // the files). 0: root only, until an operator or the owner's
  // re-registration as root sets it.
  uint32_t owner_uid = 0;
};

struct RepairReport {
  bool index_rebuilt = false;        // the old index did not open
  std::string damaged_index;         // where it was moved (index_rebuilt)
  std::string open_error;            // why it did not open
  uint64_t files_checked = 0;        // layer files read and verified
  uint64_t records_kept = 0;         // files the index already named
  uint64_t records_added = 0;        // files that became records again
  uint64_t files_unquarantined = 0;  // of those, moved back from quarantine/
  uint64_t events_added = 0;         // synthesized checkpoint events
  uint64_t ranks_added = 0;          // synthesized rank records
  uint64_t jobs_added = 0;           // created job records
  // Files left in place: "path: why" (checksum, name/header mismatch, or a
  // version the index already names with another, intact file).
  std::vector<std::string> skipped;
};

// Repairs the data directory `data_dir` (see above).
// FAILED_PRECONDITION when ckptd (or anything else) holds the index lock, or
// when the index was written by a newer ckptd; NOT_FOUND when `data_dir`
// has neither jobs/ nor index/; other errors of the file system or RocksDB
// as they come (the repair may then be run again: every step is idempotent).
absl::StatusOr<RepairReport> RepairDataDir(const std::string& data_dir, FileSystem* fs,
                                           const RepairOptions& options);

}  // namespace ckpt
