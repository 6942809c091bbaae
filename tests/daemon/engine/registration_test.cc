// Tests of daemon/engine/registration: Register request validation.
#include "daemon/engine/registration.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "daemon/common/validate.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/schema_convert.h"
#include "daemon/rpc/convert.h"
#include "daemon/store/format.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

constexpr uint64_t kRegion = 1 << 16;

// Two layers of two F32 [4, 8] tensors (128 bytes) packed into region 0.
v1::RegisterRequest ValidRequest() {
  v1::RegisterRequest req;
  req.set_job_id("job-1");
  req.set_rank(1);
  req.set_world_size(4);
  uint64_t offset = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    v1::LayerSpec* layer = req.add_layers();
    layer->set_id(l);
    layer->set_name("layer" + std::to_string(l));
    for (int t = 0; t < 2; ++t) {
      v1::TensorSpec* ts = layer->add_tensors();
      ts->set_name(t == 0 ? "weight" : "bias");
      ts->set_dtype(v1::DTYPE_F32);
      ts->add_shape(4);
      ts->add_shape(8);
      ts->set_nbytes(128);
      ts->set_region(0);
      ts->set_offset(offset);
      offset += 128;
    }
  }
  return req;
}

RegistrationLimits Limits() {
  RegistrationLimits limits;
  limits.max_layer_file_bytes = 1 << 20;
  return limits;
}

// Converts the request the way the gRPC handler does, then validates.
absl::Status Validate(const v1::RegisterRequest& req,
                      const std::vector<uint64_t>& regions = {kRegion},
                      const RegistrationLimits& limits = Limits()) {
  absl::StatusOr<Registration> registration = RegistrationOf(req);
  if (!registration.ok()) return registration.status();
  return ValidateRegistration(*registration, regions, limits);
}

// Applies `mutate` to a valid request and expects INVALID_ARGUMENT.
void ExpectInvalid(const std::function<void(v1::RegisterRequest*)>& mutate,
                   const std::vector<uint64_t>& regions = {kRegion}) {
  v1::RegisterRequest req = ValidRequest();
  mutate(&req);
  CKPT_EXPECT_CODE(Validate(req, regions), kInvalidArgument);
}

v1::TensorSpec* Tensor(v1::RegisterRequest* req, int layer, int tensor) {
  return req->mutable_layers(layer)->mutable_tensors(tensor);
}

TEST(ValidateRegistrationTest, ValidRequestPasses) {
  CKPT_EXPECT_OK(Validate(ValidRequest()));
  // Without a pool limit too.
  CKPT_EXPECT_OK(Validate(ValidRequest(), {kRegion}, RegistrationLimits()));
}

TEST(ValidateRegistrationTest, BadJobId) {
  for (const char* id : {"", "..", "a/b", "a b"}) {
    ExpectInvalid([id](v1::RegisterRequest* r) { r->set_job_id(id); });
  }
}

TEST(ValidateRegistrationTest, RankAndWorldSize) {
  ExpectInvalid([](v1::RegisterRequest* r) { r->set_rank(4); });
  ExpectInvalid([](v1::RegisterRequest* r) { r->set_rank(5); });
  ExpectInvalid([](v1::RegisterRequest* r) {
    r->set_rank(0);
    r->set_world_size(0);
  });
  v1::RegisterRequest req = ValidRequest();
  req.set_rank(3);
  CKPT_EXPECT_OK(Validate(req));
}

TEST(ValidateRegistrationTest, ZeroLayers) {
  ExpectInvalid([](v1::RegisterRequest* r) { r->clear_layers(); });
}

TEST(ValidateRegistrationTest, LayerIdsMustBeDense) {
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(1)->set_id(2); });
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(0)->set_id(1); });
  ExpectInvalid([](v1::RegisterRequest* r) {
    r->mutable_layers(0)->set_id(1);
    r->mutable_layers(1)->set_id(0);
  });
}

TEST(ValidateRegistrationTest, LayerNames) {
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(1)->set_name("layer0"); });
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(0)->set_name(""); });
}

TEST(ValidateRegistrationTest, TensorNames) {
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 1)->set_name("weight"); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 1)->set_name(""); });
  // The same name in different layers is fine.
  v1::RegisterRequest req = ValidRequest();
  CKPT_EXPECT_OK(Validate(req));
  EXPECT_EQ(req.layers(0).tensors(0).name(), req.layers(1).tensors(0).name());
}

