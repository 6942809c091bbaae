#include "daemon/recovery/restore.h"

#include <algorithm>
#include <cstring>
#include <functional>
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

// The order the threads of one restore keep. Each thread reads a version
// and, while those reads are in flight (io_uring), checks and copies out the
// version it read before; then it goes on with its next one. So the disk has
// reads queued during the copies: a thread that read a version whole and
// only then checked and copied it left the disk idle whenever both threads
// copied at once, and two threads that start together stay in step (0.80 of
// the time reading in one traced restore). At the end only the last
// version's copy is left.
//
// Versions take staging leases and memory-tier images in plan order
// (TakeTurn/EndTurn), and only the oldest unfinished one may wait for room.
// A thread finishes the version it holds before it waits for anything (its
// turn, or room): every version holding a lease or an image is then older
// than the one waiting and finishes on its own, so a pool with room for one
// version never deadlocks.
class Turns {
 public:
  explicit Turns(size_t count) : end_(count) {}

  // Blocks until `seq` may take a lease.
  absl::Status TakeTurn(size_t seq, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto turn = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || seq >= end_ || turn_ == seq;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&turn), deadline)) return Late();
    if (stopped_ || seq >= end_) return Stopped();
    return absl::OkStatus();
  }
  // Whether TakeTurn(seq) would return at once.
  bool MayTakeTurn(size_t seq) {
    absl::MutexLock lock(&mu_);
    return stopped_ || seq >= end_ || turn_ == seq;
  }
  void EndTurn(size_t seq) {
    absl::MutexLock lock(&mu_);
    if (turn_ == seq) turn_ = seq + 1;
  }
  // Blocks until every version before `seq` is finished (its lease given
  // back).
  absl::Status WaitUntilOldest(size_t seq, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto oldest = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || seq >= end_ || finished_below_ >= seq;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&oldest), deadline)) return Late();
    if (stopped_ || seq >= end_) return Stopped();
    return absl::OkStatus();
  }
  // Whether version `seq` is still to be copied (no earlier one failed, the
  // restore did not stop).
  bool Going(size_t seq) {
    absl::MutexLock lock(&mu_);
    return !stopped_ && seq < end_;
  }
  void Finished(size_t seq) {
    absl::MutexLock lock(&mu_);
    finished_.push_back(seq);
    std::push_heap(finished_.begin(), finished_.end(), std::greater<>());
    while (!finished_.empty() && finished_.front() == finished_below_) {
      std::pop_heap(finished_.begin(), finished_.end(), std::greater<>());
      finished_.pop_back();
      ++finished_below_;
    }
  }
  // Version `seq` failed: no version from `seq` on is started; the
  // restore's status is the failure with the lowest `seq` (even after a
  // Stop: it says more than the deadline that stopped the others).
  void Fail(size_t seq, absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (seq < end_) {
      end_ = seq;
      failure_ = std::move(s);
    }
  }
  // Cancelled or past the deadline: everyone stops.
  void Stop(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      stopped_by_ = std::move(s);
    }
  }
  absl::Status Result() {
    absl::MutexLock lock(&mu_);
    return failure_.ok() ? stopped_by_ : failure_;
  }
  // What TakeTurn and WaitUntilOldest return once an earlier version
  // failed or the restore stopped: Result() says why.
  static absl::Status Stopped() { return absl::AbortedError("the restore stopped"); }

 private:
  static absl::Status Late() {
    return absl::DeadlineExceededError("the restore did not finish in time");
  }

  absl::Mutex mu_;
  size_t turn_ ABSL_GUARDED_BY(mu_) = 0;  // the version that may take a lease
  size_t end_ ABSL_GUARDED_BY(mu_);       // the count, or the first failed version
  // Every version below it is finished; finished_ holds the ones above it
  // (a min-heap).
  size_t finished_below_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<size_t> finished_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status stopped_by_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);  // of version end_
};

absl::Status WithLayer(const PlannedLayer& lp, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("layer ", lp.layer, " (", lp.name, ") step ", lp.step,
                                             ": ", s.message()));
}

