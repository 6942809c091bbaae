// Engine facade: construction, start and shutdown of the stage threads.
#include "daemon/engine/engine.h"

#include <algorithm>

#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/engine/rank_state.h"
#include "daemon/gpu/cuda_host.h"
#include "daemon/gpu/ipc_memory.h"

namespace ckpt {

Engine::Engine(EngineOptions options, Index* index, LayerStore* store, StagingPool* pool)
    : options_(std::move(options)),
      index_(index),
      store_(store),
      pool_(pool),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      drift_kernel_(drift::MakeCpuDriftKernel(options_.drift_threads)),
      cuda_ipc_(options_.cuda_ipc),
      gpu_support_(CudaSupport()),
      disk_(options_.max_disk_bytes, options_.min_free_disk_bytes, store) {
  if (cuda_ipc_ == nullptr) {
    own_cuda_ipc_ = MakeCudaIpc();
    cuda_ipc_ = own_cuda_ipc_.get();
  }
}

Engine::~Engine() { Shutdown(absl::ZeroDuration()); }

absl::Status Engine::Start() {
  std::vector<std::unique_ptr<IoBackend>> backends;
  for (unsigned i = 0; i < std::max(1u, options_.writer_threads); ++i) {
    CKPT_ASSIGN_OR_RETURN(auto io, MakeIoBackend(options_.io_backend, options_.io_queue_depth));
    backends.push_back(std::move(io));
  }
  io_backend_name_ = backends[0]->Name();
  if (options_.metrics != nullptr) options_.metrics->Set(Gauge::kIoBackendInfo, io_backend_name_, 1);
  // Disk usage of committed versions, kept current by commits and GC.
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, index_->ListJobs());
  uint64_t used = 0;
  for (const std::string& job : jobs) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint32_t> ranks, index_->ListRanks(job));
    for (uint32_t rank : ranks) {
      CKPT_RETURN_IF_ERROR(index_->ForEachVersion(
          job, rank, -1, [&used](const VersionKey&, const store::VersionRecord& rec) {
            used += rec.file_bytes();
            return true;
          }));
    }
  }
  disk_.Reset(used);
  if (options_.io_backend == IoBackendKind::kAuto && io_backend_name_ != "io_uring") {
    CKPT_LOG(WARNING) << "io_uring is unavailable (kernel or seccomp); writing with pwrite";
  }
  for (auto& io : backends) {
    writer_threads_.emplace_back([this, b = io.release()] { WriterLoop(std::unique_ptr<IoBackend>(b)); });
  }
  for (unsigned i = 0; i < std::max(1u, options_.snapshot_threads); ++i) {
    snapshot_threads_.emplace_back([this] { SnapshotLoop(); });
  }
  if (options_.gc_interval > absl::ZeroDuration()) gc_thread_ = std::thread([this] { GcLoop(); });
  watch_thread_ = std::thread([this] { WatchTrainersLoop(); });
  return absl::OkStatus();
}

void Engine::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && stop_writers_) return;
    stopping_ = true;
    shutting_down_.store(true, std::memory_order_relaxed);
    // Waits on a rank's own mutex see the shutdown through its flag.
    for (auto& [key, r] : ranks_) {
      absl::MutexLock rank_lock(&r->mu);
      r->stopping = true;
    }
  }
  // A delay point too, so a test can hold a real ckptd here: stopping, with
  // its sockets still answering.
  CKPT_DELAY_POINT("engine.shutdown.stopping");
  for (auto& t : snapshot_threads_) t.join();
  snapshot_threads_.clear();
  if (gc_thread_.joinable()) gc_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  {
    // Let the writers finish what is staged, within the grace period.
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return write_queue_.empty() && writers_busy_ == 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&drained), grace)) {
      CKPT_LOG(WARNING) << "shutdown: discarding " << write_queue_.size()
                        << " staged layer versions that were not written in time";
    }
    stop_writers_ = true;
  }
  for (auto& t : writer_threads_) t.join();
  writer_threads_.clear();
  // Mappings and the ranks themselves (a GPU rank's drift kernel synchronizes
  // its stream) are destroyed after the locks are released.
  std::vector<std::shared_ptr<RankMemory>> closing;
  std::map<RankKey, std::shared_ptr<Rank>> ranks;
  absl::MutexLock lock(&mu_);
  write_queue_.clear();
  for (auto& [key, r] : ranks_) {
    absl::MutexLock rank_lock(&r->mu);
    r->active = false;
    r->ReleaseMemory("ckptd is shutting down", &closing);
  }
  ranks.swap(ranks_);
}

}  // namespace ckpt