// Regression: names were unbounded (layers) and could hold control
// characters, which ckptctl printed raw into the terminal; and the validation
// built a message embedding the layer name for every tensor, so a 1 MiB name
// in a request of many tensors cost gigabytes before any check failed.
TEST(ValidateRegistrationTest, NamesAreBoundedAndPrintable) {
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(0)->set_name("\x1b[31mred"); });
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(0)->set_name("a\nb"); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 0)->set_name("w\x7f"); });
  ExpectInvalid([](v1::RegisterRequest* r) {
    r->mutable_layers(0)->set_name(std::string(kMaxNameLength + 1, 'n'));
  });
  ExpectInvalid([](v1::RegisterRequest* r) {
    Tensor(r, 1, 0)->set_name(std::string(kMaxNameLength + 1, 't'));
  });
  v1::RegisterRequest req = ValidRequest();
  req.mutable_layers(0)->set_name(std::string(kMaxNameLength, 'n'));  // at the bound: fine
  req.mutable_layers(1)->set_name("blocks.1 (attn) \xc3\xa9");        // UTF-8 is printable
  CKPT_EXPECT_OK(Validate(req));

  v1::RegisterRequest huge = ValidRequest();
  huge.mutable_layers(0)->set_name(std::string(1 << 20, 'x'));
  absl::Status s = Validate(huge);
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_LT(s.message().size(), 200u) << "the message must not repeat the name";
}

TEST(ValidateRegistrationTest, LayerWithoutTensors) {
  ExpectInvalid([](v1::RegisterRequest* r) { r->mutable_layers(1)->clear_tensors(); });
}

TEST(ValidateRegistrationTest, ZeroSizeTensor) {
  ExpectInvalid([](v1::RegisterRequest* r) {
    Tensor(r, 0, 0)->clear_shape();
    Tensor(r, 0, 0)->add_shape(0);
    Tensor(r, 0, 0)->set_nbytes(0);
  });
}

TEST(ValidateRegistrationTest, NbytesMustMatchShapeAndDtype) {
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 0)->set_nbytes(127); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 0)->set_nbytes(64); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 0)->set_dtype(v1::DTYPE_F16); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->add_shape(2); });
  // Product overflow must not wrap around to a matching size.
  ExpectInvalid([](v1::RegisterRequest* r) {
    v1::TensorSpec* t = Tensor(r, 0, 0);
    t->clear_shape();
    t->add_shape(uint64_t{1} << 32);
    t->add_shape(uint64_t{1} << 32);
    t->add_shape(32);
    t->set_dtype(v1::DTYPE_U8);
    t->set_nbytes(128);
  });
  // The same bytes as F16 [8, 8] or U8 [128] are fine.
  v1::RegisterRequest req = ValidRequest();
  v1::TensorSpec* t = Tensor(&req, 0, 0);
  t->set_dtype(v1::DTYPE_F16);
  t->clear_shape();
  t->add_shape(8);
  t->add_shape(8);
  CKPT_EXPECT_OK(Validate(req));
  t->set_dtype(v1::DTYPE_U8);
  t->clear_shape();
  t->add_shape(128);
  CKPT_EXPECT_OK(Validate(req));
  // A scalar: no dimensions, one element.
  t->set_dtype(v1::DTYPE_F64);
  t->clear_shape();
  t->set_nbytes(8);
  CKPT_EXPECT_OK(Validate(req));
}

TEST(ValidateRegistrationTest, UnknownDtype) {
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 0)->set_dtype(v1::DTYPE_UNSPECIFIED); });
  ExpectInvalid(
      [](v1::RegisterRequest* r) { Tensor(r, 0, 0)->set_dtype(static_cast<v1::DType>(99)); });
}

TEST(ValidateRegistrationTest, RegionIndexOutOfRange) {
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 0)->set_region(1); });
  ExpectInvalid([](v1::RegisterRequest* r) {}, {});
}

TEST(ValidateRegistrationTest, TensorMustLieInsideItsRegion) {
  // Ending exactly at the region's end is fine.
  v1::RegisterRequest req = ValidRequest();
  Tensor(&req, 1, 1)->set_offset(kRegion - 128);
  CKPT_EXPECT_OK(Validate(req));
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->set_offset(kRegion - 127); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->set_offset(kRegion); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->set_offset(kRegion + 4096); });
  // offset + nbytes overflows uint64.
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->set_offset(UINT64_MAX - 10); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->set_offset(UINT64_MAX - 127); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 1)->set_offset(UINT64_MAX); });
  // The region is smaller than the tensors.
  ExpectInvalid([](v1::RegisterRequest* r) {}, {256});
}

TEST(ValidateRegistrationTest, OverlapInTheSameRegion) {
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 1)->set_offset(64); });
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 0, 1)->set_offset(0); });
  // Across layers.
  ExpectInvalid([](v1::RegisterRequest* r) { Tensor(r, 1, 0)->set_offset(200); });
  // One tensor inside a later, larger one.
  ExpectInvalid([](v1::RegisterRequest* r) {
    v1::TensorSpec* big = Tensor(r, 1, 1);
    big->set_dtype(v1::DTYPE_U8);
    big->clear_shape();
    big->add_shape(4096);
    big->set_nbytes(4096);
    big->set_offset(0);
    for (int l = 0; l < 2; ++l) {
      for (int t = 0; t < 2; ++t) {
        if (l == 1 && t == 1) continue;
        Tensor(r, l, t)->set_offset(8192 + 128 * (2 * l + t));
      }
    }
    Tensor(r, 0, 1)->set_offset(1024);  // inside big
  });
}