// First half: looks version `seq` up and takes the place of its bytes: a
// checked image from the memory tier, or a staging lease its file is then
// read into. `before_wait` (the thread finishing what it holds) runs before
// this thread waits for its turn, and before it asks for room a second time.
absl::StatusOr<Fetched> Claim(size_t seq, const CompositePlan& plan, const PlannedLayer& lp,
                              const store::RankRecord& table, Index* index, StagingPool* pool,
                              absl::Time deadline, const MemorySource& memory, Turns* turns,
                              const std::function<void()>& before_wait) {
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
  // Every version takes its turn, so the next one's thread may go on. An
  // image of the memory tier is taken in turn too: one held by a later
  // version would keep its chunks from the oldest, waiting below for room
  // the tier gives back.
  if (!turns->MayTakeTurn(seq)) before_wait();
  CKPT_RETURN_IF_ERROR(turns->TakeTurn(seq, deadline));
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
  if (f.image != nullptr) {
    turns->EndTurn(seq);
    return f;
  }
  // A version claimed while an older one is unfinished takes free room
  // only; the oldest may also take room back from the memory tier, and wait
  // for it. (A restore that evicted the tier to read ahead would leave the
  // newest step on disk.)
  std::optional<StagingLease> free_room = pool->TryAcquire(f.rec.file_bytes());
  if (!free_room.has_value()) {
    // What this thread held may be the room: it is back after before_wait,
    // and the wait for the other threads' older versions is needed only
    // when it is not enough.
    before_wait();
    if (!turns->Going(seq)) {  // what it held failed, or the restore stopped
      turns->EndTurn(seq);
      return Turns::Stopped();
    }
    free_room = pool->TryAcquire(f.rec.file_bytes());
  }
  if (!free_room.has_value()) {
    if (absl::Status s = turns->WaitUntilOldest(seq, deadline); !s.ok()) {
      turns->EndTurn(seq);
      return s;
    }
    absl::StatusOr<StagingLease> lease = pool->Acquire(f.rec.file_bytes(), deadline);
    if (!lease.ok()) {
      turns->EndTurn(seq);
      return WithLayer(lp, lease.status());
    }
    free_room = *std::move(lease);
  }
  turns->EndTurn(seq);
  f.lease = *std::move(free_room);
  return f;
}

// How many bytes a restore checksums and then copies out at a time: small
// enough to stay in a core's cache between the two, so each byte is read from
// memory once (hashing all of a tensor and then copying it read it twice: a
// restore ran at about 0.55 of a raw read from tmpfs).
constexpr uint64_t kVerifyPieceBytes = 256 << 10;

// Second half: matches a version's tensors with the registration and
// copies them out; a version read from disk has each tensor checksummed on
// the way (a mismatch is DATA_LOSS, after that tensor's bytes were copied).
absl::Status CopyOut(Fetched& f, const store::RankRecord& table, const RestoreDestination& dest,
                     absl::Mutex* copy_mu, RestoreStats* stats) {
  const PlannedLayer& lp = *f.lp;
  const bool verify = f.image == nullptr;  // an image from memory was checked whole
  if (verify) {
    absl::StatusOr<DecodedHeader> decoded = CheckImageHeader(f.key, f.rec, LeaseImage(f.lease));
    if (!decoded.ok()) return WithLayer(lp, decoded.status());
    f.decoded = *std::move(decoded);
  } else {
    ++stats->memory_layers;
  }
  const StagingLease& src = f.image != nullptr ? *f.image : f.lease;
  const store::LayerSpec& spec = table.layers(static_cast<int>(lp.layer));
  std::map<std::string, const store::TensorEntry*> stored;
  for (const store::TensorEntry& t : f.decoded.header.tensors()) stored[t.name()] = &t;
  if (stored.size() != static_cast<size_t>(f.decoded.header.tensors_size())) {
    return WithLayer(lp, absl::DataLossError("two stored tensors have the same name"));
  }
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
  const LeaseImage image(src);
  for (int i = 0; i < spec.tensors_size(); ++i) {
    const store::TensorEntry* t = stored[spec.tensors(i).name()];
    char* out = dest.where(lp.layer, static_cast<uint32_t>(i));
    auto copy_piece = [&](const char* piece, uint64_t n) {
      absl::Status s;
      if (dest.copy == nullptr) {
        std::memcpy(out, piece, n);
      } else if (dest.copy_on_cpu) {
        s = dest.copy(out, piece, n);
      } else {
        absl::MutexLock lock(copy_mu);  // one DMA copy at a time, its error its own
        s = dest.copy(out, piece, n);
      }
      out += n;
      return s;
    };
    if (verify) {
      const uint64_t piece = dest.copy_on_cpu ? kVerifyPieceBytes : src.chunk_bytes();
      if (absl::Status s = VerifyTensor(f.decoded, *t, image, piece, copy_piece); !s.ok()) {
        return WithLayer(lp, s);
      }
    } else {
      absl::Status s;
      src.ForEachPiece(f.decoded.layout.header_bytes + t->offset(), t->nbytes(),
                       [&](const char* piece, uint64_t n) {
                         if (s.ok()) s = copy_piece(piece, n);
                       });
      CKPT_RETURN_IF_ERROR(s);
    }
    stats->bytes += t->nbytes();
    if (f.image != nullptr) stats->memory_bytes += t->nbytes();
  }
  return absl::OkStatus();
}

