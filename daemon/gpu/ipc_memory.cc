#include "daemon/gpu/ipc_memory.h"

#include <algorithm>
#include <atomic>

#include "absl/base/const_init.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/region.h"
#include "base/status.h"

namespace ckpt {
namespace {

std::atomic<uint64_t> g_mappings{0};
std::atomic<uint64_t> g_mapping_bytes{0};
std::atomic<uint64_t> g_leaked_mappings{0};
// What leaked mappings' copies may still read or write (staging leases):
// never given back, never destroyed.
absl::Mutex g_leaked_held_mu(absl::kConstInit);
std::vector<std::shared_ptr<const void>>* g_leaked_held ABSL_GUARDED_BY(g_leaked_held_mu) = nullptr;

// Polls between 20 us and 1 ms apart: a D2H copy of a layer takes about as
// long as the first pause, a whole step's copies many of the last.
constexpr absl::Duration kFirstPoll = absl::Microseconds(20);
constexpr absl::Duration kLongestPoll = absl::Milliseconds(1);

}  // namespace

GpuMappingStats OpenGpuMappings() {
  return GpuMappingStats{g_mappings.load(std::memory_order_relaxed),
                         g_mapping_bytes.load(std::memory_order_relaxed),
                         g_leaked_mappings.load(std::memory_order_relaxed)};
}

namespace {

// A region of pages: no legacy handle, each page's handle well formed, its
// size in range, and the sizes adding up to the region's. `pages` counts the
// handover's pages so far.
absl::Status CheckGpuPages(size_t i, const GpuRegion& r, size_t page_fds, bool fabric_handles,
                           size_t* pages) {
  if (!r.ipc_handle.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu region ", i, " carries both an ipc_handle and pages"));
  }
  *pages += r.pages.size();
  if (*pages > kMaxGpuPages) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu handover: more than ", kMaxGpuPages, " pages"));
  }
  uint64_t sum = 0;
  for (size_t j = 0; j < r.pages.size(); ++j) {
    const GpuPage& p = r.pages[j];
    auto bad = [&](auto&&... why) {
      return absl::InvalidArgumentError(absl::StrCat("gpu region ", i, " page ", j, why...));
    };
    if (p.fabric_handle.empty() && p.fd >= page_fds) {
      return bad(" names descriptor ", p.fd, " of ", page_fds, " handed over");
    }
    if (!p.fabric_handle.empty() && !fabric_handles) {
      return bad(
          " is a fabric handle; this ckptd takes them only with gpu_fabric_handles = "
          "true (importing one needs an IMEX channel: docs/protocol.md). Pages that "
          "allow POSIX descriptors are handed over as those");
    }
    if (!p.fabric_handle.empty() && p.fabric_handle.size() != kCudaIpcHandleBytes) {
      return bad(": fabric_handle is ", p.fabric_handle.size(), " bytes, not a ",
                 kCudaIpcHandleBytes, "-byte CUmemFabricHandle");
    }
    if (p.bytes == 0 || p.bytes > kMaxRegionBytes - sum) {
      return bad(": size ", p.bytes, " out of range");
    }
    sum += p.bytes;
  }
  if (sum != r.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("gpu region ", i, ": its pages add up to ", sum,
                                                   " bytes, the region declares ", r.bytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<uint64_t>> CheckGpuHandover(const GpuHandover& handover, size_t page_fds,
                                                       bool fabric_handles) {
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
  size_t pages = 0;
  for (size_t i = 0; i < handover.regions.size(); ++i) {
    const GpuRegion& r = handover.regions[i];
    if (!r.pages.empty()) {
      CKPT_RETURN_IF_ERROR(CheckGpuPages(i, r, page_fds, fabric_handles, &pages));
      sizes.push_back(r.bytes);
      continue;
    }
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
      if (handover.regions[j].pages.empty() && handover.regions[j].ipc_handle == r.ipc_handle) {
        return absl::InvalidArgumentError(
            absl::StrCat("gpu regions ", j, " and ", i, " carry the same ipc_handle"));
      }
    }
    sizes.push_back(r.bytes);
  }
  return sizes;
}

absl::StatusOr<std::unique_ptr<GpuMemory>> GpuMemory::Open(const GpuHandover& handover,
                                                           std::vector<UniqueFd> page_fds,
                                                           CudaIpc* ipc, GpuMemoryOptions options) {
  CKPT_RETURN_IF_ERROR(
      CheckGpuHandover(handover, page_fds.size(), options.fabric_handles).status());
  // Closes what was opened on any return.
  std::unique_ptr<GpuMemory> m(new GpuMemory(ipc, options));
  CKPT_ASSIGN_OR_RETURN(m->device_, ipc->FindDevice(handover.device_uuid));
  m->uuid_ = handover.device_uuid;
  if (options.health != nullptr) CKPT_RETURN_IF_ERROR(options.health->CheckUsable(m->device_));
  for (size_t i = 0; i < handover.regions.size(); ++i) {
    CKPT_RETURN_IF_ERROR(m->OpenRegion(i, handover.regions[i], &page_fds));
  }
  absl::StatusOr<void*> event = ipc->OpenEventHandle(m->device_, handover.step_event);
  m->NoteSticky(event.status());
  if (!event.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu handover: cannot open the step event: ", event.status().message()));
  }
  m->event_ = *event;
  absl::StatusOr<void*> stream = ipc->CreateStream(m->device_);
  CKPT_RETURN_IF_ERROR(m->Note(stream.status()));
  m->stream_ = *stream;
  return m;
}

absl::Status GpuMemory::OpenRegion(size_t i, const GpuRegion& r, std::vector<UniqueFd>* page_fds) {
  absl::StatusOr<char*> base;
  if (r.pages.empty()) {
    base = ipc_->OpenMemHandle(device_, r.ipc_handle);
  } else {
    // One reserved range per run, exactly the run's size.
    std::vector<CudaIpc::Page> pages;
    pages.reserve(r.pages.size());
    for (const GpuPage& p : r.pages) {
      pages.push_back(CudaIpc::Page{p.fabric_handle.empty() ? (*page_fds)[p.fd].get() : -1,
                                    p.fabric_handle, p.bytes});
    }
    base = ipc_->MapPages(device_, pages);
  }
  NoteSticky(base.status());
  if (!base.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu region ", i, ": cannot ",
                     r.pages.empty() ? "open its IPC handle: "
                                     : absl::StrCat("map its ", r.pages.size(), " pages: "),
                     base.status().message()));
  }
  regions_.push_back(Region{*base, r.bytes, /*pages=*/!r.pages.empty()});
  g_mappings.fetch_add(1, std::memory_order_relaxed);
  g_mapping_bytes.fetch_add(r.bytes, std::memory_order_relaxed);
  if (!r.pages.empty()) return absl::OkStatus();  // a page smaller than declared failed its map
  absl::StatusOr<uint64_t> real = ipc_->AllocationSize(device_, *base);
  NoteSticky(real.status());
  if (!real.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu region ", i, ": cannot read the allocation's range: ", real.status().message()));
  }
  if (*real < r.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("gpu region ", i, " declares ", r.bytes,
                                                   " bytes but its allocation has ", *real));
  }
  return absl::OkStatus();
}

