#include "daemon/gpu/ipc_memory.h"

#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/region.h"
#include "base/status.h"

namespace ckpt {
namespace {

std::atomic<uint64_t> g_mappings{0};
std::atomic<uint64_t> g_mapping_bytes{0};

}  // namespace

GpuMappingStats OpenGpuMappings() {
  return GpuMappingStats{g_mappings.load(std::memory_order_relaxed),
                         g_mapping_bytes.load(std::memory_order_relaxed)};
}

absl::StatusOr<std::vector<uint64_t>> CheckGpuHandover(const GpuHandover& handover) {
  // "GPU-" and a 36-character UUID, as nvidia-smi and cudaDeviceProp print it.
  const std::string& uuid = handover.device_uuid;
  if (uuid.size() != 40 || !absl::StartsWith(uuid, "GPU-")) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu handover: device_uuid '", uuid.substr(0, 64),
                     "' is not of the form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"));
  }
  if (handover.regions.empty() || handover.regions.size() > kMaxGpuRegions) {
    return absl::InvalidArgumentError(absl::StrCat("gpu handover: ", handover.regions.size(),
                                                   " regions; expected 1..", kMaxGpuRegions));
  }
  if (handover.step_event.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu handover: step_event is ", handover.step_event.size(), " bytes, not a ",
                     kCudaIpcHandleBytes, "-byte cudaIpcEventHandle_t"));
  }
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < handover.regions.size(); ++i) {
    const GpuRegion& r = handover.regions[i];
    if (r.ipc_handle.size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu region ", i, ": ipc_handle is ", r.ipc_handle.size(), " bytes, not a ",
                       kCudaIpcHandleBytes, "-byte cudaIpcMemHandle_t"));
    }
    if (r.bytes == 0 || r.bytes > kMaxRegionBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpu region ", i, ": size ", r.bytes, " out of range"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (handover.regions[j].ipc_handle == r.ipc_handle) {
        return absl::InvalidArgumentError(
            absl::StrCat("gpu regions ", j, " and ", i, " carry the same ipc_handle"));
      }
    }
    sizes.push_back(r.bytes);
  }
  return sizes;
}

absl::StatusOr<std::unique_ptr<GpuMemory>> GpuMemory::Open(const GpuHandover& handover,
                                                           CudaIpc* ipc) {
  CKPT_RETURN_IF_ERROR(CheckGpuHandover(handover).status());
  std::unique_ptr<GpuMemory> m(new GpuMemory(ipc));  // closes what was opened on any return
  CKPT_ASSIGN_OR_RETURN(m->device_, ipc->FindDevice(handover.device_uuid));
  for (size_t i = 0; i < handover.regions.size(); ++i) {
    const GpuRegion& r = handover.regions[i];
    absl::StatusOr<char*> base = ipc->OpenMemHandle(m->device_, r.ipc_handle);
    if (!base.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu region ", i, ": cannot open its IPC handle: ", base.status().message()));
    }
    m->regions_.push_back(Region{*base, r.bytes});
    g_mappings.fetch_add(1, std::memory_order_relaxed);
    g_mapping_bytes.fetch_add(r.bytes, std::memory_order_relaxed);
    absl::StatusOr<uint64_t> real = ipc->AllocationSize(m->device_, *base);
    if (!real.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gpu region ", i, ": cannot read the allocation's range: ", real.status().message()));
    }
    if (*real < r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("gpu region ", i, " declares ", r.bytes,
                                                     " bytes but its allocation has ", *real));
    }
  }
  absl::StatusOr<void*> event = ipc->OpenEventHandle(m->device_, handover.step_event);
  if (!event.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu handover: cannot open the step event: ", event.status().message()));
  }
  m->event_ = *event;
  CKPT_ASSIGN_OR_RETURN(m->stream_, ipc->CreateStream(m->device_));
  return m;
}

GpuMemory::~GpuMemory() {
  if (stream_ != nullptr) {
    IgnoreError(ipc_->Synchronize(device_, stream_), "closing: a failed copy was reported already");
    ipc_->DestroyStream(device_, stream_);
  }
  if (event_ != nullptr) ipc_->DestroyEvent(device_, event_);
  for (const Region& r : regions_) {
    ipc_->CloseMemHandle(device_, r.base);
    g_mappings.fetch_sub(1, std::memory_order_relaxed);
    g_mapping_bytes.fetch_sub(r.bytes, std::memory_order_relaxed);
  }
}

absl::Status GpuMemory::CheckRange(const char* p, uint64_t n) const {
  for (const Region& r : regions_) {
    if (p >= r.base && n <= r.bytes && static_cast<uint64_t>(p - r.base) <= r.bytes - n) {
      return absl::OkStatus();
    }
  }
  return absl::InternalError("gpu copy outside every mapped region");
}

absl::Status GpuMemory::BeginSnapshot() {
  CKPT_RETURN_IF_ERROR(ipc_->StreamWaitEvent(device_, stream_, event_));
  // The drift kernel runs on its own stream: wait here until the trainer's
  // step has completed, so both it and the copies see that step.
  return ipc_->Synchronize(device_, stream_);
}

absl::Status GpuMemory::CopyOut(void* dst, const char* src, uint64_t n) {
  CKPT_RETURN_IF_ERROR(CheckRange(src, n));
  return ipc_->CopyToHostAsync(device_, stream_, dst, src, n);
}

absl::Status GpuMemory::FinishSnapshot() { return ipc_->Synchronize(device_, stream_); }

absl::Status GpuMemory::CopyIn(char* dst, const void* src, uint64_t n) {
  CKPT_RETURN_IF_ERROR(CheckRange(dst, n));
  return ipc_->CopyToDevice(device_, stream_, dst, src, n);
}

}  // namespace ckpt
