#include "daemon/recovery/restore.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt {
namespace {

// One planned version on its way from the store to the destination.
struct Fetched {
  const PlannedLayer* lp = nullptr;
  VersionKey key;
  store::VersionRecord rec;
  // From the memory tier, already checked (`decoded` is its header)...
  std::shared_ptr<const StagingLease> image;
  DecodedHeader decoded;
  // ...or read from disk, checked by the thread that copies it out.
  StagingLease lease;
};

// The hand-over between the threads that read versions and the one that
// checks and copies them out, in plan order. While version i is checksummed
// and copied, the next ones are read, each reader with its own queue: the
// disk does not wait for the CPU, nor for one file's last reads before the
// next file's first (a restore was the sum of the two before, about 0.5 of a
// raw read of the same files).
//
// Readers take staging leases in plan order (TakeTurn/EndTurn): the version
// the copier waits for always holds its lease before any later one takes
// one, so a pool with room for one version never deadlocks.
class Handover {
 public:
  Handover(size_t count, size_t ahead) : count_(count), ahead_(ahead), end_(count) {}

  // Blocks until `seq` may take a lease.
  absl::Status TakeTurn(size_t seq, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto turn = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || seq >= end_ || turn_ == seq;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&turn), deadline)) return Late();
    if (stopped_ || seq >= end_) return absl::AbortedError("the restore stopped");
    return absl::OkStatus();
  }
  void EndTurn(size_t seq) {
    absl::MutexLock lock(&mu_);
    if (turn_ == seq) turn_ = seq + 1;
  }
  // Blocks until the copier has taken every version before `seq`.
  absl::Status WaitUntilNext(size_t seq, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto next = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || seq >= end_ || next_ >= seq;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&next), deadline)) return Late();
    if (stopped_ || seq >= end_) return absl::AbortedError("the restore stopped");
    return absl::OkStatus();
  }

  // Hands version `seq` over once it is at most `ahead` versions ahead of the
  // copier. ABORTED when the restore stopped (another thread's status says
  // why).
  absl::Status Push(size_t seq, Fetched f, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto room = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || seq >= end_ || seq < next_ + ahead_;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&room), deadline)) return Late();
    if (stopped_ || seq >= end_) return absl::AbortedError("the restore stopped");
    ready_.emplace(seq, std::move(f));
    return absl::OkStatus();
  }
  // The next version in plan order; nullopt at the end, after a failure, or
  // at the deadline (*status says which).
  std::optional<Fetched> Pop(absl::Time deadline, absl::Status* status) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || next_ >= end_ || ready_.count(next_) > 0;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
      *status = Late();
      return std::nullopt;
    }
    if (stopped_ || next_ >= end_) return std::nullopt;
    auto it = ready_.find(next_);
    Fetched f = std::move(it->second);
    ready_.erase(it);
    ++next_;
    return f;
  }
  // Version `seq` failed: nothing from `seq` on is copied; the restore's
  // status is the failure with the lowest `seq`.
  void Fail(size_t seq, absl::Status s) {
    std::map<size_t, Fetched> dropped;
    absl::MutexLock lock(&mu_);
    if (!stopped_ && seq < end_) {
      end_ = seq;
      failure_ = std::move(s);
      for (auto it = ready_.lower_bound(seq); it != ready_.end();) {
        dropped.insert(ready_.extract(it++));  // leases go back outside the lock
      }
    }
  }
  // Cancelled or past the deadline: everyone stops.
  void Stop(absl::Status s) {
    std::map<size_t, Fetched> dropped;
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      if (failure_.ok()) failure_ = std::move(s);
      dropped.swap(ready_);
    }
  }
  absl::Status Result() {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

 private:
  absl::Status Late() const {
    return absl::DeadlineExceededError("the restore did not finish in time");
  }

  const size_t count_;
  const size_t ahead_;
  absl::Mutex mu_;
  std::map<size_t, Fetched> ready_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // the version the copier takes next
  size_t turn_ ABSL_GUARDED_BY(mu_) = 0;  // the version that may take a lease
  size_t end_ ABSL_GUARDED_BY(mu_);       // count_, or the first failed version
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

// Versions handed over ahead of the one being copied out: each holds a lease
// of the staging pool, so this (with the readers' own) bounds what one
// restore takes from it.
constexpr size_t kReadAhead = 2;

absl::Status WithLayer(const PlannedLayer& lp, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("layer ", lp.layer, " (", lp.name, ") step ", lp.step,
                                             ": ", s.message()));
}

