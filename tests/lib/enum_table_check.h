// Checks a protobuf enum against one of ckptd's enum tables (base/dtype.h,
// daemon/common/tensor_types.h): used by the tests of those tables.
#pragma once

#include <google/protobuf/descriptor.h>

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ckpt::testing {

// One row of a table: the value's number and its name without the prefix.
struct EnumRow {
  int number = 0;
  std::string name;
};

// Expects the values of `e` to be exactly {0: unspecified} and, for each
// row, {number: prefix + name}: no value missing, none extra, none named or
// numbered differently. On failure both sets are printed.
inline void ExpectEnumIsTable(const google::protobuf::EnumDescriptor* e, const std::string& prefix,
                              const std::string& unspecified, const std::vector<EnumRow>& rows) {
  SCOPED_TRACE(e->full_name());
  std::map<int, std::string> table = {{0, unspecified}};
  for (const EnumRow& row : rows) {
    EXPECT_TRUE(table.emplace(row.number, prefix + row.name).second)
        << "two rows numbered " << row.number;
  }
  std::map<int, std::string> proto;
  for (int i = 0; i < e->value_count(); ++i) {
    EXPECT_TRUE(proto.emplace(e->value(i)->number(), e->value(i)->name()).second)
        << "two values numbered " << e->value(i)->number();
  }
  EXPECT_EQ(proto, table);
}

}  // namespace ckpt::testing
