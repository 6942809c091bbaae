// Composite plans (SPEC §2, §6).
//
// A composite plan for target step τ names, for every layer of a rank, the
// newest durable version with step <= τ, its staleness τ - t_l, and the
// size-weighted staleness Σ size_l (τ - t_l) / Σ size_l. τ = 0 means the
// rank's latest durable step (its newest checkpoint event).
//
// Restoring a plan is recovery/restore.h.
//
// Thread-safety: a free function; safe to call concurrently.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/store/index.h"

namespace ckpt {

// NOT_FOUND when the rank has no durable step, or `target_step` is not one
// (a step is restorable while its checkpoint event exists).
absl::StatusOr<v1::Plan> BuildPlan(Index* index, const std::string& job, uint32_t rank,
                                   uint64_t target_step, const store::RankRecord& table);

}  // namespace ckpt