// Reader half: looks version `seq` up and takes its bytes from memory (a
// checked image) or from disk (unchecked).
absl::StatusOr<Fetched> Fetch(size_t seq, const CompositePlan& plan, const PlannedLayer& lp,
                              const store::RankRecord& table, Index* index, LayerStore* store,
                              IoBackend* io, StagingPool* pool, absl::Time deadline,
                              const MemorySource& memory, Handover* handover) {
  if (lp.layer >= static_cast<uint32_t>(table.layers_size())) {
    return absl::FailedPreconditionError(absl::StrCat("plan names unknown layer ", lp.layer));
  }
  CKPT_ASSIGN_OR_RETURN(auto rec, index->VersionAtOrBefore(plan.job, plan.rank, lp.layer, lp.step));
  if (!rec.has_value() || rec->first != lp.step) {
    return absl::AbortedError(absl::StrCat("layer ", lp.layer, " version ", lp.step,
                                           " vanished during the restore; plan again"));
  }
  Fetched f;
  f.lp = &lp;
  f.key = VersionKey{plan.job, plan.rank, lp.layer, lp.step};
  f.rec = std::move(rec->second);
  // From memory when the image there checks, else from disk.
  f.image = memory ? memory(f.key, f.rec) : nullptr;
  if (f.image != nullptr) {
    absl::StatusOr<DecodedHeader> decoded = CheckImage(f.key, f.rec, LeaseImage(*f.image));
    if (decoded.ok()) {
      f.decoded = *std::move(decoded);
    } else {
      CKPT_LOG(ERROR) << "memory tier: layer " << lp.layer << " step " << lp.step
                      << " does not check (" << decoded.status() << "); read from disk";
      f.image = nullptr;
    }
  }
  // Every version takes its turn, so the next one's reader may go on.
  CKPT_RETURN_IF_ERROR(handover->TakeTurn(seq, deadline));
  if (f.image != nullptr) {
    handover->EndTurn(seq);
    return f;
  }
  // A version read ahead takes free room only; the one the copier needs
  // next may also take room back from the memory tier, and wait for it. (A
  // restore that evicted the tier for its read-ahead would leave the newest
  // step on disk.)
  std::optional<StagingLease> free_room = pool->TryAcquire(f.rec.file_bytes());
  if (!free_room.has_value()) {
    if (absl::Status s = handover->WaitUntilNext(seq, deadline); !s.ok()) {
      handover->EndTurn(seq);
      return s;
    }
    absl::StatusOr<StagingLease> lease = pool->Acquire(f.rec.file_bytes(), deadline);
    if (!lease.ok()) {
      handover->EndTurn(seq);
      return WithLayer(lp, lease.status());
    }
    free_room = *std::move(lease);
  }
  handover->EndTurn(seq);
  f.lease = *std::move(free_room);
  if (absl::Status s = store->ReadUnchecked(f.key, f.rec, io, f.lease); !s.ok()) {
    return WithLayer(lp, s);
  }
  return f;
}

