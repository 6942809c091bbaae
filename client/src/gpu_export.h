// GpuExport: the trainer side of the GPU handover (internal to ckpt_client).
//
// For each registered tensor it finds the CUDA allocation that holds it
// (cuMemGetAddressRange, reached through the runtime's driver entry points:
// linking libcuda would make every binary unstartable without a driver),
// exports one legacy IPC handle per distinct allocation, and creates the
// interprocess step event that is recorded after every optimizer step.
//
// Built without CUDA, Create() returns UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/v1/ckpt.pb.h"

namespace ckpt::internal {

class GpuExport {
 public:
  static absl::StatusOr<std::unique_ptr<GpuExport>> Create();
  virtual ~GpuExport() = default;

  // Region index and offset of [ptr, ptr + bytes); INVALID_ARGUMENT naming
  // `name` when the range is not inside one exportable device allocation of
  // the device used so far.
  virtual absl::StatusOr<std::pair<uint32_t, uint64_t>> Add(const void* ptr, uint64_t bytes,
                                                            const std::string& name) = 0;
  virtual bool empty() const = 0;
  // The handover for RegisterRequest.gpu (creates the step event once).
  virtual absl::StatusOr<v1::GpuHandover> Handover() = 0;
  // Records the step event on `stream` (a cudaStream_t).
  virtual absl::Status RecordStep(void* stream) = 0;
};

}  // namespace ckpt::internal
