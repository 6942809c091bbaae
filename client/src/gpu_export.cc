#include "gpu_export.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "base/handover_wire.h"
#include "base/status.h"
#include "base/unique_fd.h"

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
  absl::StatusOr<bool> capable = driver_->LegacyIpcCapable(p);
  if (!capable.ok() || !*capable) {
    CKPT_ASSIGN_OR_RETURN(std::vector<Page> run, WalkPages(p, bytes, what));
    CKPT_RETURN_IF_ERROR(NoteDevice(*device));
    return AddToRun(p, std::move(run));
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
    if (regions_[i].pages.empty() && regions_[i].base == base) {
      return std::make_pair(static_cast<uint32_t>(i), p - base);
    }
  }
  Region r;
  r.base = base;
  r.size = size;
  absl::StatusOr<std::string> handle = driver_->IpcMemHandle(base);
  if (!handle.ok())
    return absl::Status(handle.status().code(),
                        absl::StrCat(what, ": ", handle.status().message()));
  r.handle = *std::move(handle);
  CKPT_RETURN_IF_ERROR(NoteDevice(*device));
  regions_.push_back(std::move(r));
  return std::make_pair(static_cast<uint32_t>(regions_.size() - 1), p - base);
}

absl::Status GpuExport::NoteDevice(int device) {
  if (device_ >= 0) return absl::OkStatus();
  CKPT_ASSIGN_OR_RETURN(uuid_, driver_->DeviceUuid(device));
  device_ = device;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GpuExport::Page>> GpuExport::WalkPages(uint64_t p, uint64_t bytes,
                                                                  const std::string& what) {
  if (bytes > UINT64_MAX - p) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", bytes, " bytes) wraps around"));
  }
  std::vector<Page> run;
  const uint64_t end = p + std::max<uint64_t>(bytes, 1);
  for (uint64_t addr = p; addr < end;) {
    absl::StatusOr<CudaDriver::Page> page = driver_->PageAt(addr);
    if (!page.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       " lives in an allocation that neither legacy CUDA IPC nor the virtual "
                       "memory management API can export: ",
                       page.status().message()));
    }
    if (addr < page->base || addr - page->base >= page->size) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the driver reports a page at ",
                                                     page->base, " of ", page->size,
                                                     " bytes that does not hold address ", addr));
    }
    if (!run.empty() && page->base != run.back().base + run.back().size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " (", bytes, " bytes) spans pages that are not contiguous"));
    }
    if (!page->posix_fd && !page->fabric) {
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          " lives in PyTorch expandable segments (PYTORCH_CUDA_ALLOC_CONF="
          "expandable_segments:True) whose pages allow no export to another process. "
          "PyTorch 2.10 and newer: leave TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC unset or 1, "
          "set before the first CUDA allocation; PyTorch 2.4 cannot export them "
          "(upgrade, or turn expandable_segments off)"));
    }
    run.push_back(Page{page->base, page->size, !page->posix_fd});
    addr = page->base + page->size;
  }
  return run;
}

std::pair<uint32_t, uint64_t> GpuExport::AddToRun(uint64_t p, std::vector<Page> run) {
  // A run that holds or ends right at the tensor's first page grows by the
  // tensor's later pages; its base, and so every offset into it, stays.
  for (size_t i = 0; i < regions_.size(); ++i) {
    Region& r = regions_[i];
    if (r.pages.empty() || run.front().base < r.base || run.front().base > r.base + r.size) {
      continue;
    }
    // The tensor's pages (contiguous: WalkPages) past the run's end must
    // start exactly there (the driver's page boundaries have not moved
    // since the run was walked); otherwise the tensor gets a run of its own.
    const uint64_t end = r.base + r.size;
    auto more = std::find_if(run.begin(), run.end(),
                             [end](const Page& page) { return page.base + page.size > end; });
    if (more != run.end() && more->base != end) continue;
    for (; more != run.end(); ++more) {
      r.pages.push_back(*more);
      r.size += more->size;
    }
    return {static_cast<uint32_t>(i), p - r.base};
  }
  Region r;
  r.base = run.front().base;
  for (const Page& page : run) r.size += page.size;
  r.pages = std::move(run);
  regions_.push_back(std::move(r));
  return {static_cast<uint32_t>(regions_.size() - 1), p - regions_.back().base};
}

absl::StatusOr<v1::GpuHandover> GpuExport::Handover(const SendFds& send) {
  if (regions_.empty()) return absl::FailedPreconditionError("no GPU tensors were added");
  if (event_handle_.empty()) {
    CKPT_ASSIGN_OR_RETURN(event_handle_, driver_->CreateStepEvent(device_));
  }
  v1::GpuHandover h;
  h.set_device_uuid(uuid_);
  for (const Region& r : regions_) {
    v1::GpuRegion* g = h.add_regions();
    if (r.pages.empty()) g->set_ipc_handle(r.handle);
    g->set_bytes(r.size);
  }
  h.set_step_event(event_handle_);
  CKPT_RETURN_IF_ERROR(ExportPages(send, &h));
  return h;
}

absl::Status GpuExport::ExportPages(const SendFds& send, v1::GpuHandover* h) {
  // Exported afresh at every handover (a re-registration after ckptd
  // restarted sends them again), each page once; descriptors are sent and
  // closed a batch at a time, so at most one batch is open here.
  std::map<uint64_t, v1::GpuPage> exported;  // by page address
  std::vector<UniqueFd> batch;
  uint32_t sent = 0;  // descriptors sent so far
  auto flush = [&]() -> absl::Status {
    if (batch.empty()) return absl::OkStatus();
    std::vector<int> fds;
    for (const UniqueFd& fd : batch) fds.push_back(fd.get());
    CKPT_ASSIGN_OR_RETURN(std::string token, send(fds));
    h->add_page_tokens(token);
    sent += static_cast<uint32_t>(batch.size());
    batch.clear();
    return absl::OkStatus();
  };
  for (size_t i = 0; i < regions_.size(); ++i) {
    for (const Page& page : regions_[i].pages) {
      auto it = exported.find(page.base);
      if (it == exported.end()) {
        CKPT_ASSIGN_OR_RETURN(v1::GpuPage g, ExportPage(i, page, sent + batch.size(), &batch));
        it = exported.emplace(page.base, std::move(g)).first;
        if (batch.size() == kMaxHandoverFds) CKPT_RETURN_IF_ERROR(flush());
      }
      *h->mutable_regions(static_cast<int>(i))->add_pages() = it->second;
    }
  }
  return flush();
}

absl::StatusOr<v1::GpuPage> GpuExport::ExportPage(size_t region, const Page& page, size_t index,
                                                  std::vector<UniqueFd>* batch) {
  v1::GpuPage g;
  g.set_bytes(page.size);
  auto failed = [region](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("gpu region ", region, ": ", s.message()));
  };
  if (page.fabric) {
    absl::StatusOr<std::string> fabric = driver_->ExportPageFabric(page.base);
    if (!fabric.ok()) return failed(fabric.status());
    g.set_fabric_handle(*fabric);
    return g;
  }
  absl::StatusOr<int> fd = driver_->ExportPageFd(page.base);
  if (!fd.ok()) return failed(fd.status());
  g.set_fd(static_cast<uint32_t>(index));
  batch->emplace_back(*fd);
  return g;
}

absl::Status GpuExport::RecordStep(void* stream) {
  if (event_handle_.empty()) return absl::FailedPreconditionError("not registered");
  return driver_->RecordStepEvent(stream);
}

}  // namespace ckpt::internal
