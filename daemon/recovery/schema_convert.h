// Conversions between the public API's table types (ckpt.v1) and the
// store's own (ckpt.store, store.proto), in one place. The two started as
// copies with the same enum numbers and field numbers; the static_asserts
// in schema_convert.cc fail the build if one of them changes alone.
//
// Used by the engine (registration writes the table) and by export (which
// describes stored tensors in API terms). Thread-safety: pure functions.
#pragma once

#include "ckpt/v1/ckpt.pb.h"
#include "daemon/store/store.pb.h"

namespace ckpt {

store::DType ToStore(v1::DType dtype);
store::TensorRole ToStore(v1::TensorRole role);
store::LayerKind ToStore(v1::LayerKind kind);
store::LayerSpec ToStore(const v1::LayerSpec& layer);

v1::DType ToApi(store::DType dtype);
v1::TensorRole ToApi(store::TensorRole role);
v1::LayerKind ToApi(store::LayerKind kind);
v1::GroupStep ToApi(const store::GroupStep& group_step);

}  // namespace ckpt
