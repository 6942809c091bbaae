// Property test of retention: over random histories, GC never invalidates
// the plan of a retained target and never touches anything newer than the
// latest checkpoint event.
#include "daemon/store/retention.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace ckpt {
namespace {

// Newest step <= target in `steps`, or 0.
uint64_t NewestAtOrBefore(const std::set<uint64_t>& steps, uint64_t target) {
  auto it = steps.upper_bound(target);
  return it == steps.begin() ? 0 : *std::prev(it);
}

class RetentionProperties : public ::testing::TestWithParam<uint64_t> {};

TEST_P(RetentionProperties, RetainedPlansSurviveAndNewerVersionsAreUntouched) {
  std::mt19937_64 rng(GetParam());
  const uint32_t layers = 1 + rng() % 8;
  const uint64_t steps = 20 + rng() % 400;
  RetentionPolicy policy;
  policy.keep_last_events = rng() % 30;
  policy.keep_every_steps = rng() % 2 ? 10 + rng() % 90 : 0;
  policy.keep_hours = rng() % 3 == 0 ? 1 : 0;
  RetentionInput in;
  in.now_unix_ms = 10'000'000'000;
  std::map<uint32_t, std::set<uint64_t>> have;
  uint64_t last_event = 0;
  for (uint64_t s = 1; s <= steps; ++s) {
    for (uint32_t l = 0; l < layers; ++l) {
      if (s == 1 || rng() % 5 == 0) have[l].insert(s);
    }
    // Most steps get an event; the last few may still be in flight.
    if (s + 3 <= steps || rng() % 2) {
      // Events age one minute per step; the newest 60 are younger than an hour.
      in.events.emplace_back(s, in.now_unix_ms - static_cast<int64_t>(steps - s) * 60'000);
      last_event = s;
    }
  }
  for (const auto& [l, set] : have) in.versions[l].assign(set.begin(), set.end());
  // Half the histories belong to a rank of a job whose ranks agreed on a
  // durable step somewhere in the history.
  in.agreed_step = rng() % 2 ? rng() % (steps + 1) : 0;
  uint64_t agreed_event = 0;  // the newest event at or below it
  for (const auto& [s, ms] : in.events) {
    if (in.agreed_step > 0 && s <= in.agreed_step) agreed_event = s;
  }

  RetentionPlan plan = PlanRetention(policy, in);

  // The latest event is always retained; deleted events are exactly the others.
  ASSERT_FALSE(plan.retained_targets.empty());
  EXPECT_EQ(plan.retained_targets.back(), last_event);
  EXPECT_EQ(plan.retained_targets.size() + plan.delete_events.size(), in.events.size());
  std::set<uint64_t> retained(plan.retained_targets.begin(), plan.retained_targets.end());
  for (uint64_t s : plan.delete_events) EXPECT_EQ(retained.count(s), 0u);
  // The policy's rules are honoured.
  for (size_t i = 0; i < in.events.size(); ++i) {
    const uint64_t s = in.events[i].first;
    const bool must = i + 1 == in.events.size() ||
                      in.events.size() - i <= policy.keep_last_events ||
                      (policy.keep_every_steps && s % policy.keep_every_steps == 0) ||
                      (policy.keep_hours && in.events[i].second >= in.now_unix_ms - 3'600'000) ||
                      s == agreed_event;
    EXPECT_EQ(retained.count(s) > 0, must) << "event " << s;
  }

  std::map<uint32_t, std::set<uint64_t>> after = have;
  for (const auto& [l, s] : plan.delete_versions) {
    EXPECT_LE(s, last_event) << "a version above the latest event was deleted";
    ASSERT_EQ(after[l].erase(s), 1u);
  }
  EXPECT_EQ(plan.versions_kept + plan.delete_versions.size(), [&] {
    size_t n = 0;
    for (auto& [l, s] : have) n += s.size();
    return n;
  }());
  for (uint64_t target : plan.retained_targets) {
    for (uint32_t l = 0; l < layers; ++l) {
      ASSERT_EQ(NewestAtOrBefore(after[l], target), NewestAtOrBefore(have[l], target))
          << "layer " << l << " target " << target << " seed " << GetParam();
    }
  }
  // Each layer's newest version survives.
  for (uint32_t l = 0; l < layers; ++l) EXPECT_EQ(*after[l].rbegin(), *have[l].rbegin());
  // Nothing needed is kept twice over: with only the latest target retained,
  // each layer keeps its newest version at or below it plus those above it.
}

INSTANTIATE_TEST_SUITE_P(Seeds, RetentionProperties, ::testing::Range<uint64_t>(1, 201));

TEST(Retention, NoEventsMeansNothingIsTouched) {
  RetentionInput in;
  in.versions[0] = {1, 2, 3};
  RetentionPlan plan = PlanRetention(RetentionPolicy(), in);
  EXPECT_TRUE(plan.delete_versions.empty());
  EXPECT_TRUE(plan.retained_targets.empty());
}

TEST(Retention, KeepsOnlyWhatTheLatestPlanNeedsWhenNothingElseIsRetained) {
  RetentionPolicy p;
  p.keep_last_events = 1;
  p.keep_every_steps = 0;
  RetentionInput in;
  for (uint64_t s = 1; s <= 10; ++s) in.events.emplace_back(s, 0);
  in.versions[0] = {1, 4, 9};
  in.versions[1] = {1, 10, 12};  // 12: committed, its event not yet written
  RetentionPlan plan = PlanRetention(p, in);
  EXPECT_EQ(plan.retained_targets, (std::vector<uint64_t>{10}));
  EXPECT_EQ(plan.delete_versions,
            (std::vector<std::pair<uint32_t, uint64_t>>{{0, 1}, {0, 4}, {1, 1}}));
  EXPECT_EQ(plan.versions_kept, 3u);
}

// A rank of a job whose other ranks lag: the newest event at or below the
// agreed durable step stays a retained target (every rank restores it),
// even when keep_last_events alone would let it go.
TEST(Retention, KeepsThePlanOfTheAgreedDurableStep) {
  RetentionPolicy p;
  p.keep_last_events = 2;
  p.keep_every_steps = 0;
  RetentionInput in;
  for (uint64_t s : {1, 2, 4, 6, 8, 9, 10}) in.events.emplace_back(s, 0);
  in.versions[0] = {1, 3, 5, 9};
  in.agreed_step = 5;  // no event at 5: the newest at or below it is 4
  RetentionPlan plan = PlanRetention(p, in);
  EXPECT_EQ(plan.retained_targets, (std::vector<uint64_t>{4, 9, 10}));
  EXPECT_EQ(plan.delete_versions, (std::vector<std::pair<uint32_t, uint64_t>>{{0, 1}, {0, 5}}));
  in.agreed_step = 0;  // none agreed: only the last two
  EXPECT_EQ(PlanRetention(p, in).retained_targets, (std::vector<uint64_t>{9, 10}));
}

// The remote tier: the oldest max_pending_events events above the newest
// remote-durable step stay, with their plans, until they are uploaded.
TEST(Retention, KeepsTheOldestEventsNotUploadedYet) {
  RetentionPolicy p;
  p.keep_last_events = 1;
  p.keep_every_steps = 0;
  RetentionInput in;
  for (uint64_t s = 1; s <= 8; ++s) in.events.emplace_back(s, 0);
  in.versions[0] = {1, 2, 3, 4, 5, 6, 7, 8};
  in.pending_after = 3;
  in.max_pending_events = 2;  // steps 4 and 5; 8 is the latest anyway
  RetentionPlan plan = PlanRetention(p, in);
  EXPECT_EQ(plan.retained_targets, (std::vector<uint64_t>{4, 5, 8}));
  EXPECT_EQ(plan.delete_events, (std::vector<uint64_t>{1, 2, 3, 6, 7}));
  in.max_pending_events = 100;  // every event above 3
  EXPECT_EQ(PlanRetention(p, in).retained_targets, (std::vector<uint64_t>{4, 5, 6, 7, 8}));
  in.pending_after = UINT64_MAX;  // no remote tier: only the latest
  EXPECT_EQ(PlanRetention(p, in).retained_targets, (std::vector<uint64_t>{8}));
}

// Regression (found by tests/fuzz/index_fuzzer.cc under UBSan): keep_hours *
// 3600000 overflowed int64 for large configured values (undefined behaviour;
// 2^62 hours wrapped to a horizon of "now", so every old event was deleted).
TEST(Retention, HugeKeepHoursKeepsEveryEvent) {
  for (uint64_t hours : {uint64_t{1} << 62, uint64_t{3'000'000'000'000}, ~uint64_t{0}}) {
    RetentionPolicy p;
    p.keep_last_events = 1;
    p.keep_every_steps = 0;
    p.keep_hours = hours;
    RetentionInput in;
    in.now_unix_ms = 1'700'000'000'000;
    for (uint64_t s = 1; s <= 5; ++s) in.events.emplace_back(s, static_cast<int64_t>(s) * 1000);
    in.versions[0] = {1, 3, 5};
    RetentionPlan plan = PlanRetention(p, in);
    EXPECT_EQ(plan.retained_targets, (std::vector<uint64_t>{1, 2, 3, 4, 5})) << hours;
    EXPECT_TRUE(plan.delete_versions.empty()) << hours;
  }
}

}  // namespace
}  // namespace ckpt
