// LocalHistory: a rank's history in this node's store (its checkpoint events
// and committed layer versions) as the engine's stages read and cut it, with
// the accounting every deletion owes: the disk budget, the owner's quotas and
// the GC metrics.
//
// Used by retention (GC, DeleteJob), Restore(discard_later) and the remote
// tier (a pull that does not finish removes what it adopted).
// Thread-safety: thread-safe; it holds no state of its own (the index, the
// store, the budget and the quota table each lock for themselves). The
// caller keeps concurrent edits of one rank apart (a lease or a GC turn).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/engine/disk_budget.h"
#include "daemon/engine/quota.h"
#include "daemon/metrics/metrics.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

// What a rank's history holds, as GC and DeleteJob need it: its events in
// step order and its versions by (layer, step).
struct RankHistory {
  struct Event {
    uint64_t step = 0;
    int64_t unix_ms = 0;
    uint64_t index_bytes = 0;  // what it counts for in its owner's quota
    uint64_t agreed_step = 0;  // EventRecord::agreed_step
  };
  uid_t owner = 0;
  std::vector<Event> events;
  std::map<std::pair<uint32_t, uint64_t>, store::VersionRecord> versions;
};

class LocalHistory {
 public:
  // None owned; `metrics` may be null.
  LocalHistory(Index* index, LayerStore* store, DiskBudget* disk, QuotaTable* quota,
               Metrics* metrics)
      : index_(index), store_(store), disk_(disk), quota_(quota), metrics_(metrics) {}
  LocalHistory(const LocalHistory&) = delete;
  LocalHistory& operator=(const LocalHistory&) = delete;

  // The rank's events and versions; with `after`, only those above that
  // step (one seek per layer and the events from the newest down, so the
  // cost does not grow with the history below it). Index errors as is.
  absl::StatusOr<RankHistory> Read(const std::string& job, uint32_t rank,
                                   std::optional<uint64_t> after = std::nullopt);
  // Deletes one event of the rank and gives its index bytes back to the
  // owner's quota.
  absl::Status DeleteEvent(uid_t owner, const std::string& job, uint32_t rank,
                           const RankHistory::Event& event);
  // Deletes one committed version (its record, then its file) and gives its
  // bytes back to the disk budget and the owner's quota.
  absl::Status RemoveVersion(uid_t owner, const VersionKey& key, const store::VersionRecord& rec);
  // Takes a version a read found damaged out of the history (its record
  // replaced by a LostVersion, its file moved to quarantine/, `why` logged)
  // and gives its bytes back like RemoveVersion.
  absl::Status QuarantineVersion(uid_t owner, const VersionKey& key,
                                 const store::VersionRecord& rec, const std::string& why);
  // Forgets the rank's lost versions (Index::MarkLost) of step >= `from`:
  // those of a discarded history, or of a deleted rank (from 0).
  absl::Status ForgetLost(const std::string& job, uint32_t rank, uint64_t from);

 private:
  Index* const index_;
  LayerStore* const store_;
  DiskBudget* const disk_;
  QuotaTable* const quota_;
  Metrics* const metrics_;
};

}  // namespace ckpt
