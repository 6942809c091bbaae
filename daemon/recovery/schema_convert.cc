#include "daemon/recovery/schema_convert.h"

namespace ckpt {
namespace {

template <typename A, typename B>
constexpr bool Same(A a, B b) {
  return static_cast<int>(a) == static_cast<int>(b);
}

// Every value of each enum pair has the same number.
static_assert(Same(v1::DType_MIN, store::DType_MIN) &&
              Same(v1::DType_MAX, store::DType_MAX) &&
              Same(v1::DTYPE_F32, store::DTYPE_F32) &&
              Same(v1::DTYPE_F16, store::DTYPE_F16) &&
              Same(v1::DTYPE_BF16, store::DTYPE_BF16) &&
              Same(v1::DTYPE_F64, store::DTYPE_F64) &&
              Same(v1::DTYPE_I64, store::DTYPE_I64) &&
              Same(v1::DTYPE_I32, store::DTYPE_I32) &&
              Same(v1::DTYPE_U8, store::DTYPE_U8));
static_assert(Same(v1::TensorRole_MIN, store::TensorRole_MIN) &&
              Same(v1::TensorRole_MAX, store::TensorRole_MAX) &&
              Same(v1::ROLE_PARAM, store::ROLE_PARAM) &&
              Same(v1::ROLE_MASTER, store::ROLE_MASTER) &&
              Same(v1::ROLE_EXP_AVG, store::ROLE_EXP_AVG) &&
              Same(v1::ROLE_EXP_AVG_SQ, store::ROLE_EXP_AVG_SQ) &&
              Same(v1::ROLE_MOMENTUM, store::ROLE_MOMENTUM) &&
              Same(v1::ROLE_OTHER, store::ROLE_OTHER));
static_assert(Same(DType::kF32, store::DTYPE_F32) && Same(DType::kF16, store::DTYPE_F16) &&
              Same(DType::kBF16, store::DTYPE_BF16) && Same(DType::kF64, store::DTYPE_F64) &&
              Same(DType::kI64, store::DTYPE_I64) && Same(DType::kI32, store::DTYPE_I32) &&
              Same(DType::kU8, store::DTYPE_U8) && Same(store::DType_MAX, DType::kU8));
static_assert(Same(TensorRole::kParam, store::ROLE_PARAM) &&
              Same(TensorRole::kMaster, store::ROLE_MASTER) &&
              Same(TensorRole::kExpAvg, store::ROLE_EXP_AVG) &&
              Same(TensorRole::kExpAvgSq, store::ROLE_EXP_AVG_SQ) &&
              Same(TensorRole::kMomentum, store::ROLE_MOMENTUM) &&
              Same(TensorRole::kOther, store::ROLE_OTHER) &&
              Same(store::TensorRole_MAX, TensorRole::kOther));
static_assert(Same(LayerKind::kEmbedding, store::LAYER_EMBEDDING) &&
              Same(LayerKind::kBlock, store::LAYER_BLOCK) && Same(LayerKind::kNorm, store::LAYER_NORM) &&
              Same(LayerKind::kHead, store::LAYER_HEAD) && Same(LayerKind::kOther, store::LAYER_OTHER) &&
              Same(store::LayerKind_MAX, LayerKind::kOther));
static_assert(Same(v1::LayerKind_MIN, store::LayerKind_MIN) &&
              Same(v1::LayerKind_MAX, store::LayerKind_MAX) &&
              Same(v1::LAYER_EMBEDDING, store::LAYER_EMBEDDING) &&
              Same(v1::LAYER_BLOCK, store::LAYER_BLOCK) &&
              Same(v1::LAYER_NORM, store::LAYER_NORM) &&
              Same(v1::LAYER_HEAD, store::LAYER_HEAD) &&
              Same(v1::LAYER_OTHER, store::LAYER_OTHER));

}  // namespace

store::DType ToStore(DType dtype) { return static_cast<store::DType>(dtype); }
store::TensorRole ToStore(TensorRole role) { return static_cast<store::TensorRole>(role); }
store::LayerKind ToStore(LayerKind kind) { return static_cast<store::LayerKind>(kind); }

v1::DType ToApi(store::DType dtype) { return static_cast<v1::DType>(dtype); }
v1::TensorRole ToApi(store::TensorRole role) { return static_cast<v1::TensorRole>(role); }
v1::LayerKind ToApi(store::LayerKind kind) { return static_cast<v1::LayerKind>(kind); }

v1::Plan ToApi(const CompositePlan& plan) {
  v1::Plan out;
  out.set_job_id(plan.job);
  out.set_rank(plan.rank);
  out.set_target_step(plan.target_step);
  out.set_complete(plan.complete);
  for (const PlannedLayer& lp : plan.layers) {
    v1::LayerPlan* l = out.add_layers();
    l->set_layer(lp.layer);
    l->set_name(lp.name);
    l->set_has_version(lp.has_version);
    l->set_step(lp.step);
    l->set_staleness(lp.staleness);
    l->set_bytes(lp.bytes);
    l->set_file(lp.file);
    for (const GroupStep& g : lp.group_steps) {
      v1::GroupStep* gs = l->add_group_steps();
      gs->set_group(g.group);
      gs->set_step(g.step);
    }
  }
  out.set_total_bytes(plan.total_bytes);
  out.set_size_weighted_staleness(plan.size_weighted_staleness);
  out.set_max_staleness(plan.max_staleness);
  out.set_aux(plan.aux);
  return out;
}

}  // namespace ckpt
