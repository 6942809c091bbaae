// A fake CudaIpc for the GPU tests (no GPU needed): "device memory" is host
// memory named by the id in a handle's first bytes, events and streams are
// flags the test sets, and every call is counted. Also the handovers and
// registrations the GPU tests send.
//
// Thread-safety: every method is thread-safe (the engine's threads call the
// CudaIpc methods while the test thread sets the flags).
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/engine/registration.h"
#include "daemon/gpu/cuda_ipc.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/rpc/convert.h"
#include "gtest/gtest.h"
#include "kernels/drift.h"

namespace ckpt {
namespace gpu_test {

inline constexpr char kUuid[] = "GPU-4f4ef90c-85c2-c43d-503a-f1f29e80b23c";
inline constexpr uint64_t kEventId = 999;  // the event every default handover names

inline std::string Handle(uint64_t id) {
  std::string h(kCudaIpcHandleBytes, '\0');
  std::memcpy(h.data(), &id, sizeof(id));
  return h;
}

class FakeCudaIpc final : public CudaIpc {
 public:
  FakeCudaIpc() { AddEvent(kEventId); }

  // Adds an allocation of `bytes` (the driver's view) under handle id `id`.
  char* Allocate(uint64_t id, uint64_t bytes) {
    absl::MutexLock lock(&mu_);
    auto& buf = allocations_[id];
    buf.assign(bytes, '\0');
    return buf.data();
  }
  // Adds an interprocess event under handle id `id`, complete.
  void AddEvent(uint64_t id) {
    absl::MutexLock lock(&mu_);
    events_[id] = true;
  }
  // Whether the latest record of event `id` has completed (the trainer's
  // step finished on its device); a never-completing event is a trainer hung
  // in a kernel.
  void SetEventDone(uint64_t id, bool done) {
    absl::MutexLock lock(&mu_);
    events_[id] = done;
  }
  // Event `id` is pending for its next `queries` queries, then complete.
  void SetEventPendingFor(uint64_t id, int queries) {
    absl::MutexLock lock(&mu_);
    events_[id] = false;
    pending_queries_[id] = queries;
  }
  // An illegal address in ckptd's context: from now on every call on the
  // device fails with a sticky error, as the CUDA runtime's do.
  void Poison() {
    absl::MutexLock lock(&mu_);
    poisoned_ = true;
  }
  // A trainer-supplied handle whose open fails with a code the seam
  // classifies sticky (cudaErrorUnknown, say) while ckptd's context is fine:
  // a forged or stale memory handle, or an event whose query fails so.
  void SetHandleSticky(uint64_t id) {
    absl::MutexLock lock(&mu_);
    sticky_handles_[id] = true;
  }
  void SetEventSticky(uint64_t id) {
    absl::MutexLock lock(&mu_);
    sticky_events_[id] = true;
  }
  // Makes the probe on ckptd's own resources fail with a sticky error too
  // (Poison() does as well).
  void SetProbeFails(bool fails) {
    absl::MutexLock lock(&mu_);
    probe_fails_ = fails;
  }
  // Times ProbeDevice was called.
  int probes() {
    absl::MutexLock lock(&mu_);
    return probes_;
  }
  // Whether ckptd's own streams have finished their copies (false: a dead or
  // wedged device).
  void SetStreamsDone(bool done) {
    absl::MutexLock lock(&mu_);
    streams_done_ = done;
  }

  // Bytes copied off the "device" so far.
  uint64_t bytes_to_host() const { return bytes_to_host_.load(); }
  int open_mappings() {
    absl::MutexLock lock(&mu_);
    return opens_ - closes_;
  }
  int opens() {
    absl::MutexLock lock(&mu_);
    return opens_;
  }
  // Times an event was found complete (once per snapshotted step).
  int event_waits() {
    absl::MutexLock lock(&mu_);
    return event_waits_;
  }
  int open_events() {
    absl::MutexLock lock(&mu_);
    return events_open_;
  }
  int open_streams() {
    absl::MutexLock lock(&mu_);
    return streams_open_;
  }

