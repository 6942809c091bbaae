// GpuExport: the trainer side of the GPU handover (internal to ckpt_client).
//
// For each registered tensor it finds the CUDA allocation that holds it,
// checks that the tensor lies inside it on the rank's one device, exports one
// legacy IPC handle per distinct allocation (every tensor inside it shares
// that region), and creates the interprocess step event that is recorded
// after every optimizer step.
//
// Memory of CUDA's virtual memory management API (PyTorch's expandable
// segments), which legacy IPC cannot export, is walked page by page: a
// region is then a run of pages contiguous in this process's address space
// (a tensor that starts inside or right after a run extends it; offsets are
// from the run's first page, so they never change). At each handover every
// distinct page is exported once, as a POSIX descriptor when the page allows
// it, else as a fabric handle; a page that allows neither is refused with
// what to set. The descriptors go to ckptd in batches of at most
// kMaxHandoverFds and are closed once sent.
//
// The CUDA calls are behind CudaDriver (cuda_driver.h), so everything here
// is tested with a fake.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/unique_fd.h"
#include "ckpt/v1/ckpt.pb.h"
#include "cuda_driver.h"

namespace ckpt::internal {

class GpuExport {
 public:
  // With the CUDA runtime's driver calls; UNIMPLEMENTED without CUDA.
  static absl::StatusOr<std::unique_ptr<GpuExport>> Create();
  explicit GpuExport(std::unique_ptr<CudaDriver> driver) : driver_(std::move(driver)) {}

  // Region index and offset of [ptr, ptr + bytes); INVALID_ARGUMENT naming
  // `name` when the range is not inside one exportable device allocation of
  // the device used so far.
  absl::StatusOr<std::pair<uint32_t, uint64_t>> Add(const void* ptr, uint64_t bytes,
                                                    const std::string& name);
  bool empty() const { return regions_.empty(); }
  // Hands a batch of page descriptors to ckptd; returns its token.
  using SendFds = std::function<absl::StatusOr<std::string>(absl::Span<const int>)>;
  // The handover for RegisterRequest.gpu (creates the step event once);
  // page descriptors, if any, go through `send`.
  absl::StatusOr<v1::GpuHandover> Handover(const SendFds& send);
  // Records the step event on `stream` (a cudaStream_t).
  absl::Status RecordStep(void* stream);

 private:
  struct Page {
    uint64_t base = 0;
    uint64_t size = 0;
    bool fabric = false;  // exported as a fabric handle (no POSIX descriptor allowed)
  };
  struct Region {
    uint64_t base = 0;
    uint64_t size = 0;
    std::string handle;       // cudaIpcMemHandle_t bytes
    std::vector<Page> pages;  // instead of handle: the run, in address order
  };
  // The rank's one device, noted with its UUID at the first tensor.
  absl::Status NoteDevice(int device);
  // The pages of [p, p + bytes), contiguous and each exportable.
  absl::StatusOr<std::vector<Page>> WalkPages(uint64_t p, uint64_t bytes, const std::string& what);
  // Places a tensor at `p` whose pages are `run` into a run region.
  std::pair<uint32_t, uint64_t> AddToRun(uint64_t p, std::vector<Page> run);
  // Fills `h`'s page regions, exporting each distinct page once.
  absl::Status ExportPages(const SendFds& send, v1::GpuHandover* h);
  // One page of region `region`: its fabric handle, or its descriptor
  // (appended to `batch`; `index` among all sent) and that index.
  absl::StatusOr<v1::GpuPage> ExportPage(size_t region, const Page& page, size_t index,
                                         std::vector<UniqueFd>* batch);
  std::unique_ptr<CudaDriver> driver_;
  int device_ = -1;
  std::string uuid_;
  std::vector<Region> regions_;
  std::string event_handle_;  // after the first Handover
};

}  // namespace ckpt::internal
