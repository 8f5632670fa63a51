#include "runtime/batch.h"

#include <limits>

#include "kernels/cpu/ops.h"

namespace baton {

void reduce_output_row(uint8_t mode, float* row, int n_vocab) {
  if (mode == kArgmaxOnly) {
    set_argmax_token(row, cpu::argmax(row, n_vocab));
  } else if (mode == kTopK) {
    const int K = top_k_candidates(n_vocab);
    if (K <= 0) return;
    int32_t ids[kMaxTopKCandidates];
    float vals[kMaxTopKCandidates];
    const int found = cpu::top_k(row, n_vocab, K, ids, vals);
    for (int i = found; i < K; ++i) ids[i] = 0, vals[i] = std::numeric_limits<float>::quiet_NaN();
    set_top_k_row(row, K, ids, vals);
  }
}

}  // namespace baton