// Consumer half: checks a version read from disk, matches its tensors with
// the registration and copies them out.
absl::Status CopyOut(Fetched& f, const store::RankRecord& table, const TensorDestination& dest,
                     const CopyToDestination& copy, RestoreStats* stats) {
  const PlannedLayer& lp = *f.lp;
  if (f.image == nullptr) {
    absl::StatusOr<DecodedHeader> decoded = CheckImage(f.key, f.rec, LeaseImage(f.lease));
    if (!decoded.ok()) return WithLayer(lp, decoded.status());
    f.decoded = *std::move(decoded);
  } else {
    ++stats->memory_layers;
  }
  const StagingLease& src = f.image != nullptr ? *f.image : f.lease;
  const store::LayerSpec& spec = table.layers(static_cast<int>(lp.layer));
  std::map<std::string, const store::TensorEntry*> stored;
  for (const store::TensorEntry& t : f.decoded.header.tensors()) stored[t.name()] = &t;
  if (stored.size() != static_cast<size_t>(spec.tensors_size())) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", lp.layer, " has ", stored.size(),
                                                      " tensors in the checkpoint and ",
                                                      spec.tensors_size(), " registered"));
  }
  for (int i = 0; i < spec.tensors_size(); ++i) {
    const store::TensorSpec& ts = spec.tensors(i);
    auto it = stored.find(ts.name());
    if (it == stored.end() || it->second->nbytes() != ts.nbytes() ||
        it->second->dtype() != ts.dtype()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor '", ts.name(), "' of layer ", lp.layer,
          " differs between the checkpoint and the registration (missing, dtype or size)"));
    }
  }
  for (int i = 0; i < spec.tensors_size(); ++i) {
    const store::TensorEntry* t = stored[spec.tensors(i).name()];
    char* out = dest(lp.layer, static_cast<uint32_t>(i));
    if (copy == nullptr) {
      src.CopyOut(f.decoded.layout.header_bytes + t->offset(), out, t->nbytes());
    } else {
      absl::Status s;
      src.ForEachPiece(f.decoded.layout.header_bytes + t->offset(), t->nbytes(),
                       [&](const char* piece, uint64_t n) {
                         if (s.ok()) s = copy(out, piece, n);
                         out += n;
                       });
      CKPT_RETURN_IF_ERROR(s);
    }
    stats->bytes += t->nbytes();
    if (f.image != nullptr) stats->memory_bytes += t->nbytes();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RestoreStats> RestoreInto(const CompositePlan& plan, const store::RankRecord& table,
                                         const TensorDestination& dest, Index* index, LayerStore* store,
                                         absl::Span<IoBackend* const> io, StagingPool* pool,
                                         absl::Duration timeout,
                                         const std::function<bool()>& cancelled,
                                         const CopyToDestination& copy, const MemorySource& memory) {
  if (!plan.complete) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan for step ", plan.target_step, " is incomplete: some layers have no version"));
  }
  if (io.empty()) return absl::InvalidArgumentError("a restore needs an I/O backend");
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  auto is_cancelled = [&cancelled] { return cancelled && cancelled(); };
  const size_t count = plan.layers.size();
  RestoreStats stats;  // the copier's; read after the joins
  if (count == 0) return stats;
  const size_t readers = std::min(io.size(), count);
  Handover handover(count, kReadAhead + readers);

  // Reader k reads versions k, k + readers, ... with io[k]; the last reader
  // is this thread (Export's one-layer plans start no thread).
  auto read = [&](size_t k) {
    for (size_t seq = k; seq < count; seq += readers) {
      if (is_cancelled()) {
        handover.Stop(absl::CancelledError("the restore was cancelled"));
        return;
      }
      absl::StatusOr<Fetched> f = Fetch(seq, plan, plan.layers[seq], table, index, store, io[k],
                                        pool, deadline, memory, &handover);
      if (!f.ok()) {
        // No-op when an earlier version failed or the restore stopped.
        handover.Fail(seq, f.status());
        return;
      }
      if (absl::Status s = handover.Push(seq, *std::move(f), deadline); !s.ok()) {
        if (absl::IsDeadlineExceeded(s)) handover.Stop(s);
        return;  // ABORTED: the restore stopped; its status says why
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t k = 0; k + 1 < readers; ++k) threads.emplace_back(read, k);
  auto copy_out = [&] {
    absl::Status late;
    while (std::optional<Fetched> f = handover.Pop(deadline, &late)) {
      if (is_cancelled()) {
        handover.Stop(absl::CancelledError("the restore was cancelled"));
        return;
      }
      const size_t seq = static_cast<size_t>(f->lp - plan.layers.data());
      if (absl::Status s = CopyOut(*f, table, dest, copy, &stats); !s.ok()) {
        handover.Fail(seq, s);
        return;
      }
    }
    if (!late.ok()) handover.Stop(late);
  };
  if (count <= 1) {
    read(readers - 1);
    copy_out();
  } else {
    threads.emplace_back(copy_out);
    read(readers - 1);
  }
  for (std::thread& t : threads) t.join();
  CKPT_RETURN_IF_ERROR(handover.Result());
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return stats;
}

}  // namespace ckpt
