// The CUDA simulator's BF16 type (the upper half of an IEEE binary32).
#pragma once
#include <cstring>

#include "cuda_runtime.h"

struct __nv_bfloat16 { unsigned short x; };

inline float __bfloat162float(__nv_bfloat16 b) {
  const unsigned u = unsigned(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
