// Tests of daemon/policy: layer selection.
#include <cstdint>
#include <vector>

#include "daemon/policy/selection.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using Layers = std::vector<uint32_t>;

PolicyConfig Config(PolicyKind kind, uint64_t n = 1) {
  PolicyConfig c;
  c.kind = kind;
  c.every_n = n;
  return c;
}

absl::StatusOr<Layers> Select(const PolicyConfig& c, uint64_t step, uint32_t num_layers,
                              const Layers& explicit_layers = {},
                              const std::vector<bool>& never = {},
                              const std::vector<bool>& retry = {}) {
  return SelectLayers(c, step, num_layers, explicit_layers, never, retry);
}

TEST(SelectLayersTest, AllSelectsEveryLayer) {
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(Config(PolicyKind::kAll), 7, 4));
  EXPECT_EQ(got, (Layers{0, 1, 2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(PolicyKind::kAll), 0, 0));
  EXPECT_TRUE(got.empty());
}

TEST(SelectLayersTest, EveryNSelectsOnMultiples) {
  const PolicyConfig c = Config(PolicyKind::kEveryN, 3);
  for (uint64_t step = 0; step < 12; ++step) {
    CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(c, step, 3));
    if (step % 3 == 0) {
      EXPECT_EQ(got, (Layers{0, 1, 2})) << step;
    } else {
      EXPECT_TRUE(got.empty()) << step;
    }
  }
}

TEST(SelectLayersTest, ExplicitIsSortedAndUnique) {
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(Config(PolicyKind::kExplicit), 5, 6, {4, 1, 4, 0}));
  EXPECT_EQ(got, (Layers{0, 1, 4}));
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(PolicyKind::kExplicit), 5, 6, {}));
  EXPECT_TRUE(got.empty());
}

TEST(SelectLayersTest, NoneSelectsNothingEvenWhenForced) {
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(Config(PolicyKind::kNone), 3, 3, {},
                                               {true, true, true}, {true, true, true}));
  EXPECT_TRUE(got.empty());
}

TEST(SelectLayersTest, NeverPersistedAndRetryForceLayers) {
  const std::vector<bool> never = {false, true, false, false, false};
  const std::vector<bool> retry = {false, false, false, true, false};
  // every_n off-step: only the forced layers.
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got,
                            Select(Config(PolicyKind::kEveryN, 4), 5, 5, {}, never, retry));
  EXPECT_EQ(got, (Layers{1, 3}));
  // explicit: the list plus the forced layers.
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(PolicyKind::kExplicit), 5, 5, {4}, never, retry));
  EXPECT_EQ(got, (Layers{1, 3, 4}));
  // all: unchanged.
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(PolicyKind::kAll), 5, 5, {}, never, retry));
  EXPECT_EQ(got, (Layers{0, 1, 2, 3, 4}));
  // Shorter flag vectors cover only their prefix.
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(PolicyKind::kEveryN, 4), 5, 5, {}, {true}, {}));
  EXPECT_EQ(got, (Layers{0}));
}

TEST(SelectLayersTest, FrozenLayersAreSelectedOnlyWhenForced) {
  const std::vector<bool> frozen = {false, true, false};
  for (PolicyKind kind : {PolicyKind::kAll, PolicyKind::kEveryN}) {
    CKPT_ASSERT_OK_AND_ASSIGN(Layers got, SelectLayers(Config(kind), 4, 3, {}, {}, {}, frozen));
    EXPECT_EQ(got, (Layers{0, 2})) << PolicyName(kind);
    CKPT_ASSERT_OK_AND_ASSIGN(
        got, SelectLayers(Config(kind), 4, 3, {}, {false, true, false}, {}, frozen));
    EXPECT_EQ(got, (Layers{0, 1, 2})) << "never persisted: " << PolicyName(kind);
    CKPT_ASSERT_OK_AND_ASSIGN(
        got, SelectLayers(Config(kind), 4, 3, {}, {}, {false, true, false}, frozen));
    EXPECT_EQ(got, (Layers{0, 1, 2})) << "retry: " << PolicyName(kind);
  }
}

TEST(SelectLayersTest, ExplicitIdOutOfRangeIsInvalid) {
  CKPT_EXPECT_CODE(Select(Config(PolicyKind::kExplicit), 1, 4, {0, 4}), kInvalidArgument);
  CKPT_EXPECT_CODE(Select(Config(PolicyKind::kExplicit), 1, 0, {0}), kInvalidArgument);
  CKPT_EXPECT_CODE(Select(Config(PolicyKind::kExplicit), 1, 4, {UINT32_MAX}), kInvalidArgument);
}

TEST(SelectLayersTest, ListUnderOtherPoliciesIsInvalid) {
  for (PolicyKind kind : {PolicyKind::kAll, PolicyKind::kEveryN, PolicyKind::kNone}) {
    CKPT_EXPECT_CODE(Select(Config(kind, 2), 2, 4, {1}), kInvalidArgument) << PolicyName(kind);
  }
}

TEST(SelectLayersTest, UnknownKindIsInvalid) {
  CKPT_EXPECT_CODE(Select(Config(static_cast<PolicyKind>(99)), 1, 2), kInvalidArgument);
}

TEST(PolicyConfigTest, EveryNZeroAndUnknownKindsAreInvalid) {
  CKPT_EXPECT_OK(Config(PolicyKind::kEveryN, 5).Validate());
  CKPT_EXPECT_CODE(Config(PolicyKind::kEveryN, 0).Validate(), kInvalidArgument);
  CKPT_EXPECT_OK(Config(PolicyKind::kNone, 0).Validate());  // n matters to every_n only
  CKPT_EXPECT_CODE(Config(static_cast<PolicyKind>(42)).Validate(), kInvalidArgument);
}

TEST(PolicyNameTest, Names) {
  EXPECT_STREQ(PolicyName(PolicyKind::kAll), "all");
  EXPECT_STREQ(PolicyName(PolicyKind::kEveryN), "every_n");
  EXPECT_STREQ(PolicyName(PolicyKind::kExplicit), "explicit");
  EXPECT_STREQ(PolicyName(PolicyKind::kNone), "none");
  EXPECT_STREQ(PolicyName(static_cast<PolicyKind>(42)), "unknown");
}

}  // namespace
}  // namespace ckpt
