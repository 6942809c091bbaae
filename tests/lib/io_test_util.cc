#include "tests/lib/io_test_util.h"

#include "tests/lib/test_util.h"

namespace ckpt {

void PrintTo(IoBackendKind kind, std::ostream* os) { *os << IoBackendKindName(kind); }

namespace testing {

std::string BackendParamName(const ::testing::TestParamInfo<IoBackendKind>& info) {
  return IoBackendKindName(info.param);
}

std::unique_ptr<StagingPool> MakeTestPool(uint64_t chunk, size_t chunks) {
  StagingPoolOptions o;
  o.chunk_bytes = chunk;
  o.budget_bytes = chunk * chunks;
  o.lock_memory = false;
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(o);
  EXPECT_TRUE(IsOk(pool));
  return pool.ok() ? std::move(pool).value() : nullptr;
}

}  // namespace testing
}  // namespace ckpt