// How long at least one of `spans` was open.
double SecondsCovered(const std::vector<std::vector<std::pair<absl::Time, absl::Time>>>& spans) {
  std::vector<std::pair<absl::Time, absl::Time>> all;
  for (const auto& one : spans) all.insert(all.end(), one.begin(), one.end());
  std::sort(all.begin(), all.end());
  absl::Duration covered;
  absl::Time until = absl::InfinitePast();
  for (const auto& [begin, end] : all) {
    if (end <= until) continue;
    covered += end - std::max(begin, until);
    until = end;
  }
  return absl::ToDoubleSeconds(covered);
}

}  // namespace

absl::StatusOr<RestoreStats> RestoreInto(const CompositePlan& plan, const store::RankRecord& table,
                                         const RestoreDestination& dest, Index* index,
                                         LayerStore* store, absl::Span<IoBackend* const> io,
                                         StagingPool* pool, absl::Duration timeout,
                                         const std::function<bool()>& cancelled,
                                         const MemorySource& memory) {
  if (!plan.complete) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan for step ", plan.target_step, " is incomplete: some layers have no version"));
  }
  if (io.empty()) return absl::InvalidArgumentError("a restore needs an I/O backend");
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  // Past the deadline or cancelled: every thread stops.
  auto stopping = [&]() -> absl::Status {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the restore did not finish in time");
    }
    if (cancelled && cancelled()) return absl::CancelledError("the restore was cancelled");
    return absl::OkStatus();
  };
  const size_t count = plan.layers.size();
  RestoreStats stats;
  if (count == 0) return stats;
  const size_t threads_wanted = std::min(io.size(), count);
  Turns turns(count);
  absl::Mutex copy_mu;
  std::vector<RestoreStats> each(threads_wanted);  // one per thread, summed after the joins
  // When each thread's reads began and ended (a read call, which includes
  // the copy it overlaps).
  std::vector<std::vector<std::pair<absl::Time, absl::Time>>> reads(threads_wanted);

  // How version `seq` ended: a failure stops the versions after it, a
  // deadline or a cancellation every version.
  auto record = [&](size_t seq, const absl::Status& s) {
    if (s.ok()) {
      turns.Finished(seq);
    } else if (s == Turns::Stopped()) {
      // An earlier version failed or the restore stopped: Result() says why.
    } else if (absl::IsCancelled(s) || absl::IsDeadlineExceeded(s)) {
      turns.Stop(s);
    } else {
      turns.Fail(seq, s);
    }
  };
  // Thread k does versions k, k + n, ... with io[k]; the last is this
  // thread (Export's one-layer plans start no thread).
  auto run = [&](size_t k) {
    // A backend without transfers in flight during the overlap (pwrite)
    // gains nothing from holding a version: it is copied out at once.
    const bool overlaps = io[k]->Overlaps();
    std::optional<Fetched> held;  // read (or from memory), not yet copied out
    size_t held_seq = 0;
    // Checks and copies out the held version, unless an earlier one failed
    // or the restore stopped; its lease goes back either way.
    auto finish_held = [&] {
      if (!held.has_value()) return;
      absl::Status s;
      if (turns.Going(held_seq)) {
        s = stopping();
        if (s.ok()) s = CopyOut(*held, table, dest, &copy_mu, &each[k]);
      }
      held.reset();
      record(held_seq, s);
    };
    for (size_t seq = k; seq < count; seq += threads_wanted) {
      if (absl::Status s = stopping(); !s.ok()) {
        turns.Stop(s);
        break;  // what it holds is not copied out (Going is false)
      }
      absl::StatusOr<Fetched> f = Claim(seq, plan, plan.layers[seq], table, index, pool, deadline,
                                        memory, &turns, finish_held);
      absl::Status s = f.status();
      if (s.ok() && f->image == nullptr) {
        // A version still held is copied out while these reads are in
        // flight.
        const absl::Time read_start = absl::Now();
        s = store->ReadUnchecked(f->key, f->rec, io[k], f->lease, finish_held);
        reads[k].emplace_back(read_start, absl::Now());
        if (!s.ok()) s = WithLayer(*f->lp, s);
      }
      finish_held();  // where no read ran it (memory, or a failure first)
      if (!s.ok()) {
        record(seq, s);
        return;
      }
      held = *std::move(f);
      held_seq = seq;
      if (!overlaps) finish_held();
    }
    finish_held();
  };
  std::vector<std::thread> threads;
  for (size_t k = 0; k + 1 < threads_wanted; ++k) threads.emplace_back(run, k);
  run(threads_wanted - 1);
  for (std::thread& t : threads) t.join();
  for (const RestoreStats& e : each) {
    stats.bytes += e.bytes;
    stats.memory_bytes += e.memory_bytes;
    stats.memory_layers += e.memory_layers;
  }
  CKPT_RETURN_IF_ERROR(turns.Result());
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  stats.reading_seconds = SecondsCovered(reads);
  return stats;
}

}  // namespace ckpt
