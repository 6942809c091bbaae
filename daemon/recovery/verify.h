// Verification of a rank's committed history (`ckptctl verify`): reads back
// every committed version the index lists and checks it. Shallow checks the
// file's header and size against its record; deep also reads every byte and
// verifies every tensor checksum (through staging, like a restore).
//
// Failures are data about the history and go into the reply, not the status;
// a version removed meanwhile (GC) is not counted. The status fails only when
// the check itself could not run (index error, no staging memory in time).
//
// Thread-safety: a free function; safe to call concurrently. The caller holds
// a lease on the rank so that GC keeps off it (engine/leases.h).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/io/io_backend.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

absl::Status VerifyRank(const std::string& job, uint32_t rank, bool deep, Index* index,
                        LayerStore* store, IoBackend* io, StagingPool* pool,
                        absl::Duration read_timeout, v1::VerifyReply* reply);

}  // namespace ckpt