void GpuMemory::NoteSticky(const absl::Status& s) {
  if (options_.health == nullptr || !IsStickyCudaError(s)) return;
  // The code alone proves nothing: a call on the trainer's handles (its
  // memory or event handle, its event) returns such codes for a bad handle
  // too, and the device is shared with other tenants. Only a probe on
  // ckptd's own resources that fails sticky too poisons it.
  const absl::Status probe = ipc_->ProbeDevice(device_);
  if (!IsStickyCudaError(probe)) {
    CKPT_LOG(WARNING) << "gpu device " << device_ << ": " << s.message()
                      << "; a probe on ckptd's own resources "
                      << (probe.ok() ? std::string("succeeded")
                                     : absl::StrCat("failed (", probe.message(), ")"))
                      << ", so the device is not marked poisoned (only this call fails)";
    return;
  }
  options_.health->MarkPoisoned(device_, uuid_, s);
}

void GpuMemory::HoldUntilCopiesLand(std::shared_ptr<const void> keep) {
  absl::MutexLock lock(&held_mu_);
  held_.push_back(std::move(keep));
}

void GpuMemory::CopiesLanded() {
  in_flight_ = wedged_ = false;
  std::vector<std::shared_ptr<const void>> back;
  {
    absl::MutexLock lock(&held_mu_);
    back.swap(held_);
  }
  // Dropped here, outside the lock (a lease goes back to its pool).
}

