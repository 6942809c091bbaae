// ckpt_bench's set-up (ckpt_bench.h): the directory, one I/O backend per
// writer, the version layout every path writes, the staging pool filled
// before any clock starts, the store with an interrupted run's leftovers
// removed, and whether the disk takes O_DIRECT. Also the helpers the paths
// share.
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "tools/ckpt_bench.h"

namespace ckpt::bench {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double ProcessCpuSeconds() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& tv) { return static_cast<double>(tv.tv_sec) + tv.tv_usec / 1e6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

absl::Status Bench::Setup() {
  CKPT_ASSIGN_OR_RETURN(IoBackendKind kind, ParseIoBackendKind(a_.backend));
  CKPT_ASSIGN_OR_RETURN(dir_fd_, fs_->MakeDirs(a_.dir));
  versions_ = a_.total_bytes / a_.layer_bytes;
  bytes_per_round_ = versions_ * a_.layer_bytes;
  // One backend per writer thread, shared by both paths (same kind, same depth).
  CKPT_RETURN_IF_ERROR(AddBackends(kind, a_.writers, &io_));
  CKPT_RETURN_IF_ERROR(PlanVersion());
  CKPT_RETURN_IF_ERROR(CheckFreeSpace());
  const uint64_t lease_bytes = AlignUp(layout_.file_bytes, a_.chunk_bytes);
  CKPT_RETURN_IF_ERROR(SetupStaging(lease_bytes));
  CKPT_RETURN_IF_ERROR(OpenStore());
  CKPT_RETURN_IF_ERROR(RemoveRawLeftovers());
  if (a_.restore) CKPT_RETURN_IF_ERROR(SetupRestore(lease_bytes));
  return ProbeDirectIo();
}

absl::Status Bench::AddBackends(IoBackendKind kind, size_t count,
                                std::vector<std::unique_ptr<IoBackend>>* ios) const {
  while (ios->size() < count) {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io, MakeIoBackend(kind, a_.queue_depth));
    ios->push_back(std::move(io));
  }
  return absl::OkStatus();
}

// The layout every version shares: one u8 tensor of layer_bytes.
absl::Status Bench::PlanVersion() {
  header_.set_job_id("bench");
  header_.set_rank(0);
  header_.set_generation(1);
  store::TensorEntry* t = header_.add_tensors();
  t->set_name("w");
  t->set_dtype(store::DTYPE_U8);
  t->add_shape(a_.layer_bytes);
  t->set_nbytes(a_.layer_bytes);
  CKPT_ASSIGN_OR_RETURN(layout_, PlanLayout(&header_));
  return absl::OkStatus();
}

absl::Status Bench::CheckFreeSpace() const {
  CKPT_ASSIGN_OR_RETURN(uint64_t free_bytes, fs_->FreeBytes(dir_fd_.get()));
  const uint64_t need = versions_ * layout_.file_bytes + a_.writers * a_.chunk_bytes;
  if (free_bytes < need) {
    return absl::ResourceExhaustedError(
        absl::StrCat(a_.dir, " has ", free_bytes, " free bytes; one round needs about ", need));
  }
  return absl::OkStatus();
}

// Staging: pre-faulted at creation; each writer holds one lease for the run,
// filled with bytes that are never zero (path C checks for them).
absl::Status Bench::SetupStaging(uint64_t lease_bytes) {
  StagingPoolOptions po;
  po.chunk_bytes = a_.chunk_bytes;
  // Writers hold two leases each; a restore holds up to kRestoreLeases per
  // rank and a raw reader one.
  po.budget_bytes =
      (uint64_t{2} * a_.writers + uint64_t{kRestoreLeases + 1} * a_.ranks) * lease_bytes;
  po.lock_memory = false;  // locking does not change write speed; avoids RLIMIT noise
  CKPT_ASSIGN_OR_RETURN(pool_, StagingPool::Create(po));
  for (uint32_t w = 0; w < a_.writers; ++w) {
    CKPT_ASSIGN_OR_RETURN(StagingLease lease,
                          pool_->Acquire(lease_bytes, absl::Now() + absl::Seconds(1)));
    for (size_t c = 0; c < lease.chunk_count(); ++c) {
      char* p = lease.chunk(c);
      for (uint64_t i = 0; i < lease.chunk_bytes(); ++i) {
        p[i] = static_cast<char>(((c * 7919 + i * 31 + w) & 0x7f) | 1);  // never zero
      }
    }
    leases_.push_back(std::move(lease));
  }
  return absl::OkStatus();
}

absl::Status Bench::OpenStore() {
  CKPT_ASSIGN_OR_RETURN(index_, Index::Open(a_.dir + "/index"));
  store_ = std::make_unique<LayerStore>(a_.dir, fs_, index_.get(), /*use_direct_io=*/true);
  CKPT_RETURN_IF_ERROR(store_->Init());
  // Leftovers of an interrupted earlier run (no event records, so every
  // version is "uncommitted") are moved to <dir>/quarantine/ here.
  CKPT_ASSIGN_OR_RETURN(ReconcileReport rep, store_->Reconcile());
  leftovers_ = rep.temp_files_removed + rep.orphan_files_quarantined +
               rep.uncommitted_versions_removed + rep.dangling_records_removed;
  return absl::OkStatus();
}

// Whether the disk takes O_DIRECT (tmpfs does not; both paths then fall back).
absl::Status Bench::ProbeDirectIo() {
  CKPT_ASSIGN_OR_RETURN(UniqueFd probe,
                        fs_->CreateExclusive(dir_fd_.get(), "bench.probe", true, &direct_));
  CKPT_RETURN_IF_ERROR(probe.Close());
  return fs_->Unlink(dir_fd_.get(), "bench.probe");
}

}  // namespace ckpt::bench