TEST(ValidateRegistrationTest, SameOffsetsInDifferentRegionsAreFine) {
  v1::RegisterRequest req = ValidRequest();
  for (int l = 0; l < 2; ++l) {
    for (int t = 0; t < 2; ++t) {
      Tensor(&req, l, t)->set_region(static_cast<uint32_t>(2 * l + t));
      Tensor(&req, l, t)->set_offset(0);
    }
  }
  CKPT_EXPECT_OK(Validate(req, {128, 128, 128, 128}));
  // Adjacent tensors in one region do not overlap either.
  CKPT_EXPECT_OK(Validate(ValidRequest(), {512}));
}

TEST(ValidateRegistrationTest, LayerLargerThanThePool) {
  RegistrationLimits limits = Limits();
  // Header 4096 + payload 4096 + one page of slack for per-version header growth.
  limits.max_layer_file_bytes = 8192;
  CKPT_EXPECT_CODE(Validate(ValidRequest(), {kRegion}, limits), kInvalidArgument);
  limits.max_layer_file_bytes = 12288;
  CKPT_EXPECT_OK(Validate(ValidRequest(), {kRegion}, limits));
  // A big tensor pushes its layer over the limit.
  v1::RegisterRequest req = ValidRequest();
  v1::TensorSpec* t = Tensor(&req, 1, 1);
  t->set_dtype(v1::DTYPE_U8);
  t->clear_shape();
  t->add_shape(8192);
  t->set_nbytes(8192);
  CKPT_EXPECT_CODE(Validate(req, {kRegion}, limits), kInvalidArgument);
}

// Regression (found while checking tests/fuzz/register_fuzzer.cc's staging
// oracle): the staging check sized a layer's header from tensor names, shapes
// and sizes only, but each version's header also carries every tensor's dtype,
// role and group, the rank, layer, step, generation and group steps. With
// 1000 tensors that is ~10 bytes each, more than the page of slack, so a layer
// was accepted whose file never fits the pool: every snapshot of it skipped.
TEST(ValidateRegistrationTest, StagingCheckCountsEveryFieldOfAVersionHeader) {
  v1::RegisterRequest req;
  req.set_job_id("job-1");
  req.set_world_size(1);
  v1::LayerSpec* layer = req.add_layers();
  layer->set_name("wide");
  store::LayerFileHeader h;  // a version's header as Engine::Snapshot writes it, at its widest
  h.set_job_id(req.job_id());
  h.set_layer_name(layer->name());
  h.set_step(~uint64_t{0});
  h.set_generation(~uint64_t{0});
  for (int i = 0; i < 1000; ++i) {
    v1::TensorSpec* t = layer->add_tensors();
    t->set_name("t" + std::to_string(i));
    t->set_dtype(v1::DTYPE_U8);
    t->add_shape(1);
    t->set_nbytes(1);
    t->set_offset(64 * static_cast<uint64_t>(i));
    t->set_role(v1::ROLE_OTHER);
    t->set_group(0xFFFFFFFF);
    store::TensorEntry* e = h.add_tensors();
    e->set_name(t->name());
    e->set_dtype(ToStore(DType::kU8));
    *e->mutable_shape() = t->shape();
    e->set_role(ToStore(TensorRole::kOther));
    e->set_group(t->group());
    e->set_nbytes(t->nbytes());
  }
  store::GroupStep* gs = h.add_group_steps();
  gs->set_group(0xFFFFFFFF);
  gs->set_step(~uint64_t{0});
  CKPT_ASSERT_OK_AND_ASSIGN(VersionLayout need, PlanLayout(&h));
  RegistrationLimits limits = Limits();
  limits.max_layer_file_bytes = need.file_bytes - kDirectAlignment;  // a page short
  CKPT_EXPECT_CODE(Validate(req, {kRegion}, limits), kInvalidArgument);
  limits.max_layer_file_bytes = need.file_bytes + kDirectAlignment;  // the page of slack
  CKPT_EXPECT_OK(Validate(req, {kRegion}, limits));
}

TEST(ValidateRegistrationTest, CountLimits) {
  RegistrationLimits limits = Limits();
  limits.max_layers = 1;
  CKPT_EXPECT_CODE(Validate(ValidRequest(), {kRegion}, limits), kInvalidArgument);
  limits = Limits();
  limits.max_tensors_per_layer = 1;
  CKPT_EXPECT_CODE(Validate(ValidRequest(), {kRegion}, limits), kInvalidArgument);
  limits = Limits();
  limits.max_world_size = 3;
  CKPT_EXPECT_CODE(Validate(ValidRequest(), {kRegion}, limits), kInvalidArgument);
}

}  // namespace
}  // namespace ckpt
