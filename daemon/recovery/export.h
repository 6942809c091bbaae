// Export of a rank's composite checkpoint as a stream: a header
// chunk (the plan and the tensor table in registration order), then every
// tensor's bytes in that order, in pieces of at most kExportPieceBytes; or
// the same bytes written into a region the reader handed over.
//
// Every layer goes through RestoreInto (restore.h), so an export carries
// exactly the checks a restore does: checksums, tensor count, names, dtypes
// and sizes against the rank's table. A layer is copied out of staging into
// ordinary memory before it is streamed, so a slow reader never holds pinned
// staging memory that snapshots need.
//
// Thread-safety: a free function; safe to call concurrently.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/recovery/plan.h"
#include "daemon/recovery/restore.h"

namespace ckpt {

inline constexpr uint64_t kExportPieceBytes = 4 << 20;

// Returns false when the reader went away.
using ExportSink = std::function<bool(const v1::ExportChunk&)>;

// The caller's memory an export may write into instead of streaming
// (ExportRequest.region_token): a mapping of `size` bytes at `data`, laid
// out as base/export_region.h says. `used` is set when the export went
// through it.
struct ExportRegion {
  char* data = nullptr;
  uint64_t size = 0;
  bool* used = nullptr;
};

// Streams `plan` (REQUIRES: built by BuildPlan from `table`), or, when
// `region`'s window holds the largest layer, passes it through the region
// in batches of whole layers (base/export_region.h): each batch restored
// into the window once the reader took the one before, then announced with
// a region_bytes chunk. `sources.timeout` bounds the reading of each layer
// (staging memory, I/O), and all the waits for the reader's acks together;
// not the whole export: a slow stream reader may take as long as it likes. The errors of
// RestoreInto; FAILED_PRECONDITION when the plan is incomplete; CANCELLED
// when `sink` returned false or `sources.cancelled` is set;
// DEADLINE_EXCEEDED when the reader did not take a batch in time. On
// success, the tensor bytes exported. `damaged` as RestoreInto's.
absl::StatusOr<uint64_t> ExportPlan(const CompositePlan& plan, const store::RankRecord& table,
                                    const RecoverySources& sources, const ExportSink& sink,
                                    std::vector<VersionKey>* damaged = nullptr,
                                    ExportRegion region = {});

}  // namespace ckpt
