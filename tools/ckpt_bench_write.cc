// ckpt_bench path A (ckpt_bench.h): the daemon's commit path. Writers write
// each version through LayerStore::Write and one Publisher makes groups of
// them durable and visible, as ckptd's engine commits (--commit=grouped);
// or each writer runs LayerStore::Commit, the whole protocol one version at
// a time (--commit=serial, for comparison).
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "daemon/store/publisher.h"
#include "tools/ckpt_bench.h"

namespace ckpt::bench {

std::vector<StagedVersion> Bench::StageVersions(uint32_t round) const {
  std::vector<StagedVersion> vs(versions_);
  for (uint64_t i = 0; i < versions_; ++i) {
    StagedVersion& v = vs[i];
    v.key = VersionKey{"bench", static_cast<uint32_t>(i % a_.ranks),
                       static_cast<uint32_t>(i / a_.ranks), round * uint64_t{100000} + i};
    v.generation = 1;
    v.header = header_;
    v.header.set_rank(v.key.rank);
    v.header.set_layer(v.key.layer);
    v.header.set_layer_name(absl::StrCat("bench.", i));
    v.header.set_step(v.key.step);
    v.layout = layout_;
  }
  return vs;
}

absl::StatusOr<absl::Duration> Bench::RunStore(uint32_t round) {
  std::vector<StagedVersion> vs = StageVersions(round);
  keys_.assign(versions_, VersionKey{});
  recs_.assign(versions_, store::VersionRecord{});
  committed_.assign(versions_, 0);
  timings_.assign(versions_, CommitTimings{});
  std::atomic<uint64_t> next{0};
  absl::Mutex mu;
  absl::Status first_error;
  // Where version i's commit ended (on a writer or on the publisher).
  auto finish = [&](uint64_t i, absl::StatusOr<store::VersionRecord> rec, const CommitTimings& t) {
    timings_[i] = t;
    if (!rec.ok()) {
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = rec.status();
      next.store(versions_);
      return;
    }
    recs_[i] = *std::move(rec);
    keys_[i] = vs[i].key;
    committed_[i] = 1;  // distinct elements per i; read after the round
  };
  // As the engine commits: writers write, one publisher publishes groups
  // (--commit=grouped); or each writer runs the whole protocol for one
  // version at a time (--commit=serial, for comparison).
  Publisher publisher(store_.get());
  absl::Duration d = TimeThreads(
      a_.writers,
      [&](uint32_t w) {
        for (uint64_t i = next.fetch_add(1); i < versions_; i = next.fetch_add(1)) {
          vs[i].lease = std::move(leases_[w]);
          if (a_.serial_commit) {
            CommitTimings t;
            absl::StatusOr<store::VersionRecord> rec = store_->Commit(&vs[i], io_[w].get(), &t);
            leases_[w] = std::move(vs[i].lease);
            finish(i, std::move(rec), t);
            continue;
          }
          absl::StatusOr<WrittenVersion> written = store_->Write(&vs[i], io_[w].get());
          // Every write completed: the lease may be filled again.
          leases_[w] = std::move(vs[i].lease);
          if (!written.ok()) {
            finish(i, written.status(), CommitTimings());
            continue;
          }
          publisher.Submit(*std::move(written),
                           [&finish, i](absl::StatusOr<store::VersionRecord> rec,
                                        const CommitTimings& t) { finish(i, std::move(rec), t); });
        }
      },
      [&publisher] { publisher.Stop(); });
  groups_ = a_.serial_commit ? versions_ : publisher.groups();
  if (!first_error.ok()) {
    IgnoreError(RemoveVersions(), "the round already failed");
    return first_error;
  }
  return d;
}

absl::Status Bench::RemoveVersions() {
  absl::Status first_error;
  for (uint64_t i = 0; i < committed_.size(); ++i) {
    if (!committed_[i]) continue;
    absl::Status s = store_->Remove(keys_[i], recs_[i]);
    if (first_error.ok() && !s.ok()) first_error = s;
    committed_[i] = 0;
  }
  return first_error;
}

std::vector<double> Bench::CommitBreakdown() const {
  std::vector<double> sum(4, 0.0);
  for (const CommitTimings& t : timings_) {
    sum[0] += t.write_seconds;
    sum[1] += t.sync_seconds;
    sum[2] += t.total_seconds - t.write_seconds - t.sync_seconds;
    sum[3] += t.hash_seconds;
  }
  return sum;
}

double Bench::MedianCommitSeconds() const {
  std::vector<double> t;
  for (const CommitTimings& c : timings_) t.push_back(c.total_seconds);
  return Median(std::move(t));
}

}  // namespace ckpt::bench
