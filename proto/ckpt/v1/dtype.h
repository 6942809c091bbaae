// Element sizes of ckpt.v1.DType, shared by the client library and ckptd.
#pragma once

#include <cstdint>

#include "ckpt/v1/ckpt.pb.h"

namespace ckpt {

// Bytes per element; 0 for DTYPE_UNSPECIFIED or an unknown value.
inline uint64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
    case v1::DTYPE_I32:
      return 4;
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16:
      return 2;
    case v1::DTYPE_F64:
    case v1::DTYPE_I64:
      return 8;
    case v1::DTYPE_U8:
      return 1;
    default:
      return 0;
  }
}

}  // namespace ckpt
