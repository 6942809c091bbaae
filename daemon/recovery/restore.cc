#include "daemon/recovery/restore.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "base/logging.h"
#include "base/status.h"

namespace ckpt {
namespace {

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

// "F32 [16, 8]": a tensor's dtype and shape, for messages.
std::string Described(store::DType dtype, const google::protobuf::RepeatedField<uint64_t>& shape) {
  const DTypeInfo* info = FindDType(static_cast<DType>(dtype));
  return absl::StrCat(info != nullptr ? std::string(info->name) : "an unknown dtype", " [",
                      absl::StrJoin(shape, ", "), "]");
}

// OK when the checkpoint's tensors of layer `lp` and the registration's
// have the same names; else FAILED_PRECONDITION naming those only one side
// has (optimizer state of another optimizer, most often).
absl::Status SameTensorNames(const PlannedLayer& lp, const store::LayerSpec& spec,
                             const std::map<std::string, const store::TensorEntry*>& stored) {
  std::vector<std::string> only_saved, only_registered;
  std::map<std::string, bool> registered;
  for (const store::TensorSpec& ts : spec.tensors()) {
    registered[ts.name()] = true;
    if (stored.count(ts.name()) == 0) only_registered.push_back(ts.name());
  }
  for (const auto& [name, entry] : stored) {
    if (registered.count(name) == 0) only_saved.push_back(name);
  }
  if (only_saved.empty() && only_registered.empty()) return absl::OkStatus();
  auto some = [](const std::vector<std::string>& names) {
    const size_t n = std::min<size_t>(names.size(), 6);
    return absl::StrCat(absl::StrJoin(names.begin(), names.begin() + n, ", "),
                        names.size() > n ? ", ..." : "");
  };
  std::string what = absl::StrCat("layer ", lp.layer, " '", lp.name, "': ");
  if (!only_saved.empty()) {
    absl::StrAppend(&what, "the checkpoint of step ", lp.step, " holds ", only_saved.size(),
                    " tensors not registered (", some(only_saved), ")");
  }
  if (!only_registered.empty()) {
    absl::StrAppend(&what, only_saved.empty() ? "" : " and ", only_registered.size(),
                    " registered tensors are not in the checkpoint (", some(only_registered), ")");
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      "; was the job trained with another optimizer (its state tensors differ: AdamW "
      "keeps exp_avg and exp_avg_sq, SGD with momentum momentum_buffer) or another model? "
      "Restore with the optimizer and model the job was trained with"));
}

absl::Status WithLayer(const PlannedLayer& lp, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("layer ", lp.layer, " (", lp.name, ") step ", lp.step,
                                             ": ", s.message()));
}

// How many bytes a restore checksums and then copies out at a time: small
// enough to stay in a core's cache between the two, so each byte is read from
// memory once (hashing all of a tensor and then copying it read it twice: a
// restore ran at about 0.55 of a raw read from tmpfs).
constexpr uint64_t kVerifyPieceBytes = 256 << 10;

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

// One restore: its threads, the order they keep (Turns) and what each
// holds. Thread k does versions k, k + n, ... with sources.readers[k]; the
// last is the caller's thread (Export's one-layer plans start no thread).
class RestoreRun {
 public:
  RestoreRun(const CompositePlan& plan, const store::RankRecord& table, const RestoreTarget& target,
             const RecoverySources& sources, std::vector<VersionKey>* damaged,
             std::vector<VersionKey>* damaged_images)
      : damaged_(damaged),
        damaged_images_(damaged_images),
        plan_(plan),
        table_(table),
        target_(target),
        sources_(sources),
        copy_on_cpu_(target.memory == nullptr || std::string_view(target.memory->kind()) == "host"),
        start_(absl::Now()),
        deadline_(start_ + sources.timeout),
        threads_(std::min(sources.readers.size(), plan.layers.size())),
        turns_(plan.layers.size()),
        readers_(threads_),
        from_memory_(plan.layers.size(), 0) {}

