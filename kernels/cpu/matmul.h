// Quantized matrix × activations on the CPU. Contract shared by the model code and the kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/cpu/threadpool.h"
#include "quant/types.h"

namespace baton::cpu {

// A weight matrix as stored in GGUF: `rows` rows of `cols` elements (ne[0] = cols, ne[1] = rows),
// each row `row_bytes` long in `type`'s block format. A view: data is not owned.
struct QMatrix {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
  // The same matrix row-interleaved for the tiled kernels (kernels/cpu/packed.h), or null. When
  // set, matmul() reads only this; data stays the row-major view.
  const uint8_t* packed = nullptr;
  const uint8_t* row(int64_t r) const { return static_cast<const uint8_t*>(data) + r * row_bytes; }
};

// Y = W·X: X holds n column vectors of length W.cols (vector j at X + j*W.cols), Y receives n
// vectors of length W.rows (vector j at Y + j*W.rows). 1 <= n; any n works, 1..512 are tuned.
// Activations are quantized on the fly (8-bit blocks) for the integer paths.
//
// `pre`, when given, is row-local work that produces the input: pre(j) runs once for every column
// j in [0, n) before column j is read, and may write only column j of whatever it writes (the
// norm, residual add or gate that precedes a projection). The packed path runs it inside the
// job that quantizes the columns, so it is spread over the threads at no extra barrier.
using RowFn = std::function<void(int row)>;
void matmul(const QMatrix& W, const float* X, int n, float* Y, ThreadPool& pool, const RowFn* pre = nullptr);
// pre(j) for every j in [0, n): over the pool when that pays, else in order on this thread.
void run_rows(const RowFn& fn, int n, ThreadPool& pool);

// Instruction-set levels. The active level is the best the CPU supports, lowered by
// set_isa_limit() (--cpu-isa) or the BATON_CPU_ISA environment variable (scalar|avx2|avx512).
enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };
Isa detected_isa();
Isa active_isa();
void set_isa_limit(Isa limit);
const char* isa_name(Isa isa);
bool parse_isa(const char* s, Isa& out);


}  // namespace baton::cpu
