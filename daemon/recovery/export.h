// Export of a rank's composite checkpoint as a stream (SPEC §6): a header
// chunk (the plan and the tensor table in registration order), then every
// tensor's bytes in that order, in pieces of at most kExportPieceBytes.
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
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/plan.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

inline constexpr uint64_t kExportPieceBytes = 4 << 20;

// Returns false when the reader went away.
using ExportSink = std::function<bool(const v1::ExportChunk&)>;

// Streams `plan` (REQUIRES: built by BuildPlan from `table`). `timeout`
// bounds the reading of each layer (staging memory, I/O), not the whole
// export: a slow reader may take as long as it likes. The errors of
// RestoreInto; FAILED_PRECONDITION when the plan is incomplete; CANCELLED
// when `sink` returned false or `cancelled` returned true.
// On success, the tensor bytes streamed.
absl::StatusOr<uint64_t> ExportPlan(const CompositePlan& plan, const store::RankRecord& table, Index* index,
                        LayerStore* store, IoBackend* io, StagingPool* pool,
                        absl::Duration timeout, const std::function<bool()>& cancelled,
                        const ExportSink& sink);

}  // namespace ckpt