GpuMemory::~GpuMemory() {
  if (stream_ != nullptr) {
    // Only ckptd's own copies are on the stream. After a copy deadline the
    // device is asked once more (a zero timeout), not waited for.
    const absl::Status idle = WaitForStream(wedged_ ? absl::ZeroDuration() : options_.close_timeout,
                                            "closing", /*cancellable=*/false);
    if (!idle.ok()) {
      CKPT_LOG(ERROR) << "gpu device " << device_ << ": ckptd's copies have not completed ("
                      << idle.message() << "); leaving its " << regions_.size()
                      << " IPC mappings, event and stream open rather than closing them "
                      << "under the device (restart ckptd to release them)";
      g_mappings.fetch_sub(regions_.size(), std::memory_order_relaxed);
      for (const Region& r : regions_)
        g_mapping_bytes.fetch_sub(r.bytes, std::memory_order_relaxed);
      g_leaked_mappings.fetch_add(regions_.size(), std::memory_order_relaxed);
      // The staging they may still write into or read from leaks with them.
      absl::MutexLock held_lock(&held_mu_);
      if (!held_.empty()) {
        absl::MutexLock lock(&g_leaked_held_mu);
        if (g_leaked_held == nullptr) g_leaked_held = new std::vector<std::shared_ptr<const void>>;
        for (auto& h : held_) g_leaked_held->push_back(std::move(h));
        held_.clear();
      }
      return;
    }
    ipc_->DestroyStream(device_, stream_);
  }
  if (event_ != nullptr) ipc_->DestroyEvent(device_, event_);
  for (const Region& r : regions_) {
    if (r.pages) {
      ipc_->UnmapPages(device_, r.base);
    } else {
      ipc_->CloseMemHandle(device_, r.base);
    }
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

absl::Status GpuMemory::WaitForStream(absl::Duration timeout, const char* what, bool cancellable) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = kFirstPoll;
  for (;;) {
    absl::StatusOr<bool> idle = ipc_->QueryStream(device_, stream_);
    if (!idle.ok()) return Note(idle.status());  // a failed copy: in_flight_ stays
    if (*idle) {
      CopiesLanded();
      return absl::OkStatus();
    }
    if (cancellable && options_.cancel != nullptr &&
        options_.cancel->load(std::memory_order_relaxed)) {
      in_flight_ = true;
      return absl::CancelledError(absl::StrCat(what, ": ckptd is stopping"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      in_flight_ = wedged_ = true;
      return absl::DeadlineExceededError(absl::StrCat(what, ": gpu device ", device_,
                                                      " did not finish ckptd's copies within ",
                                                      absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, kLongestPoll);
  }
}

absl::StatusOr<bool> GpuMemory::StepReady() {
  if (options_.health != nullptr) CKPT_RETURN_IF_ERROR(options_.health->CheckUsable(device_));
  if (in_flight_) {
    // Copies that missed their deadline may still land in staging memory:
    // start none until they are seen complete.
    absl::StatusOr<bool> idle = ipc_->QueryStream(device_, stream_);
    if (!idle.ok()) return Note(idle.status());
    if (!*idle) {
      return absl::UnavailableError(absl::StrCat(
          "gpu device ", device_, " has not finished the copies of an earlier snapshot"));
    }
    CopiesLanded();
  }
  absl::StatusOr<bool> done = ipc_->QueryEvent(device_, event_);
  CKPT_RETURN_IF_ERROR(Note(done.status()));
  step_ready_ = *done;
  return step_ready_;
}

absl::Status GpuMemory::BeginSnapshot() {
  if (!step_ready_) {
    return absl::FailedPreconditionError("the trainer's step event has not completed");
  }
  return absl::OkStatus();
}

absl::Status GpuMemory::CopyOut(void* dst, const char* src, uint64_t n) {
  CKPT_RETURN_IF_ERROR(CheckRange(src, n));
  in_flight_ = true;
  return Note(ipc_->CopyToHostAsync(device_, stream_, dst, src, n));
}

absl::Status GpuMemory::FinishSnapshot() {
  step_ready_ = false;
  return WaitForStream(options_.copy_timeout, "snapshot", /*cancellable=*/true);
}

absl::Status GpuMemory::CopyIn(char* dst, const void* src, uint64_t n) {
  CKPT_RETURN_IF_ERROR(CheckRange(dst, n));
  in_flight_ = true;
  CKPT_RETURN_IF_ERROR(Note(ipc_->CopyToDeviceAsync(device_, stream_, dst, src, n)));
  return WaitForStream(options_.copy_timeout, "restore", /*cancellable=*/true);
}

}  // namespace ckpt
