// Tests of daemon/common/sync_point: dependencies order threads, callbacks
// see their argument, nothing happens while processing is off, and every wait
// ends (deadline or DisableProcessing).
#include "daemon/common/sync_point.h"

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/common/kill_point.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

constexpr absl::Duration kLongWait = absl::Seconds(30);

class SyncPointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kSyncPointsCompiled) GTEST_SKIP() << "built without CKPT_KILL_POINTS";
    sp_->StartTest(kLongWait);
  }
  void TearDown() override {
    sp_->EndTest();
    sp_->SetWaitTimeout(kLongWait);
  }

  // Appends `what` to the shared order (threads call it).
  void Record(const std::string& what) {
    std::lock_guard<std::mutex> lock(order_mu_);
    order_.push_back(what);
  }
  std::vector<std::string> Order() {
    std::lock_guard<std::mutex> lock(order_mu_);
    return order_;
  }

  SyncPoint* const sp_ = SyncPoint::GetInstance();
  std::mutex order_mu_;
  std::vector<std::string> order_;
};

TEST_F(SyncPointTest, SuccessorWaitsUntilPredecessorIsPassed) {
  sp_->LoadDependency({{"Test:first", "Test:second"}});
  std::thread late([this] {
    CKPT_SYNC_POINT("Test:second");
    Record("second");
  });
  // The other thread is parked at its point before this one even starts.
  ASSERT_TRUE(sp_->WaitForArrivals("Test:second", 1, absl::Now() + kLongWait));
  EXPECT_EQ(sp_->passes("Test:second"), 0u);
  Record("first");
  CKPT_SYNC_POINT("Test:first");
  late.join();
  EXPECT_EQ(Order(), (std::vector<std::string>{"first", "second"}));
  EXPECT_EQ(sp_->passes("Test:second"), 1u);
  EXPECT_EQ(sp_->timeouts(), 0u);
}

