// Tests of daemon/rpc/convert.h: ckpt.v1 requests become the engine's own
// types, and the engine's results become replies, without losing a field.
#include "daemon/rpc/convert.h"

#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

v1::RegisterRequest OneTensorRequest() {
  v1::RegisterRequest req;
  req.set_job_id("job");
  req.set_rank(1);
  req.set_world_size(2);
  req.set_handover_token("token");
  v1::LayerSpec* api = req.add_layers();
  api->set_id(0);
  api->set_name("layers.2");
  api->set_kind(v1::LAYER_BLOCK);
  v1::TensorSpec* t = api->add_tensors();
  t->set_name("w");
  t->set_dtype(v1::DTYPE_BF16);
  t->add_shape(4);
  t->add_shape(8);
  t->set_nbytes(64);
  t->set_role(v1::ROLE_MASTER);
  t->set_region(2);
  t->set_offset(4096);
  t->set_group(1);
  t->set_param("p");
  t->set_lr_scale(0.5);
  t->set_beta1(0.8);
  t->set_beta2(0.95);
  t->set_eps(1e-6);
  t->set_weight_decay(0.1);
  return req;
}

// Tables registered before the store had its own messages were persisted as
// ckpt.v1 LayerSpecs; they must read back as store LayerSpecs unchanged, and
// a registration converted today must be stored as exactly those bytes.
TEST(ConvertTest, RegisteredTablesKeepTheBytesOfOlderReleases) {
  const v1::RegisterRequest req = OneTensorRequest();
  const std::string old_bytes = req.layers(0).SerializeAsString();
  store::LayerSpec read_back;
  ASSERT_TRUE(read_back.ParseFromString(old_bytes));
  EXPECT_EQ(read_back.SerializeAsString(), old_bytes);
  EXPECT_EQ(read_back.tensors(0).dtype(), store::DTYPE_BF16);
  EXPECT_EQ(read_back.tensors(0).role(), store::ROLE_MASTER);
  CKPT_ASSERT_OK_AND_ASSIGN(Registration r, RegistrationOf(req));
  ASSERT_EQ(r.layers.size(), 1u);
  EXPECT_EQ(TableEntryOf(r.layers[0]).SerializeAsString(), old_bytes);
  EXPECT_EQ(ToApi(read_back.kind()), v1::LAYER_BLOCK);
}

TEST(ConvertTest, RegistrationCarriesEveryField) {
  v1::RegisterRequest req = OneTensorRequest();
  req.mutable_policy()->set_kind(v1::POLICY_LAYERCHECK);
  req.mutable_policy()->set_optimizer(v1::OPTIMIZER_SGD);
  req.mutable_policy()->set_record_trace(true);
  req.mutable_policy()->mutable_layercheck()->set_s_max(7);
  req.mutable_policy()->mutable_layercheck()->set_warmup(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Registration r, RegistrationOf(req));
  EXPECT_EQ(r.job, "job");
  EXPECT_EQ(r.rank, 1u);
  EXPECT_EQ(r.world_size, 2u);
  EXPECT_EQ(r.handover_token, "token");
  EXPECT_FALSE(r.gpu.has_value());
  EXPECT_EQ(r.policy.selection.kind, PolicyKind::kLayerCheck);
  EXPECT_EQ(r.policy.optimizer, OptimizerKind::kSgd);
  EXPECT_TRUE(r.policy.record_trace);
  EXPECT_EQ(r.policy.layercheck.s_max, 7u);
  EXPECT_EQ(r.policy.layercheck.warmup, 0u);                 // set explicitly to 0
  EXPECT_EQ(r.policy.layercheck.k0, LayerCheckConfig{}.k0);  // unset: the default
  const TensorDesc& t = r.layers[0].tensors[0];
  EXPECT_EQ(t.dtype, DType::kBF16);
  EXPECT_EQ(t.role, TensorRole::kMaster);
  EXPECT_EQ(t.shape, (std::vector<uint64_t>{4, 8}));
  EXPECT_EQ(t.offset, 4096u);
  EXPECT_EQ(t.param, "p");
  EXPECT_DOUBLE_EQ(t.weight_decay, 0.1);

  v1::GpuHandover* gpu = req.mutable_gpu();
  gpu->set_device_uuid("GPU-x");
  gpu->set_step_event("event");
  v1::GpuRegion* region = gpu->add_regions();
  region->set_ipc_handle("handle");
  region->set_bytes(4096);
  CKPT_ASSERT_OK_AND_ASSIGN(Registration g, RegistrationOf(req));
  ASSERT_TRUE(g.gpu.has_value());
  EXPECT_EQ(g.gpu->device_uuid, "GPU-x");
  EXPECT_EQ(g.gpu->step_event, "event");
  ASSERT_EQ(g.gpu->regions.size(), 1u);
  EXPECT_EQ(g.gpu->regions[0].ipc_handle, "handle");
  EXPECT_EQ(g.gpu->regions[0].bytes, 4096u);
  EXPECT_TRUE(g.gpu->regions[0].pages.empty());

  // A run of pages: a descriptor and a fabric handle, and the page tokens.
  region = gpu->add_regions();
  region->set_bytes(3 << 21);
  v1::GpuPage* page = region->add_pages();
  page->set_fd(7);
  page->set_bytes(2 << 20);
  page = region->add_pages();
  page->set_fabric_handle("fabric");
  page->set_bytes(4 << 20);
  gpu->add_page_tokens("t1");
  gpu->add_page_tokens("t2");
  CKPT_ASSERT_OK_AND_ASSIGN(g, RegistrationOf(req));
  ASSERT_EQ(g.gpu->regions.size(), 2u);
  const GpuRegion& run = g.gpu->regions[1];
  ASSERT_EQ(run.pages.size(), 2u);
  EXPECT_EQ(run.pages[0].fd, 7u);
  EXPECT_TRUE(run.pages[0].fabric_handle.empty());
  EXPECT_EQ(run.pages[0].bytes, 2u << 20);
  EXPECT_EQ(run.pages[1].fabric_handle, "fabric");
  EXPECT_EQ(run.pages[1].bytes, 4u << 20);
  EXPECT_EQ(g.gpu->page_tokens, (std::vector<std::string>{"t1", "t2"}));
}