  absl::StatusOr<int> FindDevice(const std::string& uuid) override {
    if (uuid != kUuid) return absl::FailedPreconditionError("device not visible");
    return 0;
  }
  absl::StatusOr<char*> OpenMemHandle(int, const std::string& handle) override {
    uint64_t id = 0;
    std::memcpy(&id, handle.data(), sizeof(id));
    absl::MutexLock lock(&mu_);
    if (poisoned_) return Sticky("cudaIpcOpenMemHandle");
    if (sticky_handles_[id]) {
      return MarkStickyCudaError(absl::InternalError("cudaIpcOpenMemHandle: unknown error"));
    }
    auto it = allocations_.find(id);
    if (it == allocations_.end()) return absl::InternalError("invalid resource handle");
    ++opens_;
    return it->second.data();
  }
  absl::StatusOr<uint64_t> AllocationSize(int, const char* base) override {
    absl::MutexLock lock(&mu_);
    for (auto& [id, buf] : allocations_) {
      if (buf.data() == base) return buf.size();
    }
    return absl::InternalError("not an allocation");
  }
  void CloseMemHandle(int, char*) override {
    absl::MutexLock lock(&mu_);
    ++closes_;
  }
  absl::StatusOr<void*> OpenEventHandle(int, const std::string& handle) override {
    uint64_t id = 0;
    std::memcpy(&id, handle.data(), sizeof(id));
    absl::MutexLock lock(&mu_);
    if (handle != Handle(id) || events_.count(id) == 0) {
      return absl::InternalError("invalid event handle");
    }
    ++events_open_;
    return reinterpret_cast<void*>(static_cast<uintptr_t>(id));
  }
  void DestroyEvent(int, void*) override {
    absl::MutexLock lock(&mu_);
    --events_open_;
  }
  absl::StatusOr<void*> CreateStream(int) override {
    absl::MutexLock lock(&mu_);
    ++streams_open_;
    return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 + streams_open_));
  }
  void DestroyStream(int, void*) override {
    absl::MutexLock lock(&mu_);
    --streams_open_;
  }
  absl::StatusOr<bool> QueryEvent(int, void* event) override {
    absl::MutexLock lock(&mu_);
    if (poisoned_) return Sticky("cudaEventQuery");
    if (sticky_events_[reinterpret_cast<uintptr_t>(event)]) {
      return MarkStickyCudaError(absl::InternalError("cudaEventQuery: unknown error"));
    }
    const uint64_t id = reinterpret_cast<uintptr_t>(event);
    if (auto it = pending_queries_.find(id); it != pending_queries_.end() && it->second > 0) {
      if (--it->second == 0) events_[id] = true;
      return false;
    }
    const bool done = events_[id];
    if (done) ++event_waits_;
    return done;
  }
  absl::StatusOr<bool> QueryStream(int, void*) override {
    absl::MutexLock lock(&mu_);
    if (poisoned_) return Sticky("cudaStreamQuery");
    return streams_done_;
  }
  absl::Status CopyToHostAsync(int, void*, void* dst, const char* src, uint64_t n) override {
    if (fail_copies.load()) return absl::InternalError("cudaMemcpyAsync: an illegal memory access");
    {
      absl::MutexLock lock(&mu_);
      if (poisoned_) return Sticky("cudaMemcpyAsync (device to host)");
    }
    std::memcpy(dst, src, n);
    bytes_to_host_ += n;
    return absl::OkStatus();
  }
  absl::Status CopyToDeviceAsync(int, void*, char* dst, const void* src, uint64_t n) override {
    {
      absl::MutexLock lock(&mu_);
      if (poisoned_) return Sticky("cudaMemcpyAsync (host to device)");
    }
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status ProbeDevice(int) override {
    absl::MutexLock lock(&mu_);
    ++probes_;
    if (poisoned_ || probe_fails_) return Sticky("cudaMemsetAsync (probe)");
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<drift::DriftKernel>> MakeDriftKernel(int) override {
    return drift::MakeCpuDriftKernel(1);
  }

  // Pages of virtual-memory-management memory: a page is a memfd (its
  // "physical memory"). MapPages reserves an address range of the run's
  // size (an inaccessible anonymous mapping) and maps each page's memfd
  // into it in order, so ckptd's view of a page and the trainer's (the
  // test's own mapping of the memfd) are the same memory. A page whose
  // memfd is smaller than declared fails the map, as cuMemMap does.
  absl::StatusOr<char*> MapPages(int, const std::vector<Page>& pages) override {
    absl::MutexLock lock(&mu_);
    if (poisoned_) return Sticky("cuMemImportFromShareableHandle");
    uint64_t total = 0;
    for (const Page& p : pages) total += p.bytes;
    void* range =
        ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (range == MAP_FAILED) return absl::InternalError("cuMemAddressReserve: out of memory");
    char* base = static_cast<char*>(range);
    uint64_t off = 0;
    for (const Page& p : pages) {
      int fd = p.fd;
      if (fd < 0) {
        auto it = fabric_pages_.find(p.fabric_handle);
        fd = it == fabric_pages_.end() ? -1 : it->second;
      }
      struct stat st;
      if (fd < 0 || ::fstat(fd, &st) != 0) {
        ::munmap(base, total);
        return absl::InternalError("cuMemImportFromShareableHandle: invalid handle");
      }
      if (static_cast<uint64_t>(st.st_size) < p.bytes ||
          ::mmap(base + off, p.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
              MAP_FAILED) {
        ::munmap(base, total);
        return absl::InternalError("cuMemMap: invalid argument");
      }
      off += p.bytes;
    }
    runs_[base] = total;
    pages_mapped_ += pages.size();
    return base;
  }
  void UnmapPages(int, char* base) override {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(base);
    if (it == runs_.end()) return;
    ::munmap(base, it->second);
    runs_.erase(it);
  }
  // A page exported as a fabric handle (`handle`, 64 bytes) instead of a
  // descriptor; `fd` stays the test's.
  void AddFabricPage(const std::string& handle, int fd) {
    absl::MutexLock lock(&mu_);
    fabric_pages_[handle] = fd;
  }
  // Reserved ranges mapped now, and pages mapped in all.
  int open_runs() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(runs_.size());
  }
  int pages_mapped() {
    absl::MutexLock lock(&mu_);
    return pages_mapped_;
  }

  std::atomic<bool> fail_copies{false};

 private:
  static absl::Status Sticky(const char* what) {
    return MarkStickyCudaError(
        absl::InternalError(absl::StrCat(what, ": an illegal memory access was encountered")));
  }

  absl::Mutex mu_;
  bool poisoned_ ABSL_GUARDED_BY(mu_) = false;
  bool probe_fails_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> bytes_to_host_{0};
  int probes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, bool> sticky_handles_ ABSL_GUARDED_BY(mu_);  // memory handle ids
  std::map<uint64_t, bool> sticky_events_ ABSL_GUARDED_BY(mu_);   // event ids
  std::map<uint64_t, int> pending_queries_ ABSL_GUARDED_BY(mu_);  // event id -> queries left
  std::map<uint64_t, std::vector<char>> allocations_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, bool> events_ ABSL_GUARDED_BY(mu_);  // id -> latest record complete
  bool streams_done_ ABSL_GUARDED_BY(mu_) = true;
  int opens_ ABSL_GUARDED_BY(mu_) = 0;
  int closes_ ABSL_GUARDED_BY(mu_) = 0;
  int event_waits_ ABSL_GUARDED_BY(mu_) = 0;
  int events_open_ ABSL_GUARDED_BY(mu_) = 0;
  int streams_open_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<char*, uint64_t> runs_ ABSL_GUARDED_BY(mu_);  // reserved base -> size
  std::map<std::string, int> fabric_pages_ ABSL_GUARDED_BY(mu_);
  int pages_mapped_ ABSL_GUARDED_BY(mu_) = 0;
};

// A handover of two allocations (handle ids `first_id` and `first_id + 1`)
// and the event `event_id`.
inline v1::GpuHandover TwoRegions(uint64_t bytes0 = 4096, uint64_t bytes1 = 8192,
                                  uint64_t first_id = 1, uint64_t event_id = kEventId) {
  v1::GpuHandover h;
  h.set_device_uuid(kUuid);
  v1::GpuRegion* r = h.add_regions();
  r->set_ipc_handle(Handle(first_id));
  r->set_bytes(bytes0);
  r = h.add_regions();
  r->set_ipc_handle(Handle(first_id + 1));
  r->set_bytes(bytes1);
  h.set_step_event(Handle(event_id));
  return h;
}

// The engine's registration of a request, converted as the gRPC handler does.
inline Registration Reg(const v1::RegisterRequest& req) {
  absl::StatusOr<Registration> r = RegistrationOf(req);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : Registration{};
}

inline constexpr uint64_t kFloats = 256;  // per layer
inline constexpr uint32_t kLayers = 3;

// Layers 0 and 1 share the first allocation (at offsets 0 and kFloats*4);
// layer 2 is alone in the second.
inline v1::RegisterRequest GpuRequest(const std::string& job, uint64_t first_id = 1,
                                      uint64_t event_id = kEventId) {
  v1::RegisterRequest req;
  req.set_job_id(job);
  req.set_world_size(1);
  req.mutable_policy()->set_kind(v1::POLICY_ALL);
  *req.mutable_gpu() = TwoRegions(2 * kFloats * 4, kFloats * 4, first_id, event_id);
  for (uint32_t l = 0; l < kLayers; ++l) {
    v1::LayerSpec* layer = req.add_layers();
    layer->set_id(l);
    layer->set_name(absl::StrCat("layer", l));
    v1::TensorSpec* t = layer->add_tensors();
    t->set_name("w");
    t->set_dtype(v1::DTYPE_F32);
    t->add_shape(kFloats);
    t->set_nbytes(kFloats * 4);
    t->set_region(l < 2 ? 0 : 1);
    t->set_offset(l == 1 ? kFloats * 4 : 0);
  }
  return req;
}

// Allocations 1 (4096 bytes, returned in *first) and 2 (8192 bytes), opened
// as TwoRegions() with `options`.
inline absl::StatusOr<std::unique_ptr<GpuMemory>> OpenTwo(FakeCudaIpc* ipc,
                                                          GpuMemoryOptions options,
                                                          char** first = nullptr) {
  char* a = ipc->Allocate(1, 4096);
  if (first != nullptr) *first = a;
  ipc->Allocate(2, 8192);
  return GpuMemory::Open(GpuHandoverOf(TwoRegions()), {}, ipc, options);
}

// `s` refuses with the poisoned device's reason: FAILED_PRECONDITION naming
// the GPU and the restart that recovers it.
inline void ExpectPoisonReason(const absl::Status& s) {
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(s.message()).find(kUuid), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("restart ckptd"), std::string::npos) << s;
}

inline float Value(uint32_t layer, uint64_t i, uint64_t step) {
  return static_cast<float>(layer * 100000 + i * 3 + step * 7);
}

// The three layers of a rank registered with GpuRequest(job, first_id), in
// `ipc`'s fake device memory, filled with and compared against Value().
struct GpuLayers {
  char* layer[kLayers] = {};

  void Allocate(FakeCudaIpc* ipc, uint64_t first_id) {
    layer[0] = ipc->Allocate(first_id, 2 * kFloats * 4);
    layer[1] = layer[0] + kFloats * 4;
    layer[2] = ipc->Allocate(first_id + 1, kFloats * 4);
  }
  void Fill(uint64_t step) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto* f = reinterpret_cast<float*>(layer[l]);
      for (uint64_t i = 0; i < kFloats; ++i) f[i] = Value(l, i, step);
    }
  }
  bool Holds(uint64_t step) const {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto* f = reinterpret_cast<const float*>(layer[l]);
      for (uint64_t i = 0; i < kFloats; ++i) {
        if (f[i] != Value(l, i, step)) return false;
      }
    }
    return true;
  }
};

}  // namespace gpu_test
}  // namespace ckpt
