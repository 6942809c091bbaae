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
static_assert(Same(v1::LayerKind_MIN, store::LayerKind_MIN) &&
              Same(v1::LayerKind_MAX, store::LayerKind_MAX) &&
              Same(v1::LAYER_EMBEDDING, store::LAYER_EMBEDDING) &&
              Same(v1::LAYER_BLOCK, store::LAYER_BLOCK) &&
              Same(v1::LAYER_NORM, store::LAYER_NORM) &&
              Same(v1::LAYER_HEAD, store::LAYER_HEAD) &&
              Same(v1::LAYER_OTHER, store::LAYER_OTHER));

}  // namespace

store::DType ToStore(v1::DType dtype) { return static_cast<store::DType>(dtype); }
store::TensorRole ToStore(v1::TensorRole role) { return static_cast<store::TensorRole>(role); }
store::LayerKind ToStore(v1::LayerKind kind) { return static_cast<store::LayerKind>(kind); }

store::LayerSpec ToStore(const v1::LayerSpec& layer) {
  store::LayerSpec out;
  out.set_id(layer.id());
  out.set_name(layer.name());
  out.set_kind(ToStore(layer.kind()));
  for (const v1::TensorSpec& t : layer.tensors()) {
    store::TensorSpec* s = out.add_tensors();
    s->set_name(t.name());
    s->set_dtype(ToStore(t.dtype()));
    *s->mutable_shape() = t.shape();
    s->set_nbytes(t.nbytes());
    s->set_role(ToStore(t.role()));
    s->set_region(t.region());
    s->set_offset(t.offset());
    s->set_group(t.group());
    s->set_param(t.param());
    s->set_lr_scale(t.lr_scale());
    s->set_beta1(t.beta1());
    s->set_beta2(t.beta2());
    s->set_eps(t.eps());
    s->set_weight_decay(t.weight_decay());
  }
  return out;
}

v1::DType ToApi(store::DType dtype) { return static_cast<v1::DType>(dtype); }
v1::TensorRole ToApi(store::TensorRole role) { return static_cast<v1::TensorRole>(role); }
v1::LayerKind ToApi(store::LayerKind kind) { return static_cast<v1::LayerKind>(kind); }

v1::GroupStep ToApi(const store::GroupStep& group_step) {
  v1::GroupStep out;
  out.set_group(group_step.group());
  out.set_step(group_step.step());
  return out;
}

}  // namespace ckpt
