// Validation of a Register request before anything is mapped.
//
// Checks, each failing with INVALID_ARGUMENT and a message naming the layer or
// tensor: job id syntax; rank < world_size; 1..max_layers layers numbered
// 0..N-1 with unique names; 1..max_tensors tensors per layer with unique,
// non-empty names; a known dtype; nbytes == prod(shape) * sizeof(dtype) and
// > 0; region index in range; [offset, offset+nbytes) inside the region's real
// size (from fstat, not from the request); no two tensors overlapping; each
// layer's file image no larger than the staging pool.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "ckpt/v1/ckpt.pb.h"
#include "ckpt/v1/dtype.h"

namespace ckpt {

struct RegistrationLimits {
  uint32_t max_layers = 1 << 16;
  uint32_t max_tensors_per_layer = 4096;
  uint32_t max_world_size = 1 << 20;
  uint64_t max_layer_file_bytes = 0;  // the staging pool budget
};

absl::Status ValidateRegistration(const v1::RegisterRequest& req,
                                  const std::vector<uint64_t>& region_sizes,
                                  const RegistrationLimits& limits);

}  // namespace ckpt
