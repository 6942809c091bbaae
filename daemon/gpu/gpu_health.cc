#include "daemon/gpu/gpu_health.h"

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace ckpt {

bool GpuHealth::MarkPoisoned(int device, const std::string& uuid, const absl::Status& error) {
  PoisonedGpu gpu{device, uuid, std::string(error.message())};
  {
    absl::MutexLock lock(&mu_);
    if (!poisoned_.emplace(device, gpu).second) return false;
  }
  CKPT_LOG(ERROR) << PoisonedGpuReason(gpu) << "; its ranks are released";
  return true;
}

bool GpuHealth::IsPoisoned(int device) const {
  absl::MutexLock lock(&mu_);
  return poisoned_.count(device) != 0;
}

absl::Status GpuHealth::CheckUsable(int device) const {
  absl::MutexLock lock(&mu_);
  auto it = poisoned_.find(device);
  if (it == poisoned_.end()) return absl::OkStatus();
  return absl::FailedPreconditionError(PoisonedGpuReason(it->second));
}

std::vector<PoisonedGpu> GpuHealth::Poisoned() const {
  absl::MutexLock lock(&mu_);
  std::vector<PoisonedGpu> out;
  for (const auto& [device, gpu] : poisoned_) out.push_back(gpu);
  return out;
}

uint64_t GpuHealth::version() const {
  absl::MutexLock lock(&mu_);
  return poisoned_.size();
}

std::string PoisonedGpuReason(const PoisonedGpu& gpu) {
  return absl::StrCat(
      "GPU ", gpu.uuid, " (CUDA device ", gpu.device,
      " in ckptd) is unusable: a sticky CUDA error poisoned ckptd's context on it (", gpu.error,
      "); restart ckptd to use this GPU again");
}

}  // namespace ckpt
