// Tests of daemon/rpc: call admission (RpcServerOptions limits).
#include "daemon/rpc/server.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

RpcServerOptions Limits(int per_uid, int heavy) {
  RpcServerOptions o;
  o.max_calls_per_uid = per_uid;
  o.max_heavy_calls = heavy;
  return o;
}

TEST(CallLimitsTest, PerUidCapLeavesOtherUsersAlone) {
  RpcServer server(Limits(3, 2), nullptr, nullptr);
  for (int i = 0; i < 3; ++i) CKPT_EXPECT_OK(server.EnterCall(1000, false));
  absl::Status s = server.EnterCall(1000, false);
  CKPT_EXPECT_CODE(s, kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("max_calls_per_uid"), std::string::npos) << s;
  CKPT_EXPECT_OK(server.EnterCall(1001, false));  // another user is not starved
  server.LeaveCall(1000, false);
  CKPT_EXPECT_OK(server.EnterCall(1000, false));  // a slot came back
}

TEST(CallLimitsTest, HeavyCallsAreCappedNodeWide) {
  RpcServer server(Limits(10, 2), nullptr, nullptr);
  CKPT_EXPECT_OK(server.EnterCall(1000, true));
  CKPT_EXPECT_OK(server.EnterCall(1001, true));
  CKPT_EXPECT_CODE(server.EnterCall(1002, true), kResourceExhausted);
  CKPT_EXPECT_OK(server.EnterCall(1002, false));  // ordinary calls still pass
  server.LeaveCall(1000, true);
  CKPT_EXPECT_OK(server.EnterCall(1002, true));
}

TEST(CallLimitsTest, RefusedCallsTakeNoSlot) {
  RpcServer server(Limits(1, 1), nullptr, nullptr);
  CKPT_EXPECT_OK(server.EnterCall(7, true));
  for (int i = 0; i < 10; ++i) CKPT_EXPECT_CODE(server.EnterCall(7, true), kResourceExhausted);
  server.LeaveCall(7, true);
  CKPT_EXPECT_OK(server.EnterCall(7, true));
}

}  // namespace
}  // namespace ckpt
