#include "gpu_export.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt::internal {

absl::StatusOr<std::unique_ptr<GpuExport>> GpuExport::Create() {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CudaDriver> driver, MakeCudaDriver());
  return std::make_unique<GpuExport>(std::move(driver));
}

absl::StatusOr<std::pair<uint32_t, uint64_t>> GpuExport::Add(const void* ptr, uint64_t bytes,
                                                             const std::string& name) {
  const std::string what = absl::StrCat("tensor '", name, "'");
  const auto p = reinterpret_cast<uint64_t>(ptr);
  absl::StatusOr<int> device = driver_->DeviceOf(p);
  if (!device.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not in CUDA device memory"));
  }
  if (device_ >= 0 && *device != device_) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is on device ", *device, "; this rank's other tensors are on device ", device_));
  }
  absl::StatusOr<CudaDriver::Range> range = driver_->AllocationRange(p);
  if (!range.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", range.status().message()));
  }
  const uint64_t base = range->base, size = range->size;
  if (p < base || bytes > size || p - base > size - bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " (", bytes, " bytes) runs past the end of its allocation"));
  }
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (regions_[i].base == base) return std::make_pair(static_cast<uint32_t>(i), p - base);
  }
  absl::StatusOr<bool> capable = driver_->LegacyIpcCapable(p);
  if (!capable.ok() || !*capable) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        " lives in an allocation that legacy CUDA IPC cannot export (virtual memory "
        "management, e.g. PyTorch expandable_segments:True); allocate it with cudaMalloc"));
  }
  Region r;
  r.base = base;
  r.size = size;
  absl::StatusOr<std::string> handle = driver_->IpcMemHandle(base);
  if (!handle.ok())
    return absl::Status(handle.status().code(),
                        absl::StrCat(what, ": ", handle.status().message()));
  r.handle = *std::move(handle);
  if (device_ < 0) {
    CKPT_ASSIGN_OR_RETURN(uuid_, driver_->DeviceUuid(*device));
    device_ = *device;
  }
  regions_.push_back(std::move(r));
  return std::make_pair(static_cast<uint32_t>(regions_.size() - 1), p - base);
}

absl::StatusOr<v1::GpuHandover> GpuExport::Handover() {
  if (regions_.empty()) return absl::FailedPreconditionError("no GPU tensors were added");
  if (event_handle_.empty()) {
    CKPT_ASSIGN_OR_RETURN(event_handle_, driver_->CreateStepEvent(device_));
  }
  v1::GpuHandover h;
  h.set_device_uuid(uuid_);
  for (const Region& r : regions_) {
    v1::GpuRegion* g = h.add_regions();
    g->set_ipc_handle(r.handle);
    g->set_bytes(r.size);
  }
  h.set_step_event(event_handle_);
  return h;
}

absl::Status GpuExport::RecordStep(void* stream) {
  if (event_handle_.empty()) return absl::FailedPreconditionError("not registered");
  return driver_->RecordStepEvent(stream);
}

}  // namespace ckpt::internal