  absl::StatusOr<RestoreStats> Run() {
    std::vector<std::thread> threads;
    for (size_t k = 0; k + 1 < threads_; ++k) threads.emplace_back([this, k] { ReaderMain(k); });
    ReaderMain(threads_ - 1);
    for (std::thread& t : threads) t.join();
    RestoreStats stats;
    std::vector<std::vector<std::pair<absl::Time, absl::Time>>> reads;
    for (const Reader& r : readers_) {
      stats.bytes += r.stats.bytes;
      stats.memory_bytes += r.stats.memory_bytes;
      stats.memory_layers += r.stats.memory_layers;
      reads.push_back(r.reads);
    }
    CKPT_RETURN_IF_ERROR(turns_.Result());
    stats.from_memory.assign(from_memory_.begin(), from_memory_.end());
    stats.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    stats.reading_seconds = SecondsCovered(reads);
    return stats;
  }

 private:
  // One planned version on its way from a source to the target.
  struct Fetched {
    const PlannedLayer* lp = nullptr;
    VersionKey key;
    store::VersionRecord rec;
    // From an in-memory source, its header checked (`decoded`), its
    // tensors checked as they are copied out...
    std::shared_ptr<const StagingLease> image;
    VersionSource* source = nullptr;
    DecodedHeader decoded;
    // ...or read from disk, checked by the thread that copies it out.
    StagingLease lease;
    // A copy out of it to the target was not seen to complete (a GPU copy
    // past its deadline) and may still read it.
    bool copies_in_flight = false;
  };
  // What one thread holds.
  struct Reader {
    // Read (or found in memory), not yet copied out.
    std::optional<Fetched> held;
    size_t held_seq = 0;
    RestoreStats stats;
    // When its reads were submitted and waited for (the wait includes the
    // copy it overlaps).
    std::vector<std::pair<absl::Time, absl::Time>> reads;
  };

  // A version read from the local store did not verify.
  void NoteDamaged(const VersionKey& key) {
    if (damaged_ == nullptr) return;
    absl::MutexLock lock(&damaged_mu_);
    damaged_->push_back(key);
  }

  // An in-memory image did not verify: its source drops it.
  void NoteDamagedImage(const Fetched& f, const absl::Status& why) {
    CKPT_LOG(ERROR) << "memory tier: layer " << f.lp->layer << " step " << f.lp->step
                    << " does not check (" << why << "); dropped, to be read from disk";
    f.source->Drop(f.key, f.rec);
    if (damaged_images_ == nullptr) return;
    absl::MutexLock lock(&damaged_mu_);
    damaged_images_->push_back(f.key);
  }

  // Past the deadline or cancelled: every thread stops.
  absl::Status Stopping() const {
    if (absl::Now() >= deadline_) {
      return absl::DeadlineExceededError("the restore did not finish in time");
    }
    if (sources_.cancelled != nullptr && sources_.cancelled->load(std::memory_order_relaxed)) {
      return absl::CancelledError("the restore was cancelled");
    }
    return absl::OkStatus();
  }

  // How version `seq` ended: a failure stops the versions after it, a
  // deadline or a cancellation every version.
  void Record(size_t seq, const absl::Status& s) {
    if (s.ok()) {
      turns_.Finished(seq);
    } else if (s == Turns::Stopped()) {
      // An earlier version failed or the restore stopped: Result() says why.
    } else if (absl::IsCancelled(s) || absl::IsDeadlineExceeded(s)) {
      turns_.Stop(s);
    } else {
      turns_.Fail(seq, s);
    }
  }

  void ReaderMain(size_t k) {
    // A backend without transfers in flight between Submit and Wait (pwrite)
    // gains nothing from holding a version: it is copied out at once.
    IoBackend* const io = sources_.readers[k];
    Reader& self = readers_[k];
    for (size_t seq = k; seq < plan_.layers.size(); seq += threads_) {
      if (absl::Status s = Stopping(); !s.ok()) {
        turns_.Stop(s);
        break;  // what it holds is not copied out (Going is false)
      }
      absl::StatusOr<Fetched> f = Claim(seq, self);
      absl::Status s = f.status();
      if (s.ok() && f->image == nullptr) {
        s = Read(*f, io, self);
        if (absl::IsDataLoss(s)) NoteDamaged(f->key);
      }
      FinishHeld(self);  // where no read ran it (memory, or a failure first)
      if (!s.ok()) {
        Record(seq, s);
        return;
      }
      self.held = *std::move(f);
      self.held_seq = seq;
      if (!io->Overlaps()) FinishHeld(self);
    }
    FinishHeld(self);
  }

