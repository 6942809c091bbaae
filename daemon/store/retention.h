// Retention: which layer versions and checkpoint events GC may delete.
//
// A retained target is a step whose composite plan must stay valid. Retained:
// the latest event always; the last `keep_last_events` events; events at
// steps that are multiples of `keep_every_steps`; events younger than
// `keep_hours`; the newest event at or below the job's agreed durable step
// (several ranks); with a remote tier, the oldest `max_pending_events`
// events above the rank's newest remote-durable step, which the uploader has
// yet to copy (beyond that bound, the ordinary rules apply and the uploader
// skips the events GC took). A version is needed when it is, for some retained target τ,
// its layer's newest version with step <= τ. GC deletes every other version
// at or below the latest event and every event that is not retained.
// Versions above the latest event (being committed, not yet durable as a
// step) are never touched, so a layer's previous version is never deleted
// before its new one is durable.
//
// PlanRetention is a pure function; the engine applies the plan.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace ckpt {

struct RetentionPolicy {
  uint64_t keep_last_events = 50;
  uint64_t keep_every_steps = 1000;  // 0 = off
  uint64_t keep_hours = 0;           // 0 = off
};

struct RetentionInput {
  std::vector<std::pair<uint64_t, int64_t>> events;    // (step, unix_ms), ascending steps
  std::map<uint32_t, std::vector<uint64_t>> versions;  // layer -> ascending steps
  int64_t now_unix_ms = 0;
  // The job's agreed durable step (several ranks; 0 = none): the newest
  // event at or below it is retained too, since every rank restores it.
  uint64_t agreed_step = 0;
  // The remote tier: events above `pending_after` are not uploaded yet; the
  // oldest `max_pending_events` of them are retained. UINT64_MAX: no remote
  // tier.
  uint64_t pending_after = UINT64_MAX;
  uint64_t max_pending_events = 0;
};

struct RetentionPlan {
  std::vector<uint64_t> retained_targets;                      // ascending
  std::vector<uint64_t> delete_events;                         // ascending
  std::vector<std::pair<uint32_t, uint64_t>> delete_versions;  // (layer, step)
  uint64_t versions_kept = 0;
};

RetentionPlan PlanRetention(const RetentionPolicy& policy, const RetentionInput& input);

}  // namespace ckpt
