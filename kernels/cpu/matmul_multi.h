// Several weight matrices against the same activations in one pool job: decode multiplies one
// token by q, k and v (and by gate and up), and a job per matrix would cost a barrier each.
#pragma once
#include "kernels/cpu/matmul.h"

namespace baton::cpu {

struct MatmulTarget {
  const QMatrix* W = nullptr;
  float* Y = nullptr;        // n vectors of W->rows floats, as in matmul()
  const float* X = nullptr;  // this target's own n input vectors; null: the shared X
};

// Y_i = W_i·X for every target (all W_i share cols). Same results as calling matmul() per target.
// When every target is packed, each distinct input is quantized once and all targets' rows are one
// job at any column count; otherwise for n <= 4 (decode) the rows of all targets are one job, and
// above that each target is its own matmul() (prefill: the GEMMs are long enough that a barrier
// does not matter). Up to kMaxTargets targets share a job (a mixture of experts' decode step runs
// its 2 k gate/up matrices as one, then its k down matrices, each with its own input, as another).
// `pre` as in matmul(): row-local work producing the shared X, run before each column is read
// (not with targets that have their own inputs).
void matmul_multi(const MatmulTarget* targets, int n_targets, const float* X, int n, ThreadPool& pool,
                  const RowFn* pre = nullptr);

constexpr int kMaxTargets = 16;

// The packed path of matmul_multi (and of matmul() for one packed matrix): every target packed,
// 1..kMaxTargets targets of equal cols.
// pre(j) runs in the task that quantizes column j.
void matmul_packed_targets(const MatmulTarget* targets, int n_targets, const float* X, int n, ThreadPool& pool,
                           const RowFn* pre = nullptr);

}  // namespace baton::cpu
