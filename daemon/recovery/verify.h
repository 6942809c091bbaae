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
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/recovery/restore.h"

namespace ckpt {

// Reads through sources.readers[0], with sources.timeout for the staging
// memory of each version.
absl::Status VerifyRank(const std::string& job, uint32_t rank, bool deep,
                        const RecoverySources& sources, v1::VerifyReply* reply);

}  // namespace ckpt
