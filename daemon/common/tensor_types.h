// The daemon's own names for what a trainer describes: element types (DType,
// from the shared table in base/dtype.h), the role a tensor plays for its
// optimizer, and the kind of a layer. The engine, the policies and the
// store's converters use these; the public API's enums (ckpt.v1) and the
// store's on-disk enums (ckpt.store) are converted to and from them in one
// place each (daemon/rpc/convert.cc, daemon/recovery/schema_convert.cc).
//
// Like DType, TensorRole and LayerKind carry the numbers of both protos, and
// their tables below give each value's name there (ROLE_<name>,
// LAYER_<name>), so each converter is a cast. The converters check the
// highest number at compile time; tests/daemon/common/tensor_types_test.cc
// walks both protos' enum descriptors and fails when a name or a number
// there differs from a table here.
//
// A value outside the listed ones can reach the daemon from a request (proto
// enums are open); it has no row, ElementBytes() returns 0 for a DType, and
// validation refuses it.
#pragma once

#include <cstdint>
#include <iterator>
#include <string_view>

#include "base/dtype.h"  // DType, ElementBytes

namespace ckpt {

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

// The proto name of each value but kUnspecified, in the order of their
// numbers 1, 2, ... (checked below): ROLE_<name> and LAYER_<name>.
struct TensorRoleName {
  TensorRole role;
  std::string_view name;
};
inline constexpr TensorRoleName kTensorRoleTable[] = {
    {TensorRole::kParam, "PARAM"},       {TensorRole::kMaster, "MASTER"},
    {TensorRole::kExpAvg, "EXP_AVG"},    {TensorRole::kExpAvgSq, "EXP_AVG_SQ"},
    {TensorRole::kMomentum, "MOMENTUM"}, {TensorRole::kOther, "OTHER"},
};

struct LayerKindName {
  LayerKind kind;
  std::string_view name;
};
inline constexpr LayerKindName kLayerKindTable[] = {
    {LayerKind::kEmbedding, "EMBEDDING"}, {LayerKind::kBlock, "BLOCK"}, {LayerKind::kNorm, "NORM"},
    {LayerKind::kHead, "HEAD"},           {LayerKind::kOther, "OTHER"},
};

// The highest numbers with a row; both protos' TensorRole_MAX and
// LayerKind_MAX must equal them.
inline constexpr int kMaxTensorRoleNumber = static_cast<int>(std::size(kTensorRoleTable));
inline constexpr int kMaxLayerKindNumber = static_cast<int>(std::size(kLayerKindTable));

namespace tensor_types_internal {
template <typename Row, size_t N, typename Value>
constexpr bool RowsAreNumbered(const Row (&table)[N], Value Row::*value) {
  for (size_t i = 0; i < N; ++i) {
    if (static_cast<size_t>(table[i].*value) != i + 1) return false;
  }
  return true;
}
}  // namespace tensor_types_internal
static_assert(tensor_types_internal::RowsAreNumbered(kTensorRoleTable, &TensorRoleName::role),
              "kTensorRoleTable must hold TensorRole 1, 2, ... in order, one row each");
static_assert(tensor_types_internal::RowsAreNumbered(kLayerKindTable, &LayerKindName::kind),
              "kLayerKindTable must hold LayerKind 1, 2, ... in order, one row each");

// The optimizer step counter of one parameter group.
struct GroupStep {
  uint32_t group = 0;
  uint64_t step = 0;
};

}  // namespace ckpt
