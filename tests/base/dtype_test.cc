// The element-type table (base/dtype.h) against every other description of
// an element type: the API's and the store's enums, the sizes C++ gives the
// values each type holds, the client's DTypeBytes and the drift kernels'
// codes. Each test fails when one copy differs from the table.
#include "base/dtype.h"

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/client.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/store/store.pb.h"
#include "gtest/gtest.h"
#include "kernels/drift.h"
#include "tests/lib/enum_table_check.h"

namespace ckpt {
namespace {

using ::ckpt::testing::EnumRow;
using ::ckpt::testing::ExpectEnumIsTable;

std::vector<EnumRow> TableRows() {
  std::vector<EnumRow> rows;
  for (const DTypeInfo& row : kDTypeTable) {
    rows.push_back({static_cast<int>(row.dtype), std::string(row.name)});
  }
  return rows;
}

TEST(DTypeTableTest, ApiEnumHasTheTablesNamesAndNumbers) {
  ExpectEnumIsTable(v1::DType_descriptor(), "DTYPE_", "DTYPE_UNSPECIFIED", TableRows());
}

TEST(DTypeTableTest, StoreEnumHasTheTablesNamesAndNumbers) {
  ExpectEnumIsTable(store::DType_descriptor(), "DTYPE_", "DTYPE_UNSPECIFIED", TableRows());
}

// The sizes of the C++ types that hold one element of each (bf16 and f16 are
// 16-bit words: kernels/drift.h's Bf16ToF32 and F16ToF32 take a uint16_t).
TEST(DTypeTableTest, SizesAreThoseOfTheElements) {
  const std::map<std::string, uint64_t> elements = {
      {"F32", sizeof(float)},  {"F16", sizeof(uint16_t)}, {"BF16", sizeof(uint16_t)},
      {"F64", sizeof(double)}, {"I64", sizeof(int64_t)},  {"I32", sizeof(int32_t)},
      {"U8", sizeof(uint8_t)},
  };
  std::map<std::string, uint64_t> table;
  for (const DTypeInfo& row : kDTypeTable) {
    table[std::string(row.name)] = row.bytes;
    EXPECT_EQ(ElementBytes(row.dtype), row.bytes) << row.name;
  }
  EXPECT_EQ(table, elements);
  EXPECT_EQ(ElementBytes(DType::kUnspecified), 0u);
  EXPECT_EQ(ElementBytes(static_cast<DType>(kMaxDTypeNumber + 1)), 0u);
  EXPECT_EQ(ElementBytes(static_cast<DType>(-1)), 0u);
}

// The client computes nbytes with DTypeBytes; over every value of the API's
// enum and the numbers around them it must give the table's sizes.
TEST(DTypeTableTest, ClientSizesAreTheTables) {
  const google::protobuf::EnumDescriptor* e = v1::DType_descriptor();
  for (int i = 0; i < e->value_count(); ++i) {
    const int n = e->value(i)->number();
    EXPECT_EQ(DTypeBytes(static_cast<v1::DType>(n)), ElementBytes(static_cast<DType>(n)))
        << e->value(i)->name();
    EXPECT_EQ(DTypeBytes(static_cast<v1::DType>(n)) > 0, n != v1::DTYPE_UNSPECIFIED)
        << e->value(i)->name();
  }
  for (int n : {-1, kMaxDTypeNumber + 1, 99}) {
    EXPECT_EQ(DTypeBytes(static_cast<v1::DType>(n)), 0u) << n;
  }
}

// The drift kernels' own types, by name: the kernels' side of the mapping
// (they include nothing of ours, so nothing but this list names them).
struct DriftType {
  drift::DType code;
  std::string_view name;
};
constexpr DriftType kDriftTypes[] = {
    {drift::DType::kF32, "F32"},
    {drift::DType::kBF16, "BF16"},
    {drift::DType::kF16, "F16"},
};

// Every drift code in the table is the kernels' type of the row's name, each
// kernel type has exactly one row, and DriftCode gives back each code.
TEST(DTypeTableTest, DriftCodesRoundTrip) {
  std::set<int> codes;
  for (const DTypeInfo& row : kDTypeTable) {
    EXPECT_EQ(DriftCode(row.dtype), row.drift_code) << row.name;
    if (row.drift_code == kNoDriftCode) continue;
    EXPECT_TRUE(codes.insert(row.drift_code).second) << row.name << ": code used twice";
    const DriftType* kernel = nullptr;
    for (const DriftType& k : kDriftTypes) {
      if (static_cast<int>(k.code) == row.drift_code) kernel = &k;
    }
    ASSERT_NE(kernel, nullptr) << row.name << ": " << row.drift_code << " is no drift::DType";
    EXPECT_EQ(kernel->name, row.name);
  }
  for (const DriftType& k : kDriftTypes) {
    const DTypeInfo* row = nullptr;
    for (const DTypeInfo& r : kDTypeTable) {
      if (r.drift_code == static_cast<int>(k.code)) row = &r;
    }
    ASSERT_NE(row, nullptr) << "drift::DType " << k.name << " has no row";
    EXPECT_EQ(row->name, k.name);
    EXPECT_EQ(static_cast<drift::DType>(DriftCode(row->dtype)), k.code) << k.name;
  }
  EXPECT_EQ(DriftCode(DType::kUnspecified), kNoDriftCode);
  EXPECT_EQ(DriftCode(static_cast<DType>(kMaxDTypeNumber + 1)), kNoDriftCode);
}

}  // namespace
}  // namespace ckpt