TEST(ConvertTest, UnknownKindsAreRefusedAndUnknownDtypesLeftToValidation) {
  v1::RegisterRequest req = OneTensorRequest();
  req.mutable_policy()->set_kind(static_cast<v1::PolicyKind>(99));
  CKPT_EXPECT_CODE(RegistrationOf(req), kInvalidArgument);
  req.mutable_policy()->set_kind(v1::POLICY_UNSPECIFIED);
  req.mutable_policy()->set_optimizer(static_cast<v1::OptimizerKind>(42));
  CKPT_EXPECT_CODE(RegistrationOf(req), kInvalidArgument);
  req.mutable_policy()->set_optimizer(v1::OPTIMIZER_UNSPECIFIED);
  req.mutable_layers(0)->mutable_tensors(0)->set_dtype(static_cast<v1::DType>(77));
  CKPT_ASSERT_OK_AND_ASSIGN(Registration r, RegistrationOf(req));
  EXPECT_EQ(r.policy.selection.kind, PolicyKind::kAll);  // unspecified: the default
  EXPECT_EQ(ElementBytes(r.layers[0].tensors[0].dtype), 0u);
  absl::Status s = ValidateRegistration(r, {1 << 20, 1 << 20, 1 << 20}, RegistrationLimits{});
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("unknown dtype"), std::string::npos) << s;
}

TEST(ConvertTest, PlansAndRestoresBecomeReplies) {
  Restored restored;
  CompositePlan& plan = restored.plan;
  plan.job = "job";
  plan.rank = 3;
  plan.target_step = 30;
  plan.complete = false;
  plan.total_bytes = 100;
  plan.size_weighted_staleness = 2.5;
  plan.max_staleness = 5;
  plan.aux = std::string("a\0b", 3);
  PlannedLayer& l0 = plan.layers.emplace_back();
  l0.layer = 0;
  l0.name = "emb";
  l0.has_version = true;
  l0.step = 25;
  l0.staleness = 5;
  l0.bytes = 100;
  l0.file = "f";
  l0.group_steps.push_back(GroupStep{1, 24});
  PlannedLayer& l1 = plan.layers.emplace_back();
  l1.layer = 1;
  l1.name = "head";
  restored.bytes = 100;
  restored.seconds = 0.25;
  const v1::RestoreReply reply = ToProto(restored);
  EXPECT_EQ(reply.bytes_restored(), 100u);
  EXPECT_DOUBLE_EQ(reply.seconds(), 0.25);
  const v1::Plan& p = reply.plan();
  EXPECT_EQ(p.job_id(), "job");
  EXPECT_EQ(p.rank(), 3u);
  EXPECT_EQ(p.target_step(), 30u);
  EXPECT_FALSE(p.complete());
  EXPECT_EQ(p.total_bytes(), 100u);
  EXPECT_DOUBLE_EQ(p.size_weighted_staleness(), 2.5);
  EXPECT_EQ(p.max_staleness(), 5u);
  EXPECT_EQ(p.aux(), plan.aux);
  ASSERT_EQ(p.layers_size(), 2);
  EXPECT_EQ(p.layers(0).name(), "emb");
  EXPECT_TRUE(p.layers(0).has_version());
  EXPECT_EQ(p.layers(0).step(), 25u);
  EXPECT_EQ(p.layers(0).staleness(), 5u);
  EXPECT_EQ(p.layers(0).bytes(), 100u);
  EXPECT_EQ(p.layers(0).file(), "f");
  ASSERT_EQ(p.layers(0).group_steps_size(), 1);
  EXPECT_EQ(p.layers(0).group_steps(0).group(), 1u);
  EXPECT_EQ(p.layers(0).group_steps(0).step(), 24u);
  EXPECT_EQ(p.layers(1).layer(), 1u);
  EXPECT_FALSE(p.layers(1).has_version());
}

}  // namespace
}  // namespace ckpt
