// ckpt_bench path C (ckpt_bench.h): the daemon's restore path. Each rank's
// composite plan of the versions path A committed is restored by
// RestoreInto (index lookups, O_DIRECT reads, every checksum) into a fresh
// mapping of the rank's memfd, as after a trainer's new registration; the
// ranks restore at once, two readers each, as ckptd's engine gives them.
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "daemon/recovery/restore.h"
#include "tools/ckpt_bench.h"

namespace ckpt::bench {

// The trainers' memory (one zeroed memfd per rank), their layer tables, a
// read lease per rank for path D, and the backends of paths C and D.
absl::Status Bench::SetupRestore(uint64_t lease_bytes) {
  const uint64_t per_rank = (versions_ + a_.ranks - 1) / a_.ranks * a_.layer_bytes;
  for (uint32_t r = 0; r < a_.ranks; ++r) {
    // The trainer's memfd, touched as a trainer's tensors would be.
    CKPT_ASSIGN_OR_RETURN(MemfdRegion m,
                          MemfdRegion::Create(absl::StrCat("bench-rank-", r), per_rank));
    std::memset(m.data(), 0, m.size());
    trainer_.push_back(std::move(m));
    store::RankRecord table;
    for (uint64_t l = 0; l * a_.ranks + r < versions_; ++l) {
      store::LayerSpec* spec = table.add_layers();
      spec->set_id(static_cast<uint32_t>(l));
      spec->set_name(absl::StrCat("bench.", l));
      store::TensorSpec* t = spec->add_tensors();
      t->set_name("w");
      t->set_dtype(store::DTYPE_U8);
      t->add_shape(a_.layer_bytes);
      t->set_nbytes(a_.layer_bytes);
    }
    tables_.push_back(std::move(table));
    CKPT_ASSIGN_OR_RETURN(StagingLease lease,
                          pool_->Acquire(lease_bytes, absl::Now() + absl::Seconds(1)));
    read_leases_.push_back(std::move(lease));
  }
  // Each raw reader uses one backend, each restore two (ckptd's engine
  // gives a restore two readers).
  CKPT_ASSIGN_OR_RETURN(IoBackendKind kind, ParseIoBackendKind(a_.backend));
  CKPT_RETURN_IF_ERROR(AddBackends(kind, a_.ranks, &io_));
  return AddBackends(kind, 2 * a_.ranks, &restore_io_);
}

absl::StatusOr<MappedRegion> Bench::MapFresh(const MemfdRegion& m) {
  int fd = ::fcntl(m.fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "dup");
  return MappedRegion::Map(UniqueFd(fd));
}

// One plan per rank of the versions the last RunStore committed, and a
// fresh mapping of each rank's memfd to restore into.
absl::Status Bench::PlanRestores(std::vector<CompositePlan>* plans,
                                 std::vector<HostMemory>* memory) {
  for (uint32_t r = 0; r < a_.ranks; ++r) {
    CompositePlan& plan = (*plans)[r];
    plan.job = "bench";
    plan.rank = r;
    plan.complete = true;
    CKPT_ASSIGN_OR_RETURN(MappedRegion m, MapFresh(trainer_[r]));
    std::vector<MappedRegion> regions;
    regions.push_back(std::move(m));
    memory->emplace_back(std::move(regions));
  }
  for (uint64_t i = 0; i < versions_; ++i) {
    if (!committed_[i]) {
      return absl::FailedPreconditionError("restore before a complete write round");
    }
    CompositePlan& plan = (*plans)[keys_[i].rank];
    PlannedLayer lp;
    lp.layer = keys_[i].layer;
    lp.name = absl::StrCat("bench.", keys_[i].layer);
    lp.has_version = true;
    lp.step = keys_[i].step;
    lp.bytes = a_.layer_bytes;
    lp.file = recs_[i].file();
    plan.target_step = std::max(plan.target_step, lp.step);
    plan.layers.push_back(std::move(lp));
  }
  return absl::OkStatus();
}

// The bytes arrived: staging data is never zero, the memfd was zeroed. Zeroes
// the memfds again for the next round.
absl::Status Bench::CheckRestored(const std::vector<CompositePlan>& plans) {
  for (uint32_t r = 0; r < a_.ranks; ++r) {
    const char* p = static_cast<const char*>(trainer_[r].data());
    for (size_t l = 0; l < plans[r].layers.size(); ++l) {
      if (p[l * a_.layer_bytes] == 0 || p[(l + 1) * a_.layer_bytes - 1] == 0) {
        return absl::InternalError(absl::StrCat("rank ", r, " layer ", l, " was not restored"));
      }
    }
    std::memset(trainer_[r].data(), 0, trainer_[r].size());
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> Bench::RunRestore() {
  std::vector<CompositePlan> plans(a_.ranks);
  std::vector<HostMemory> memory;
  CKPT_RETURN_IF_ERROR(PlanRestores(&plans, &memory));
  absl::Mutex mu;
  absl::Status first_error;
  double reading_share = 1;  // the lowest of the ranks'
  const double cpu = ProcessCpuSeconds();
  absl::Duration d = TimeThreads(a_.ranks, [&](uint32_t r) {
    HostMemory& mem = memory[r];
    RestoreTarget target;
    target.memory = &mem;
    for (int l = 0; l < tables_[r].layers_size(); ++l) {
      target.tensors.push_back({mem.base(0) + uint64_t(l) * a_.layer_bytes});
    }
    RecoverySources sources;
    sources.index = index_.get();
    sources.store = store_.get();
    sources.pool = pool_.get();
    sources.readers = {restore_io_[2 * r].get(), restore_io_[2 * r + 1].get()};
    sources.timeout = absl::Minutes(10);
    absl::StatusOr<RestoreStats> stats = RestoreInto(plans[r], tables_[r], target, sources);
    absl::Status s = stats.status();
    if (s.ok() && stats->bytes != plans[r].layers.size() * a_.layer_bytes) {
      s = absl::InternalError(absl::StrCat("rank ", r, " restored ", stats->bytes, " bytes"));
    }
    absl::MutexLock lock(&mu);
    if (!s.ok()) {
      if (first_error.ok()) first_error = s;
    } else {
      reading_share = std::min(reading_share, stats->ReadingShare());
    }
  });
  restore_cpu_seconds_ = ProcessCpuSeconds() - cpu;
  restore_reading_share_ = reading_share;
  CKPT_RETURN_IF_ERROR(first_error);
  CKPT_RETURN_IF_ERROR(CheckRestored(plans));
  return d;
}

}  // namespace ckpt::bench
