// Commit pipeline: writer threads write staged layer versions; the publisher
// makes them durable and visible in groups (daemon/store/publisher.h).
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "daemon/common/kill_point.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"

namespace ckpt {

void Engine::WriterLoop(std::unique_ptr<IoBackend> io) {
  for (;;) {
    std::unique_ptr<WriteTask> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_writers_ || !write_queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_writers_) return;
      task = std::move(write_queue_.front());
      write_queue_.pop_front();
      ++commits_in_flight_;
    }
    CKPT_DELAY_POINT("writer.before_commit");
    const uint64_t file_bytes = task->version.layout.file_bytes;
    // Reserve the bytes under the owner's quota and the disk bound before
    // writing (writers race).
    const QuotaOwner owner{task->rank->uid, task->rank->job};
    QuotaKind refused = QuotaKind::kDisk;
    if (absl::Status quota = quota_.ReserveVersion(owner, file_bytes, &refused); !quota.ok()) {
      if (Metrics* m = options_.metrics) m->Inc(Counter::kQuotaRefused, QuotaKindName(refused), 1);
      FinishCommit(std::move(task), /*reserved=*/false, std::move(quota), CommitTimings());
      continue;
    }
    if (absl::Status room = disk_.Reserve(file_bytes); !room.ok()) {
      quota_.ReleaseVersion(owner, file_bytes);
      FinishCommit(std::move(task), /*reserved=*/false, std::move(room), CommitTimings());
      continue;
    }
    absl::StatusOr<WrittenVersion> written = store_->Write(&task->version, io.get());
    if (!written.ok()) {
      FinishCommit(std::move(task), /*reserved=*/true, written.status(), CommitTimings());
      continue;
    }
    // The staging lease stays with the task until the version is published
    // (the memory tier keeps it then); this writer goes on with the next
    // version's data meanwhile.
    publisher_->Submit(*std::move(written),
                       [this, task = std::move(task)](absl::StatusOr<store::VersionRecord> rec,
                                                      const CommitTimings& timings) mutable {
                         FinishCommit(std::move(task), /*reserved=*/true, std::move(rec), timings);
                       });
  }
}

void Engine::FinishCommit(std::unique_ptr<WriteTask> task, bool reserved,
                          absl::StatusOr<store::VersionRecord> rec, const CommitTimings& timings) {
  const uint64_t bytes = task->version.layout.payload_bytes;
  const uint64_t file_bytes = task->version.layout.file_bytes;
  if (!rec.ok() && reserved) {
    disk_.Release(file_bytes);
    quota_.ReleaseVersion(QuotaOwner{task->rank->uid, task->rank->job}, file_bytes);
  }
  if (rec.ok()) {
    if (Metrics* m = options_.metrics) {
      m->Observe(Histogram::kWriteSeconds, timings.write_seconds);
      m->Observe(Histogram::kFsyncSeconds, timings.sync_seconds);
      m->Observe(Histogram::kCommitSeconds, timings.total_seconds);
    }
  }
  const uint64_t step = task->version.key.step;
  const uint32_t layer = task->version.key.layer;
  std::shared_ptr<RankState> r = std::move(task->rank);
  if (rec.ok() && memory_tier_.enabled()) {
    // The committed image stays in memory for restores (memory_tier.h).
    memory_tier_.Put(RankKey(r->job, r->rank), layer, step, rec->file(), r->uid,
                     std::move(task->version.lease));
  }
  task.reset();  // returns the staging chunks (those the memory tier did not keep)
  FinishVersion(r, step, layer, rec, bytes);
  AdvanceEvents(r);
  absl::MutexLock lock(&mu_);
  --commits_in_flight_;
  absl::MutexLock rank_lock(&r->mu);
  ForgetIfDone(&ranks_, r);  // the last version of a rank unregistered meanwhile
}

}  // namespace ckpt
