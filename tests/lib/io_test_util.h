// Fixtures shared by the tests of the io twins and of the store: printing
// and naming IoBackendKind parameters, and a small unlocked staging pool.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "daemon/io/io_backend.h"
#include "daemon/staging/staging_pool.h"
#include "gtest/gtest.h"

namespace ckpt {

// Lets gtest print backend parameters by name (found by ADL).
void PrintTo(IoBackendKind kind, std::ostream* os);

namespace testing {

// Test-name suffix for INSTANTIATE_TEST_SUITE_P over IoBackendKind.
std::string BackendParamName(const ::testing::TestParamInfo<IoBackendKind>& info);

// A pool of `chunks` chunks of `chunk` bytes, not mlock'ed; null (and a test
// failure) if it cannot be created.
std::unique_ptr<StagingPool> MakeTestPool(uint64_t chunk, size_t chunks);

}  // namespace testing
}  // namespace ckpt
