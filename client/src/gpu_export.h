// GpuExport: the trainer side of the GPU handover (internal to ckpt_client).
//
// For each registered tensor it finds the CUDA allocation that holds it,
// checks that the tensor lies inside it on the rank's one device, exports one
// legacy IPC handle per distinct allocation (every tensor inside it shares
// that region), and creates the interprocess step event that is recorded
// after every optimizer step. The CUDA calls are behind CudaDriver
// (cuda_driver.h), so everything here is tested with a fake.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
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
  // The handover for RegisterRequest.gpu (creates the step event once).
  absl::StatusOr<v1::GpuHandover> Handover();
  // Records the step event on `stream` (a cudaStream_t).
  absl::Status RecordStep(void* stream);

 private:
  struct Region {
    uint64_t base = 0;
    uint64_t size = 0;
    std::string handle;  // cudaIpcMemHandle_t bytes
  };
  std::unique_ptr<CudaDriver> driver_;
  int device_ = -1;
  std::string uuid_;
  std::vector<Region> regions_;
  std::string event_handle_;  // after the first Handover
};

}  // namespace ckpt::internal
