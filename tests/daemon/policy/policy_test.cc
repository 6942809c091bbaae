// Tests of daemon/policy: layer selection.
#include <cstdint>
#include <vector>

#include "daemon/policy/selection.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using Layers = std::vector<uint32_t>;

PolicyConfig Config(v1::PolicyKind kind, uint64_t n = 1) {
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
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(Config(v1::POLICY_ALL), 7, 4));
  EXPECT_EQ(got, (Layers{0, 1, 2, 3}));
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(v1::POLICY_ALL), 0, 0));
  EXPECT_TRUE(got.empty());
}

TEST(SelectLayersTest, EveryNSelectsOnMultiples) {
  const PolicyConfig c = Config(v1::POLICY_EVERY_N, 3);
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
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(Config(v1::POLICY_EXPLICIT), 5, 6, {4, 1, 4, 0}));
  EXPECT_EQ(got, (Layers{0, 1, 4}));
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(v1::POLICY_EXPLICIT), 5, 6, {}));
  EXPECT_TRUE(got.empty());
}

TEST(SelectLayersTest, NoneSelectsNothingEvenWhenForced) {
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got, Select(Config(v1::POLICY_NONE), 3, 3, {},
                                               {true, true, true}, {true, true, true}));
  EXPECT_TRUE(got.empty());
}

TEST(SelectLayersTest, NeverPersistedAndRetryForceLayers) {
  const std::vector<bool> never = {false, true, false, false, false};
  const std::vector<bool> retry = {false, false, false, true, false};
  // every_n off-step: only the forced layers.
  CKPT_ASSERT_OK_AND_ASSIGN(Layers got,
                            Select(Config(v1::POLICY_EVERY_N, 4), 5, 5, {}, never, retry));
  EXPECT_EQ(got, (Layers{1, 3}));
  // explicit: the list plus the forced layers.
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(v1::POLICY_EXPLICIT), 5, 5, {4}, never, retry));
  EXPECT_EQ(got, (Layers{1, 3, 4}));
  // all: unchanged.
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(v1::POLICY_ALL), 5, 5, {}, never, retry));
  EXPECT_EQ(got, (Layers{0, 1, 2, 3, 4}));
  // Shorter flag vectors cover only their prefix.
  CKPT_ASSERT_OK_AND_ASSIGN(got, Select(Config(v1::POLICY_EVERY_N, 4), 5, 5, {}, {true}, {}));
  EXPECT_EQ(got, (Layers{0}));
}

TEST(SelectLayersTest, ExplicitIdOutOfRangeIsInvalid) {
  CKPT_EXPECT_CODE(Select(Config(v1::POLICY_EXPLICIT), 1, 4, {0, 4}), kInvalidArgument);
  CKPT_EXPECT_CODE(Select(Config(v1::POLICY_EXPLICIT), 1, 0, {0}), kInvalidArgument);
  CKPT_EXPECT_CODE(Select(Config(v1::POLICY_EXPLICIT), 1, 4, {UINT32_MAX}), kInvalidArgument);
}

TEST(SelectLayersTest, ListUnderOtherPoliciesIsInvalid) {
  for (v1::PolicyKind kind : {v1::POLICY_ALL, v1::POLICY_EVERY_N, v1::POLICY_NONE}) {
    CKPT_EXPECT_CODE(Select(Config(kind, 2), 2, 4, {1}), kInvalidArgument) << PolicyName(kind);
  }
}

TEST(SelectLayersTest, UnknownKindIsInvalid) {
  CKPT_EXPECT_CODE(Select(Config(static_cast<v1::PolicyKind>(99)), 1, 2), kInvalidArgument);
}

TEST(PolicyFromProtoTest, Kinds) {
  v1::PolicySpec spec;
  CKPT_ASSERT_OK_AND_ASSIGN(PolicyConfig c, PolicyFromProto(spec));
  EXPECT_EQ(c.kind, v1::POLICY_ALL);
  spec.set_kind(v1::POLICY_EVERY_N);
  spec.set_every_n(5);
  CKPT_ASSERT_OK_AND_ASSIGN(c, PolicyFromProto(spec));
  EXPECT_EQ(c.kind, v1::POLICY_EVERY_N);
  EXPECT_EQ(c.every_n, 5u);
  spec.set_kind(v1::POLICY_EXPLICIT);
  CKPT_ASSERT_OK_AND_ASSIGN(c, PolicyFromProto(spec));
  EXPECT_EQ(c.kind, v1::POLICY_EXPLICIT);
  spec.set_kind(v1::POLICY_NONE);
  CKPT_ASSERT_OK_AND_ASSIGN(c, PolicyFromProto(spec));
  EXPECT_EQ(c.kind, v1::POLICY_NONE);
}

TEST(PolicyFromProtoTest, EveryNZeroIsInvalid) {
  v1::PolicySpec spec;
  spec.set_kind(v1::POLICY_EVERY_N);
  spec.set_every_n(0);
  CKPT_EXPECT_CODE(PolicyFromProto(spec), kInvalidArgument);
}

TEST(PolicyFromProtoTest, UnknownKindIsInvalid) {
  v1::PolicySpec spec;
  spec.set_kind(static_cast<v1::PolicyKind>(42));
  CKPT_EXPECT_CODE(PolicyFromProto(spec), kInvalidArgument);
}

TEST(PolicyNameTest, Names) {
  EXPECT_STREQ(PolicyName(v1::POLICY_ALL), "all");
  EXPECT_STREQ(PolicyName(v1::POLICY_EVERY_N), "every_n");
  EXPECT_STREQ(PolicyName(v1::POLICY_EXPLICIT), "explicit");
  EXPECT_STREQ(PolicyName(v1::POLICY_NONE), "none");
  EXPECT_STREQ(PolicyName(static_cast<v1::PolicyKind>(42)), "unknown");
}

}  // namespace
}  // namespace ckpt