TEST_F(SyncPointTest, PointWithTwoPredecessorsWaitsForBoth) {
  sp_->LoadDependency({{"Test:a", "Test:c"}, {"Test:b", "Test:c"}});
  std::thread c([this] {
    CKPT_SYNC_POINT("Test:c");
    Record("c");
  });
  ASSERT_TRUE(sp_->WaitForArrivals("Test:c", 1, absl::Now() + kLongWait));
  Record("a");
  CKPT_SYNC_POINT("Test:a");
  // Still parked: "Test:b" has not been passed.
  EXPECT_EQ(sp_->passes("Test:c"), 0u);
  Record("b");
  std::thread b([] { CKPT_SYNC_POINT("Test:b"); });
  b.join();
  c.join();
  EXPECT_EQ(Order(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(sp_->timeouts(), 0u);
}

// Started in reverse order, three threads run their callbacks 1, 2, 3: a
// callback runs before its point counts as passed.
TEST_F(SyncPointTest, ChainOrdersThreeThreadsAndTheirCallbacks) {
  sp_->LoadDependency({{"Test:1", "Test:2"}, {"Test:2", "Test:3"}});
  for (int i = 1; i <= 3; ++i) {
    sp_->SetCallBack("Test:" + std::to_string(i), [this, i](void*) { Record(std::to_string(i)); });
  }
  std::vector<std::thread> threads;
  for (int i = 3; i >= 1; --i) {
    threads.emplace_back([i] {
      const std::string point = "Test:" + std::to_string(i);
      CKPT_SYNC_POINT(point.c_str());
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(Order(), (std::vector<std::string>{"1", "2", "3"}));
  EXPECT_EQ(sp_->timeouts(), 0u);
}

TEST_F(SyncPointTest, CallbackReceivesTheArgument) {
  int seen = 0;
  sp_->SetCallBack("Test:arg", [&seen](void* arg) { seen = *static_cast<int*>(arg); });
  int value = 42;
  CKPT_SYNC_POINT_CALLBACK("Test:arg", &value);
  EXPECT_EQ(seen, 42);
  // The callback may change what the code at the point sees.
  sp_->SetCallBack("Test:arg", [](void* arg) { *static_cast<int*>(arg) = 7; });
  CKPT_SYNC_POINT_CALLBACK("Test:arg", &value);
  EXPECT_EQ(value, 7);
  EXPECT_EQ(sp_->passes("Test:arg"), 2u);
  sp_->ClearCallBack("Test:arg");
  value = 1;
  CKPT_SYNC_POINT_CALLBACK("Test:arg", &value);
  EXPECT_EQ(value, 1);
  EXPECT_EQ(sp_->passes("Test:arg"), 3u);
}

TEST_F(SyncPointTest, DisabledProcessingDoesNothing) {
  int calls = 0;
  sp_->SetCallBack("Test:off", [&calls](void*) { ++calls; });
  // A dependency that is never met: with processing on this would wait.
  sp_->LoadDependency({{"Test:never", "Test:off"}});
  sp_->DisableProcessing();
  CKPT_SYNC_POINT("Test:off");
  CKPT_SYNC_POINT("Test:off");
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(sp_->arrivals("Test:off"), 0u);
  EXPECT_EQ(sp_->passes("Test:off"), 0u);
  EXPECT_EQ(sp_->timeouts(), 0u);
  // On again, the callback runs.
  sp_->LoadDependency({});
  sp_->EnableProcessing();
  CKPT_SYNC_POINT("Test:off");
  EXPECT_EQ(calls, 1);
}

TEST_F(SyncPointTest, WaitThatTimesOutReturnsAndIsCounted) {
  sp_->SetWaitTimeout(absl::Milliseconds(20));
  sp_->LoadDependency({{"Test:never", "Test:waits"}});
  int calls = 0;
  sp_->SetCallBack("Test:waits", [&calls](void*) { ++calls; });
  CKPT_SYNC_POINT("Test:waits");
  // It went on as if the dependency were met, and says so.
  EXPECT_EQ(sp_->timeouts(), 1u);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(sp_->passes("Test:waits"), 1u);
  EXPECT_EQ(sp_->passes("Test:never"), 0u);
  // EnableProcessing starts a fresh count.
  sp_->EnableProcessing();
  EXPECT_EQ(sp_->timeouts(), 0u);
}

TEST_F(SyncPointTest, DisableProcessingReleasesAWaitingThread) {
  sp_->LoadDependency({{"Test:never", "Test:parked"}});
  std::atomic<bool> done{false};
  std::thread parked([&done] {
    CKPT_SYNC_POINT("Test:parked");
    done = true;
  });
  ASSERT_TRUE(sp_->WaitForArrivals("Test:parked", 1, absl::Now() + kLongWait));
  EXPECT_FALSE(done.load());
  sp_->DisableProcessing();
  parked.join();
  EXPECT_TRUE(done.load());
  EXPECT_EQ(sp_->timeouts(), 0u);
}

TEST_F(SyncPointTest, NewDependenciesReleaseAWaitingThread) {
  sp_->LoadDependency({{"Test:never", "Test:parked"}});
  std::thread parked([] { CKPT_SYNC_POINT("Test:parked"); });
  ASSERT_TRUE(sp_->WaitForArrivals("Test:parked", 1, absl::Now() + kLongWait));
  sp_->LoadDependency({});  // re-checked against no dependencies at all
  parked.join();
  EXPECT_EQ(sp_->timeouts(), 0u);
}

TEST_F(SyncPointTest, TraceIsForgottenButDependenciesStay) {
  sp_->SetWaitTimeout(absl::Milliseconds(20));
  sp_->LoadDependency({{"Test:a", "Test:b"}});
  CKPT_SYNC_POINT("Test:a");
  CKPT_SYNC_POINT("Test:b");  // "Test:a" was passed: no wait
  EXPECT_EQ(sp_->timeouts(), 0u);
  sp_->ClearTrace();
  EXPECT_EQ(sp_->passes("Test:a"), 0u);
  EXPECT_EQ(sp_->arrivals("Test:b"), 0u);
  CKPT_SYNC_POINT("Test:b");  // "Test:a" is forgotten: waits, times out
  EXPECT_EQ(sp_->timeouts(), 1u);
}

TEST_F(SyncPointTest, WaitForCountsHonoursItsDeadline) {
  EXPECT_FALSE(sp_->WaitForPasses("Test:nobody", 1, absl::Now() + absl::Milliseconds(10)));
  EXPECT_FALSE(sp_->WaitForArrivals("Test:nobody", 1, absl::Now()));
  CKPT_SYNC_POINT("Test:somebody");
  EXPECT_TRUE(sp_->WaitForPasses("Test:somebody", 1, absl::Now()));
  EXPECT_TRUE(sp_->WaitForArrivals("Test:somebody", 1, absl::Now()));
  EXPECT_FALSE(sp_->WaitForPasses("Test:somebody", 2, absl::Now()));
}

// The environment arms no kill or delay here; the points still run the
// sync points of their names.
TEST_F(SyncPointTest, KillAndDelayPointsAreSyncPoints) {
  int delay_calls = 0, kill_calls = 0;
  sp_->SetCallBack("Test:delay", [&delay_calls](void*) { ++delay_calls; });
  sp_->SetCallBack("Test:kill", [&kill_calls](void*) { ++kill_calls; });
  CKPT_DELAY_POINT("Test:delay");
  CKPT_KILL_POINT("Test:kill");
  EXPECT_EQ(delay_calls, 1);
  EXPECT_EQ(kill_calls, 1);
  // And they wait for their predecessors like any sync point.
  sp_->LoadDependency({{"Test:go", "Test:delay"}});
  std::thread delayed([] { CKPT_DELAY_POINT("Test:delay"); });
  ASSERT_TRUE(sp_->WaitForArrivals("Test:delay", 1, absl::Now() + kLongWait));
  EXPECT_EQ(sp_->passes("Test:delay"), 0u);
  CKPT_SYNC_POINT("Test:go");
  delayed.join();
  EXPECT_EQ(sp_->passes("Test:delay"), 1u);
  EXPECT_EQ(sp_->timeouts(), 0u);
}

}  // namespace
}  // namespace ckpt
