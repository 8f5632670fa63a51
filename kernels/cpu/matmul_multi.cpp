// matmul_multi: the per-row dot kernels (or the packed tile kernels) of the active kernel table (qkernels.h, owned by the GEMM
// code) driven over the rows of several matrices at once. Row chunks and the kernel called per row
// are those matmul() uses for few columns, so each output is the same bits as matmul() gives.
#include "kernels/cpu/matmul_multi.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "gguf/error.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/qkernels.h"

namespace baton::cpu {

namespace {

const KernelTable& active_table() {
  switch (active_isa()) {
    case Isa::Avx512: return kernels_avx512();
    case Isa::Avx2: return kernels_avx2();
    case Isa::Scalar: break;
  }
  return kernels_scalar();
}

// Which target a task of a fused job works on: the parts list their first tasks in order.
template <class Part>
int part_of(const Part* parts, int n_parts, int task) {
  int i = n_parts - 1;
  while (parts[i].first_task > task) --i;
  return i;
}
constexpr int kFusedMaxCols = 4;
constexpr int kSmallBatchCols = 64;

}  // namespace

// Packed targets, any column count: the activations quantized once (shared by every target), then
// one job over all targets' groups of 16 rows. Few columns: chunks sized for balance, each group
// streamed once. Many columns: chunks that stay in L2 while the column tiles of 8 pass over them.
void matmul_packed_targets(const MatmulTarget* targets, int n_targets, const float* X, int n, ThreadPool& pool,
                           const RowFn* pre) {
  BATON_CHECK(n >= 1 && n_targets >= 1 && n_targets <= kMaxTargets);
  const KernelTable& kt = active_table();
  const int64_t cols = targets[0].W->cols, nb = cols / 32;
  const QuantFn quant = kt.quant[int(ActKind::Q8_32s)] ? kt.quant[int(ActKind::Q8_32s)] : quant_q8_32s_portable;
  const size_t a_stride = act_bytes(ActKind::Q8_32s, cols), f_stride = act_bytes(ActKind::Float, cols);
  // The float tiles (F16, BF16) read the columns as they are; the others their 8-bit blocks.
  bool any_quant = false;
  for (int i = 0; i < n_targets; ++i) any_quant = any_quant || !packed_float(targets[i].W->type);
  // The distinct inputs (the shared X, or the targets' own), each quantized once.
  const float* inputs[kMaxTargets];
  int input_of[kMaxTargets], n_inputs = 0;
  for (int i = 0; i < n_targets; ++i) {
    const float* xi = targets[i].X ? targets[i].X : X;
    BATON_CHECK(!(pre && targets[i].X));
    int k = 0;
    while (k < n_inputs && inputs[k] != xi) ++k;
    if (k == n_inputs) inputs[n_inputs++] = xi;
    input_of[i] = k;
  }
  const size_t a_input = a_stride * size_t(n);
  thread_local std::vector<uint8_t> scratch;  // only grows
  if (any_quant && scratch.size() < a_input * size_t(n_inputs)) scratch.resize(a_input * size_t(n_inputs));
  uint8_t* A = scratch.data();
  auto quant_task = [&](int task, int) {
    const int k = task / n, j = task % n;
    if (pre) (*pre)(j);
    quant(inputs[k] + int64_t(j) * cols, cols, A + size_t(k) * a_input + size_t(j) * a_stride);
  };
  if (!any_quant) {
    if (pre) run_rows(*pre, n, pool);
  } else if (n * n_inputs >= 4 && pool.size() > 1) {
    pool.run(n * n_inputs, std::ref(quant_task));
  } else {
    for (int t = 0; t < n * n_inputs; t++) quant_task(t, 0);
  }

  struct Part {
    PackedFn kernel;
    const uint8_t* a;  // the first column's activations (8-bit blocks, or the floats)
    size_t a_stride;
    int64_t groups, chunk;
    size_t group_bytes;
    int first_task;
  };
  Part parts[kMaxTargets];
  int n_tasks = 0;
  for (int i = 0; i < n_targets; ++i) {
    const QMatrix& W = *targets[i].W;
    BATON_CHECK(W.packed && W.cols == cols && int(W.type) < kTypeSlots);
    Part& p = parts[i];
    p.kernel = kt.packed[int(W.type)] ? kt.packed[int(W.type)] : packed_portable(W.type);
    BATON_CHECK(p.kernel != nullptr);
    if (packed_float(W.type)) {
      p.a = reinterpret_cast<const uint8_t*>(inputs[input_of[i]]);
      p.a_stride = f_stride;
    } else {
      p.a = A + size_t(input_of[i]) * a_input;
      p.a_stride = a_stride;
    }
    p.groups = (W.rows + kPackRows - 1) / kPackRows;
    p.group_bytes = packed_group_bytes(W.type, cols);
    if (n <= kPackedMaxCols) {
      p.chunk = std::max<int64_t>(1, p.groups / (int64_t(pool.size()) * 8));
    } else {
      // A batch's decode step (up to kSmallBatchCols columns) is a string of short jobs whose
      // threads wait for the slowest at every barrier: 16 tasks per thread keep that wait to a
      // sliver of a task. Longer jobs (prefill) keep bigger chunks, which re-read the columns less.
      const int per_thread = n <= kSmallBatchCols ? 16 : 4;
      p.chunk = std::clamp<int64_t>(int64_t(256 * 1024 / std::max<size_t>(p.group_bytes, 1)), 1, 16);
      while (p.chunk > 1 && (p.groups + p.chunk - 1) / p.chunk < per_thread * pool.size()) p.chunk /= 2;
    }
    p.first_task = n_tasks;
    n_tasks += int((p.groups + p.chunk - 1) / p.chunk);
  }

  auto body = [&](int task, int) {
    const int i = part_of(parts, n_targets, task);
    const Part& p = parts[i];
    const QMatrix& W = *targets[i].W;
    const size_t y_stride = size_t(W.rows);
    const int64_t g0 = int64_t(task - p.first_task) * p.chunk, g1 = std::min(p.groups, g0 + p.chunk);
    for (int j = 0; j < n; j += kPackedMaxCols) {
      const int nc = std::min(kPackedMaxCols, n - j);
      for (int64_t g = g0; g < g1; g++) {
        const int64_t r0 = g * kPackRows;
        p.kernel(nb, W.packed + size_t(g) * p.group_bytes, p.a + size_t(j) * p.a_stride, p.a_stride, nc,
                 targets[i].Y + size_t(j) * y_stride + size_t(r0), y_stride,
                 int(std::min<int64_t>(kPackRows, W.rows - r0)));
      }
    }
  };
  pool.run(n_tasks, std::ref(body));
}

void matmul_multi(const MatmulTarget* targets, int n_targets, const float* X, int n, ThreadPool& pool,
                  const RowFn* pre) {
  BATON_CHECK(n >= 1 && n_targets >= 1);
  bool all_packed = n_targets <= kMaxTargets;
  for (int i = 0; i < n_targets && all_packed; ++i)
    all_packed = targets[i].W->packed != nullptr && targets[i].W->cols == targets[0].W->cols;
  if (all_packed) return matmul_packed_targets(targets, n_targets, X, n, pool, pre);
  if (pre) run_rows(*pre, n, pool);
  auto input = [&](int i) { return targets[i].X ? targets[i].X : X; };
  if (n > kFusedMaxCols || n_targets > kMaxTargets || n_targets == 1) {
    for (int i = 0; i < n_targets; ++i) matmul(*targets[i].W, input(i), n, targets[i].Y, pool);
    return;
  }
  const KernelTable& kt = active_table();
  const int64_t cols = targets[0].W->cols;

  // Per target: its kernel, its activations (quantized once per format) and its row chunks.
  struct Part {
    DotFn dot;
    PackedFn packed;  // set for packed targets: tasks then cover groups of 16 rows
    const uint8_t* a;
    size_t a_stride;
    int64_t chunk;
    int first_task;
  };
  Part parts[kMaxTargets];
  thread_local std::vector<uint8_t> scratch[kMaxTargets];  // per target; only grows
  int n_tasks = 0;
  for (int i = 0; i < n_targets; ++i) {
    const QMatrix& W = *targets[i].W;
    BATON_CHECK(W.cols == cols && W.cols % traits(W.type).block_elems == 0);
    BATON_CHECK(W.row_bytes == row_bytes(W.type, W.cols));
    BATON_CHECK(int(W.type) < kTypeSlots && (W.packed || kt.dot[int(W.type)] != nullptr));
    auto kind_of = [&](const QMatrix& M) {
      return M.packed ? (packed_float(M.type) ? ActKind::Float : ActKind::Q8_32s) : kt.act[int(M.type)];
    };
    const ActKind kind = kind_of(W);
    Part& p = parts[i];
    p.dot = kt.dot[int(W.type)];
    p.packed = W.packed ? (kt.packed[int(W.type)] ? kt.packed[int(W.type)] : packed_portable(W.type)) : nullptr;
    p.a_stride = act_bytes(kind, cols);
    const float* Xi = input(i);
    if (kind == ActKind::Float) {
      p.a = reinterpret_cast<const uint8_t*>(Xi);
    } else {
      int same = -1;  // an earlier target that already quantized this input into this format
      for (int j = 0; j < i && same < 0; ++j)
        if (input(j) == Xi && kind_of(*targets[j].W) == kind) same = j;
      if (same >= 0) {
        p.a = parts[same].a;
      } else {
        std::vector<uint8_t>& buf = scratch[i];
        if (buf.size() < p.a_stride * size_t(n)) buf.resize(p.a_stride * size_t(n));
        QuantFn q = kt.quant[int(kind)];
        if (!q && kind == ActKind::Q8_32s) q = quant_q8_32s_portable;
        for (int c = 0; c < n; ++c) q(Xi + int64_t(c) * cols, cols, buf.data() + size_t(c) * p.a_stride);
        p.a = buf.data();
      }
    }
    // Units: rows, or groups of 16 rows when packed (chunks as matmul() makes them for few columns).
    const int64_t units = W.packed ? (W.rows + kPackRows - 1) / kPackRows : W.rows;
    p.chunk = W.packed ? std::max<int64_t>(1, units / (int64_t(pool.size()) * 8))
                       : std::max<int64_t>(16, W.rows / (int64_t(pool.size()) * 8));
    p.first_task = n_tasks;
    n_tasks += int((units + p.chunk - 1) / p.chunk);
  }

  auto body = [&](int task, int) {
    const int i = part_of(parts, n_targets, task);
    const Part& p = parts[i];
    const QMatrix& W = *targets[i].W;
    const size_t y_stride = size_t(W.rows);
    if (p.packed) {
      const int64_t groups = (W.rows + kPackRows - 1) / kPackRows, nb = cols / 32;
      const size_t group_bytes = packed_group_bytes(W.type, cols);
      const int64_t g0 = int64_t(task - p.first_task) * p.chunk, g1 = std::min(groups, g0 + p.chunk);
      for (int64_t g = g0; g < g1; g++)
        p.packed(nb, W.packed + size_t(g) * group_bytes, p.a, p.a_stride, n, targets[i].Y + size_t(g * kPackRows),
                 y_stride, int(std::min<int64_t>(kPackRows, W.rows - g * kPackRows)));
      return;
    }
    const int64_t r0 = int64_t(task - p.first_task) * p.chunk, r1 = std::min(W.rows, r0 + p.chunk);
    for (int64_t r = r0; r < r1; r++) p.dot(cols, W.row(r), p.a, p.a_stride, n, targets[i].Y + size_t(r), y_stride);
  };
  pool.run(n_tasks, std::ref(body));
}

}  // namespace baton::cpu
