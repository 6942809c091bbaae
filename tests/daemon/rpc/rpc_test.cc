// Tests of daemon/rpc: call admission (RpcServerOptions limits) and the
// release of memory after large requests.
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

TEST(CallLimitsTest, LargeRegisterCallsAreCappedNodeWide) {
  RpcServerOptions o = Limits(10, 2);
  o.max_large_calls = 2;
  RpcServer server(o, nullptr, nullptr);
  CKPT_EXPECT_OK(server.EnterCall(1000, false, true));
  CKPT_EXPECT_OK(server.EnterCall(1001, false, true));
  absl::Status s = server.EnterCall(1002, false, true);
  CKPT_EXPECT_CODE(s, kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("max_large_calls"), std::string::npos) << s;
  CKPT_EXPECT_OK(server.EnterCall(1002, false, false));  // small calls still pass
  server.LeaveCall(1000, false, true);
  CKPT_EXPECT_OK(server.EnterCall(1002, false, true));  // a slot came back
}

TEST(MemoryReleaseTest, ReleasesWhenTheLastLargeRequestOfABurstFinishes) {
  RpcServer server(RpcServerOptions(), nullptr, nullptr);
  int a, b, c, small;
  server.NoteLargeRequest(&a);
  server.NoteLargeRequest(&b);
  EXPECT_FALSE(server.FinishCall(&small));  // not noted: nothing to release
  EXPECT_FALSE(server.FinishCall(&a));      // b still holds its request
  server.NoteLargeRequest(&c);
  EXPECT_FALSE(server.FinishCall(&b));
  EXPECT_EQ(server.memory_releases(), 0u);
  EXPECT_TRUE(server.FinishCall(&c));  // the last one of the burst
  EXPECT_EQ(server.memory_releases(), 1u);
  EXPECT_FALSE(server.FinishCall(&c));  // finished once only
  server.NoteLargeRequest(&a);
  EXPECT_TRUE(server.FinishCall(&a));
  EXPECT_EQ(server.memory_releases(), 2u);
}

}  // namespace
}  // namespace ckpt
