#include "daemon/recovery/schema_convert.h"

namespace ckpt {
// Both protos and the daemon's enums give each value the same number
// (base/dtype.h, daemon/common/tensor_types.h), so every conversion below is
// a cast. The highest numbers are checked here; every name and number by
// tests/base/dtype_test.cc and tests/daemon/common/tensor_types_test.cc.
static_assert(store::DType_MIN == 0 && store::DType_MAX == kMaxDTypeNumber,
              "ckpt.store.DType and base/dtype.h differ");
static_assert(store::TensorRole_MIN == 0 && store::TensorRole_MAX == kMaxTensorRoleNumber,
              "ckpt.store.TensorRole and daemon/common/tensor_types.h differ");
static_assert(store::LayerKind_MIN == 0 && store::LayerKind_MAX == kMaxLayerKindNumber,
              "ckpt.store.LayerKind and daemon/common/tensor_types.h differ");
static_assert(v1::DType_MAX == kMaxDTypeNumber && v1::TensorRole_MAX == kMaxTensorRoleNumber &&
                  v1::LayerKind_MAX == kMaxLayerKindNumber,
              "ckpt.v1 and the daemon's tables differ");

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
    l->set_lost_step(lp.lost_step);
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