  // Checks and copies out the held version, unless an earlier one failed or
  // the restore stopped; its lease goes back either way.
  void FinishHeld(Reader& self) {
    if (!self.held.has_value()) return;
    absl::Status s;
    if (turns_.Going(self.held_seq)) {
      s = Stopping();
      if (s.ok()) s = CopyOut(*self.held, &self.stats);
      if (absl::IsDataLoss(s)) {
        if (self.held->image == nullptr) {
          NoteDamaged(self.held->key);
        } else {
          NoteDamagedImage(*self.held, s);
        }
      }
    }
    if (self.held->copies_in_flight) Withhold(*self.held);
    self.held.reset();
    Record(self.held_seq, s);
  }

  // Reads `f`'s file into its lease; the version the thread holds is copied
  // out while the reads are in flight.
  absl::Status Read(Fetched& f, IoBackend* io, Reader& self) {
    absl::StatusOr<VersionRead> read = sources_.store->PrepareRead(f.key, f.rec, f.lease);
    if (!read.ok()) return WithLayer(*f.lp, read.status());
    const absl::Time begin = absl::Now();
    io->Submit(IoDirection::kRead, read->fd.get(), read->segments);
    FinishHeld(self);
    absl::Status s = io->Wait();
    self.reads.emplace_back(begin, absl::Now());
    return s.ok() ? s : WithLayer(*f.lp, s);
  }

  // The image of `f` from the first in-memory source whose image's header
  // checks (in the restore's turn, so only the header: its tensors are
  // checked as the thread copies them out).
  void FindInMemory(Fetched& f) {
    for (VersionSource* source : sources_.in_memory) {
      std::shared_ptr<const StagingLease> image = source->FindImage(f.key, f.rec);
      if (image == nullptr) continue;
      absl::StatusOr<DecodedHeader> decoded = CheckImageHeader(f.key, f.rec, LeaseImage(*image));
      if (decoded.ok()) {
        f.image = std::move(image);
        f.source = source;
        f.decoded = *std::move(decoded);
        return;
      }
      CKPT_LOG(ERROR) << "memory tier: layer " << f.lp->layer << " step " << f.lp->step
                      << " does not check (" << decoded.status() << "); read from disk";
    }
  }

  // First half: looks version `seq` up and takes the place of its bytes: a
  // checked image from an in-memory source, or a staging lease its file is
  // then read into. The thread finishes what it holds before it waits for
  // its turn, and before it asks for room a second time.
  absl::StatusOr<Fetched> Claim(size_t seq, Reader& self) {
    const PlannedLayer& lp = plan_.layers[seq];
    if (lp.layer >= static_cast<uint32_t>(table_.layers_size())) {
      return absl::FailedPreconditionError(absl::StrCat("plan names unknown layer ", lp.layer));
    }
    CKPT_ASSIGN_OR_RETURN(
        auto rec, sources_.index->VersionAtOrBefore(plan_.job, plan_.rank, lp.layer, lp.step));
    if (!rec.has_value() || rec->first != lp.step) {
      return absl::AbortedError(absl::StrCat("layer ", lp.layer, " version ", lp.step,
                                             " vanished during the restore; plan again"));
    }
    Fetched f;
    f.lp = &lp;
    f.key = VersionKey{plan_.job, plan_.rank, lp.layer, lp.step};
    f.rec = std::move(rec->second);
    // Every version takes its turn, so the next one's thread may go on. An
    // image of the memory tier is taken in turn too: one held by a later
    // version would keep its chunks from the oldest, waiting below for room
    // the tier gives back.
    if (!turns_.MayTakeTurn(seq)) FinishHeld(self);
    CKPT_RETURN_IF_ERROR(turns_.TakeTurn(seq, deadline_));
    FindInMemory(f);
    if (f.image != nullptr) {
      turns_.EndTurn(seq);
      return f;
    }
    absl::Status room = TakeRoom(seq, f, self);
    turns_.EndTurn(seq);
    if (!room.ok()) return room;
    return f;
  }

