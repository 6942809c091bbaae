// The daemon's own names for what a trainer describes: element types, the
// role a tensor plays for its optimizer, and the kind of a layer. The engine,
// the policies and the store's converters use these; the public API's enums
// (ckpt.v1) and the store's on-disk enums (ckpt.store) are converted to and
// from them in one place each (daemon/rpc/convert.cc,
// daemon/recovery/schema_convert.cc). Values carry the same numbers as both
// protos; the converters check that at compile time.
//
// A value outside the listed ones can reach the daemon from a request (proto
// enums are open); ElementBytes() returns 0 for it and validation refuses it.
#pragma once

#include <cstdint>

namespace ckpt {

enum class DType : int {
  kUnspecified = 0,
  kF32 = 1,
  kF16 = 2,
  kBF16 = 3,
  kF64 = 4,
  kI64 = 5,
  kI32 = 6,
  kU8 = 7,
};

enum class TensorRole : int {
  kUnspecified = 0,
  kParam = 1,
  kMaster = 2,
  kExpAvg = 3,
  kExpAvgSq = 4,
  kMomentum = 5,
  kOther = 6,
};

enum class LayerKind : int {
  kUnspecified = 0,
  kEmbedding = 1,
  kBlock = 2,
  kNorm = 3,
  kHead = 4,
  kOther = 5,
};

// The optimizer step counter of one parameter group.
struct GroupStep {
  uint32_t group = 0;
  uint64_t step = 0;
};

// Bytes per element; 0 for kUnspecified or a value outside the list.
constexpr uint64_t ElementBytes(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
    default:
      return 0;
  }
}

}  // namespace ckpt
