// Conversions into the store's own table types (ckpt.store, store.proto):
// from the daemon's tensor types (daemon/common/tensor_types.h), and out of
// them into the public API's (ckpt.v1) for the replies that describe stored
// tensors (export, the admin queries). The enums of all three carry the
// numbers of one table each (base/dtype.h for DType, tensor_types.h for
// TensorRole and LayerKind), so these are casts; a value without a row stays
// the same unknown number. The domain-to-store direction has no other
// converter; store-to-domain is not needed (what is read back from disk is
// used as store types or sent out as ckpt.v1).
//
// Thread-safety: pure functions.
#pragma once

#include "ckpt/v1/ckpt.pb.h"
#include "daemon/common/tensor_types.h"
#include "daemon/recovery/plan.h"
#include "daemon/store/store.pb.h"

namespace ckpt {

store::DType ToStore(DType dtype);
store::TensorRole ToStore(TensorRole role);
store::LayerKind ToStore(LayerKind kind);

v1::DType ToApi(store::DType dtype);
v1::TensorRole ToApi(store::TensorRole role);
v1::LayerKind ToApi(store::LayerKind kind);
v1::Plan ToApi(const CompositePlan& plan);

}  // namespace ckpt
