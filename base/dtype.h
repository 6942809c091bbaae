// The element types of a tensor: one table, the source of each type's name,
// number and size for the client and the daemon.
//
// An element type is described in several places, and each one either takes
// its values from this table or is checked against it:
//   - ckpt.v1.DType (proto/ckpt/v1/ckpt.proto), the API's enum, and
//     ckpt.store.DType (daemon/store/store.proto), the on-disk enum, both
//     DTYPE_<name> = number. The two protos are kept apart on purpose (what
//     is on disk must not change when the API does), but while both name a
//     type they give it this table's number, so converting between them and
//     DType is a cast (daemon/rpc/convert.cc, daemon/recovery/schema_convert.cc);
//   - DType below, the daemon's own type (daemon/common/tensor_types.h), and
//     ElementBytes(), from which the client's DTypeBytes() is made
//     (client/include/ckpt/client.h);
//   - the names a Python caller gives ("F32"), which python/ckpt_module.cc
//     parses as DTYPE_<name>;
//   - the drift kernels' drift::DType (kernels/drift.h), which keeps its own
//     numbering: the `drift_code` column, converted in one place
//     (daemon/engine/engine_layercheck.cc, which checks it at compile time).
// tests/base/dtype_test.cc walks both protos' enum descriptors and fails
// when a value there and a row here differ in name or number, when the
// client's sizes differ from the table's, or when the drift codes do not
// round-trip. A new type needs a row here and a value with the same name and
// number in both protos (and a drift code when the drift kernels read it).
//
// Header only and dependency free (base is shared by the client and the
// daemon, kernels/ may not include it); everything is constexpr.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>

namespace ckpt {

// The numbers are those of both protos. A value outside the list can reach
// the daemon from a request (proto enums are open); it has no row, so
// ElementBytes() returns 0 for it and validation refuses it.
enum class DType : int {
  kUnspecified = 0,  // no row: never valid in a tensor
  kF32 = 1,
  kF16 = 2,
  kBF16 = 3,
  kF64 = 4,
  kI64 = 5,
  kI32 = 6,
  kU8 = 7,
};

// drift_code of a type the drift kernels do not read.
inline constexpr int kNoDriftCode = -1;

struct DTypeInfo {
  DType dtype;
  std::string_view name;  // DTYPE_<name> in both protos; what Python passes
  uint64_t bytes;         // per element
  int drift_code;         // the value of kernels/drift.h's drift::DType, or kNoDriftCode
};

// One row per type, in the order of their numbers 1, 2, ... (checked below).
inline constexpr DTypeInfo kDTypeTable[] = {
    {DType::kF32, "F32", 4, 0},
    {DType::kF16, "F16", 2, 2},
    {DType::kBF16, "BF16", 2, 1},
    {DType::kF64, "F64", 8, kNoDriftCode},
    {DType::kI64, "I64", 8, kNoDriftCode},
    {DType::kI32, "I32", 4, kNoDriftCode},
    {DType::kU8, "U8", 1, kNoDriftCode},
};

// The highest number with a row; both protos' DType_MAX must equal it.
inline constexpr int kMaxDTypeNumber = static_cast<int>(std::size(kDTypeTable));

namespace dtype_internal {
constexpr bool RowsAreNumbered() {
  for (size_t i = 0; i < std::size(kDTypeTable); ++i) {
    if (static_cast<size_t>(kDTypeTable[i].dtype) != i + 1) return false;
  }
  return true;
}
}  // namespace dtype_internal
static_assert(dtype_internal::RowsAreNumbered(),
              "kDTypeTable must hold DType 1, 2, ... in order, one row each");

// The row of `dtype`; nullptr for kUnspecified and for a number without a row.
constexpr const DTypeInfo* FindDType(DType dtype) {
  const int n = static_cast<int>(dtype);
  return n >= 1 && n <= kMaxDTypeNumber ? &kDTypeTable[n - 1] : nullptr;
}

// Bytes per element; 0 for kUnspecified and for a number without a row.
constexpr uint64_t ElementBytes(DType dtype) {
  const DTypeInfo* info = FindDType(dtype);
  return info != nullptr ? info->bytes : 0;
}

// The drift kernels' code for `dtype`; kNoDriftCode when they do not read it.
constexpr int DriftCode(DType dtype) {
  const DTypeInfo* info = FindDType(dtype);
  return info != nullptr ? info->drift_code : kNoDriftCode;
}

}  // namespace ckpt
