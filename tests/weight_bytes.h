// The bytes a shape should count for a file's tensor, for test_synth and test_real_shape.
#pragma once
#include <algorithm>
#include <cstdint>

#include "gguf/gguf.h"
#include "kernels/cpu/packed.h"
#include "kernels/cuda/layout.h"
#include "quant/types.h"

namespace baton::test {

// What a tensor of a file should weigh in a shape, written out apart from weight_used_bytes: a
// matrix as the larger of a CPU stage's packed copy (whole groups of 16 rows) and a GPU stage's
// rows padded to 16 bytes; anything else its file bytes.
inline uint64_t expected_used_bytes(const gguf::TensorInfo& t) {
  uint64_t n = t.nbytes;
  if (t.nrows() > 1 && cpu::packable(t.type)) n = std::max<uint64_t>(n, cpu::packed_bytes(t.type, t.nrows(), t.ne[0]));
  if (t.nrows() > 1 && cuda::cuda_supports(t.type) && (traits(t.type).block_elems > 1 || t.ne[0] % 8 == 0))
    n = std::max<uint64_t>(n, cuda::packed_row_bytes(t.type, t.ne[0]) * t.nrows());
  return n;
}

}  // namespace baton::test