  // A version claimed while an older one is unfinished takes free room
  // only; the oldest may also take room back from the memory tier, and wait
  // for it. (A restore that evicted the tier to read ahead would leave the
  // newest step on disk.)
  absl::Status TakeRoom(size_t seq, Fetched& f, Reader& self) {
    StagingPool* const pool = sources_.pool;
    std::optional<StagingLease> free_room = pool->TryAcquire(f.rec.file_bytes());
    if (!free_room.has_value()) {
      // What this thread held may be the room: it is back once copied out,
      // and the wait for the other threads' older versions is needed only
      // when it is not enough.
      FinishHeld(self);
      if (!turns_.Going(seq)) return Turns::Stopped();  // what it held failed, or a stop
      free_room = pool->TryAcquire(f.rec.file_bytes());
    }
    if (!free_room.has_value()) {
      CKPT_RETURN_IF_ERROR(turns_.WaitUntilOldest(seq, deadline_));
      absl::StatusOr<StagingLease> lease = pool->Acquire(f.rec.file_bytes(), deadline_);
      if (!lease.ok()) return WithLayer(*f.lp, lease.status());
      free_room = *std::move(lease);
    }
    f.lease = *std::move(free_room);
    return absl::OkStatus();
  }

  // The stored tensors of `f`, matched with the registration's by name.
  absl::StatusOr<std::vector<const store::TensorEntry*>> MatchTensors(const Fetched& f) {
    const PlannedLayer& lp = *f.lp;
    const store::LayerSpec& spec = table_.layers(static_cast<int>(lp.layer));
    std::map<std::string, const store::TensorEntry*> stored;
    for (const store::TensorEntry& t : f.decoded.header.tensors()) stored[t.name()] = &t;
    if (stored.size() != static_cast<size_t>(f.decoded.header.tensors_size())) {
      return WithLayer(lp, absl::DataLossError("two stored tensors have the same name"));
    }
    CKPT_RETURN_IF_ERROR(SameTensorNames(lp, spec, stored));
    std::vector<const store::TensorEntry*> out;
    for (const store::TensorSpec& ts : spec.tensors()) {
      const store::TensorEntry& saved = *stored.at(ts.name());
      if (saved.nbytes() != ts.nbytes() || saved.dtype() != ts.dtype()) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor '", ts.name(), "' of layer ", lp.layer, " '", lp.name, "' is ",
                         Described(saved.dtype(), saved.shape()), " in the checkpoint of step ",
                         lp.step, " and ", Described(ts.dtype(), ts.shape()),
                         " as registered: restore into a model of the sizes and dtypes the job was "
                         "trained with"));
      }
      out.push_back(&saved);
    }
    return out;
  }

  // One piece of a tensor of `f` into its destination `*out`, advancing it.
  absl::Status CopyPiece(Fetched& f, char** out, const char* piece, uint64_t n) {
    absl::Status s;
    if (target_.memory == nullptr) {
      std::memcpy(*out, piece, n);
    } else if (copy_on_cpu_) {
      s = target_.memory->CopyIn(*out, piece, n);
    } else {
      absl::MutexLock lock(&copy_mu_);  // one DMA copy at a time, its error its own
      s = target_.memory->CopyIn(*out, piece, n);
      if (!s.ok() && target_.memory->CopiesInFlight()) f.copies_in_flight = true;
    }
    *out += n;
    return s;
  }

  // The copy out of `f` gave up while the device may still read its bytes
  // (DEADLINE_EXCEEDED, CANCELLED): its staging (a lease, or a memory-tier
  // image) stays out of the pool until the target memory sees its copies
  // complete. Back in the pool meanwhile, it could be refilled with another
  // job's bytes, which the late copy would carry into this trainer's
  // memory.
  void Withhold(Fetched& f) {
    const uint64_t bytes = f.image != nullptr ? f.image->capacity() : f.lease.capacity();
    if (f.image != nullptr) {
      target_.memory->HoldUntilCopiesLand(std::move(f.image));
    } else {
      target_.memory->HoldUntilCopiesLand(std::make_shared<StagingLease>(std::move(f.lease)));
    }
    CKPT_LOG(ERROR) << "restore of job " << plan_.job << " rank " << plan_.rank << " layer "
                    << f.lp->layer << ": the GPU did not finish ckptd's copies; " << bytes
                    << " bytes of staging memory they read stay out of the pool until the device "
                    << "is seen to have finished them";
  }

  // Second half: matches a version's tensors with the registration and
  // copies them out; a version read from disk has each tensor checksummed on
  // the way (a mismatch is DATA_LOSS, after that tensor's bytes were copied).
  absl::Status CopyOut(Fetched& f, RestoreStats* stats) {
    const PlannedLayer& lp = *f.lp;
    if (f.image == nullptr) {
      absl::StatusOr<DecodedHeader> decoded = CheckImageHeader(f.key, f.rec, LeaseImage(f.lease));
      if (!decoded.ok()) return WithLayer(lp, decoded.status());
      f.decoded = *std::move(decoded);
    } else {
      ++stats->memory_layers;  // its header was checked when it was found
    }
    from_memory_[static_cast<size_t>(f.lp - plan_.layers.data())] = f.image != nullptr;
    CKPT_ASSIGN_OR_RETURN(std::vector<const store::TensorEntry*> tensors, MatchTensors(f));
    const StagingLease& src = f.image != nullptr ? *f.image : f.lease;
    const LeaseImage image(src);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const store::TensorEntry* t = tensors[i];
      char* out = target_.tensors[lp.layer][i];
      auto copy_piece = [&](const char* piece, uint64_t n) { return CopyPiece(f, &out, piece, n); };
      // Checked as it is copied, from memory or disk: the checksum of a
      // piece while it is in cache, before it is copied.
      const uint64_t piece = copy_on_cpu_ ? kVerifyPieceBytes : src.chunk_bytes();
      if (absl::Status s = VerifyTensor(f.decoded, *t, image, piece, copy_piece); !s.ok()) {
        return WithLayer(lp, s);
      }
      stats->bytes += t->nbytes();
      if (f.image != nullptr) stats->memory_bytes += t->nbytes();
    }
    return absl::OkStatus();
  }

  absl::Mutex damaged_mu_;
  std::vector<VersionKey>* const damaged_ ABSL_PT_GUARDED_BY(damaged_mu_);
  std::vector<VersionKey>* const damaged_images_ ABSL_PT_GUARDED_BY(damaged_mu_);
  const CompositePlan& plan_;
  const store::RankRecord& table_;
  const RestoreTarget& target_;
  const RecoverySources& sources_;
  const bool copy_on_cpu_;
  const absl::Time start_;
  const absl::Time deadline_;
  const size_t threads_;
  Turns turns_;
  absl::Mutex copy_mu_;
  std::vector<Reader> readers_;  // one per thread, each touched by its own only
  // Per plan layer, whether memory served it: each element written by the
  // one thread that copies that layer out, read after they are joined.
  std::vector<uint8_t> from_memory_;
};

}  // namespace

absl::StatusOr<RestoreStats> RestoreInto(const CompositePlan& plan, const store::RankRecord& table,
                                         const RestoreTarget& target,
                                         const RecoverySources& sources,
                                         std::vector<VersionKey>* damaged,
                                         std::vector<VersionKey>* damaged_images) {
  CKPT_RETURN_IF_ERROR(CheckComplete(plan));
  if (sources.readers.empty()) return absl::InvalidArgumentError("a restore needs an I/O backend");
  if (plan.layers.empty()) return RestoreStats();
  return RestoreRun(plan, table, target, sources, damaged, damaged_images).Run();
}

}  // namespace ckpt
