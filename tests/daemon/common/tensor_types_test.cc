// The daemon's TensorRole and LayerKind tables (daemon/common/tensor_types.h)
// against the API's and the store's enums: each test fails when a value
// there is missing, extra, or named or numbered differently from the table.
// (DType is base/dtype.h's and is checked by tests/base/dtype_test.cc.)
#include "daemon/common/tensor_types.h"

#include <string>
#include <vector>

#include "ckpt/v1/ckpt.pb.h"
#include "daemon/store/store.pb.h"
#include "gtest/gtest.h"
#include "tests/lib/enum_table_check.h"

namespace ckpt {
namespace {

using ::ckpt::testing::EnumRow;
using ::ckpt::testing::ExpectEnumIsTable;

std::vector<EnumRow> RoleRows() {
  std::vector<EnumRow> rows;
  for (const TensorRoleName& row : kTensorRoleTable) {
    rows.push_back({static_cast<int>(row.role), std::string(row.name)});
  }
  return rows;
}

std::vector<EnumRow> KindRows() {
  std::vector<EnumRow> rows;
  for (const LayerKindName& row : kLayerKindTable) {
    rows.push_back({static_cast<int>(row.kind), std::string(row.name)});
  }
  return rows;
}

TEST(TensorRoleTableTest, ApiEnumHasTheTablesNamesAndNumbers) {
  ExpectEnumIsTable(v1::TensorRole_descriptor(), "ROLE_", "ROLE_UNSPECIFIED", RoleRows());
}

TEST(TensorRoleTableTest, StoreEnumHasTheTablesNamesAndNumbers) {
  ExpectEnumIsTable(store::TensorRole_descriptor(), "ROLE_", "ROLE_UNSPECIFIED", RoleRows());
}

TEST(LayerKindTableTest, ApiEnumHasTheTablesNamesAndNumbers) {
  ExpectEnumIsTable(v1::LayerKind_descriptor(), "LAYER_", "LAYER_KIND_UNSPECIFIED", KindRows());
}

TEST(LayerKindTableTest, StoreEnumHasTheTablesNamesAndNumbers) {
  ExpectEnumIsTable(store::LayerKind_descriptor(), "LAYER_", "LAYER_KIND_UNSPECIFIED", KindRows());
}

}  // namespace
}  // namespace ckpt
