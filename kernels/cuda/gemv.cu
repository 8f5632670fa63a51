// Decode matmul (1..8 columns): fused dequantize + dot product, reading each weight byte once.
// A warp (or 2-4 warps, when there are too few rows to fill the GPU) owns a row; lane i takes
// units i, i+32, ... so a warp's 16-byte loads cover consecutive bytes, and `unroll` units are
// loaded before any is used so several loads per thread are in flight. The activations are
// quantized once per op to 8-bit blocks and reused by every row from L1/L2.
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.cuh"

#include <algorithm>
#include <atomic>

namespace baton::cuda {

constexpr int kGemvThreads = 128;  // 4 warps
constexpr int kGemvMaxCols = 8;
constexpr int kGemvPairMaxCols = 2;  // widest launch that pairs rows (registers: RPW × NC sums)

// One warp per 32-value block: d = max|x| / 127, q = round(x / d), plus d·Σq for the offsets.
__global__ void quantize_act_kernel(const float* __restrict__ x, int64_t n_blocks,
                                    int8_t* __restrict__ qs, float2* __restrict__ ds) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  griddep_release();  // the GEMV after this may start loading its weights
  griddep_wait();
  if (b >= n_blocks) return;  // whole warps leave together
  q8_store(x[b * 32 + lane], b * 32 + lane, qs, ds);
}

size_t q8_act_bytes(int64_t cols, int n) {
  const size_t q = (size_t(cols) * n + 255) / 256 * 256;  // keep ds 16-byte aligned
  return q + size_t(cols / 32) * n * sizeof(float2);
}

Q8Act q8_scratch(Context& c, int64_t cols, int n) {
  if (cols % 32 != 0) input_error(cat("CUDA q8_scratch: ", cols, " values per row is not a multiple of 32"));
  auto* base = static_cast<uint8_t*>(c.scratch(q8_act_bytes(cols, n)));
  return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + (size_t(cols) * n + 255) / 256 * 256)};
}

void quantize_act(Context& c, const float* x, int64_t cols, int n, int8_t* qs, float* ds) {
  if (cols % 32 != 0) input_error(cat("CUDA quantize_act: ", cols, " values per row is not a multiple of 32"));
  const int64_t blocks = cols / 32 * n;
  if (blocks == 0) return;
  launch_early(c.early_launch, quantize_act_kernel, ceil_div(blocks * 32, 256), 256,
               static_cast<cudaStream_t>(c.stream()), x, blocks, qs, reinterpret_cast<float2*>(ds));
  CUDA_CHECK_LAUNCH();
}

// Up to three matrices of one type and width that multiply the same activations (q, k and v;
// gate and up) share a launch: segment i owns blocks [block0, next block0), its rows, its Y and
// its warps per row (the same as its own launch would use, so each row sums in the same order).
constexpr int kMaxSegs = 3;
struct GemvSeg {
  const uint8_t* W;
  float* Y;
  int rows, wpr, block0;
};
struct GemvSegs {
  GemvSeg s[kMaxSegs];
  int n;
};

// RPW rows per warp (1, or 2: then every segment has a warp per row): a warp loads RPW rows'
// units before it uses any (twice the bytes in flight per warp) and reads each activation block
// once for them (the same __ldg addresses; half the activation loads per weight byte).
template <class T, int NC, int RPW>
__global__ void __launch_bounds__(kGemvThreads)
gemv_kernel(GemvSegs segs, size_t stride, int64_t cols, Act act) {
  __shared__ float part[kGemvThreads / 32][NC];
  griddep_release();  // the op after may be launched (it waits for this one to finish)
  // This block's segment, by selects (an indexed kernel parameter could go to local memory);
  // its Y is picked only at the end, to keep it out of registers during the loop.
  const int si = (segs.n > 2 && int(blockIdx.x) >= segs.s[2].block0) ? 2
                 : (segs.n > 1 && int(blockIdx.x) >= segs.s[1].block0) ? 1 : 0;
  const GemvSeg& g0 = segs.s[0];
  const GemvSeg& g1 = segs.s[1];
  const GemvSeg& g2 = segs.s[2];
  const uint8_t* __restrict__ W = si == 2 ? g2.W : si == 1 ? g1.W : g0.W;
  const int rows = si == 2 ? g2.rows : si == 1 ? g1.rows : g0.rows;
  const int wpr = RPW > 1 ? 1 : si == 2 ? g2.wpr : si == 1 ? g1.wpr : g0.wpr;
  const int block0 = si == 2 ? g2.block0 : si == 1 ? g1.block0 : g0.block0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = ((int(blockIdx.x) - block0) * (kGemvThreads / 32 / wpr) + warp / wpr) * RPW;
  const int sub = warp % wpr;
  const int n_units = int(cols / T::unit);
  const int step = 32 * wpr;

  float acc[RPW][NC];
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int j = 0; j < NC; j++) acc[r][j] = 0.0f;

  if (row < rows) {
    const uint8_t* rp[RPW];
    rp[0] = W + size_t(row) * stride;
#pragma unroll
    for (int r = 1; r < RPW; r++) rp[r] = row + r < rows ? rp[r - 1] + stride : rp[r - 1];  // a missing row: the last again
    for (int u0 = sub * 32 + lane; u0 < n_units; u0 += step * T::unroll) {
      typename T::W w[RPW][T::unroll];
#pragma unroll
      for (int k = 0; k < T::unroll; k++)  // all loads first: they overlap in flight
        if (u0 + k * step < n_units)
#pragma unroll
          for (int r = 0; r < RPW; r++) w[r][k] = T::load(rp[r], cols, u0 + k * step);
      griddep_wait();  // the activations come from the op before (weights are read-only)
#pragma unroll
      for (int k = 0; k < T::unroll; k++)
        if (u0 + k * step < n_units)
#pragma unroll
          for (int j = 0; j < NC; j++)
#pragma unroll
            for (int r = 0; r < RPW; r++) acc[r][j] += T::dot(w[r][k], act, j, u0 + k * step);
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; r++)
#pragma unroll
    for (int j = 0; j < NC; j++) acc[r][j] = warp_sum(acc[r][j]);
  float* __restrict__ Y = si == 2 ? g2.Y : si == 1 ? g1.Y : g0.Y;
  const int64_t ldy = rows;
  if (wpr == 1) {
#pragma unroll
    for (int r = 0; r < RPW; r++)
      if (row + r < rows && lane < NC) {
        float v = acc[r][0];
#pragma unroll
        for (int j = 1; j < NC; j++) if (lane == j) v = acc[r][j];
        Y[int64_t(lane) * ldy + row + r] = v;
      }
    return;
  }
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < NC; j++) part[warp][j] = acc[0][j];
  __syncthreads();
  if (sub == 0 && row < rows && lane < NC) {
    float v = 0.0f;
    for (int k = 0; k < wpr; k++) v += part[warp + k][lane];
    Y[int64_t(lane) * ldy + row] = v;
  }
}

// The streamed form (Context::gemv_stream): a grid no larger than the GPU holds at once, each warp
// a run of `per_warp` consecutive rows of all segments, each row whole in one warp (the same sums
// in the same order as one warp per row, gemv_split_rows off). The warp loads the next batch of
// units (T::unroll per lane) before it sums the current one, also across a row's end: two batches
// in flight per warp all the time, and no block starts after the first wave. Before it waits for
// the op before (launched early, while that op runs and the HBM has little to do), each warp asks
// the L2 for the first `prefetch` bytes of its run of rows (Context::gemv_prefetch_bytes over the
// grid): the weights that a wave of early blocks could otherwise only start loading one batch of.
// (Launch bounds with 1 block per SM: left to itself ptxas capped some column counts at 96 registers
// and spilled; two batches of weights in registers need more, and the grid is sized by occupancy.)
template <class T, int NC>
__global__ void __launch_bounds__(kGemvThreads, 1)
gemv_stream_kernel(GemvSegs segs, size_t stride, int64_t cols, Act act, int total, int per_warp, int prefetch) {
  griddep_release();  // the op after may be launched (it waits for this one to finish)
  const int lane = threadIdx.x % 32;
  const int first = int((int64_t(blockIdx.x) * kGemvThreads + threadIdx.x) / 32) * per_warp;
  const int end = min(first + per_warp, total);
  if (first >= end) return;  // whole warps
  const int n_units = int(cols / T::unit);
  constexpr int kBatch = 32 * T::unroll;  // units per batch of a warp
  const int n_batches = (n_units + kBatch - 1) / kBatch;
  const GemvSeg& g0 = segs.s[0];
  const GemvSeg& g1 = segs.s[1];
  const GemvSeg& g2 = segs.s[2];
  const int row1 = g0.rows, row2 = g0.rows + g1.rows;  // the first rows of segments 1 and 2
  auto seg_of = [&](int r) { return (segs.n > 2 && r >= row2) ? 2 : (segs.n > 1 && r >= row1) ? 1 : 0; };
  auto row_ptr = [&](int r) {  // fields by selects (see gemv_kernel)
    const int si = seg_of(r);
    const uint8_t* W = si == 2 ? g2.W : si == 1 ? g1.W : g0.W;
    return W + size_t(r - (si == 2 ? row2 : si == 1 ? row1 : 0)) * stride;
  };
  using Wt = typename T::W;
  auto load = [&](Wt (&w)[T::unroll], const uint8_t* rp, int b) {
#pragma unroll
    for (int k = 0; k < T::unroll; k++) {
      const int u = b * kBatch + k * 32 + lane;
      if (u < n_units) w[k] = T::load(rp, cols, u);
    }
  };
  float acc[NC];
#pragma unroll
  for (int j = 0; j < NC; j++) acc[j] = 0.0f;
  int r = first, b = 0;
  const uint8_t* rp = row_ptr(r);
  // Sums batch b of row r from `cur` after loading the next position's batch into `nxt`; finishes
  // row r at its last batch. False when the warp's rows are done.
  auto stage = [&](const Wt (&cur)[T::unroll], Wt (&nxt)[T::unroll]) {
    int nb = b + 1, nr = r;
    const uint8_t* nrp = rp;
    if (nb == n_batches) {
      nb = 0, nr++;
      if (nr < end) nrp = row_ptr(nr);
    }
    if (nr < end) load(nxt, nrp, nb);
#pragma unroll
    for (int k = 0; k < T::unroll; k++) {
      const int u = b * kBatch + k * 32 + lane;
      if (u < n_units)
#pragma unroll
        for (int j = 0; j < NC; j++) acc[j] += T::dot(cur[k], act, j, u);
    }
    if (nb == 0) {  // row r is summed
#pragma unroll
      for (int j = 0; j < NC; j++) acc[j] = warp_sum(acc[j]);
      const int si = seg_of(r);
      float* __restrict__ Y = si == 2 ? g2.Y : si == 1 ? g1.Y : g0.Y;
      const int64_t ldy = si == 2 ? g2.rows : si == 1 ? g1.rows : g0.rows;
      const int row = r - (si == 2 ? row2 : si == 1 ? row1 : 0);
      if (lane < NC) {
        float v = acc[0];
#pragma unroll
        for (int j = 1; j < NC; j++) if (lane == j) v = acc[j];
        Y[int64_t(lane) * ldy + row] = v;
      }
#pragma unroll
      for (int j = 0; j < NC; j++) acc[j] = 0.0f;
    }
    r = nr, b = nb, rp = nrp;
    return r < end;
  };
  Wt w0[T::unroll], w1[T::unroll];
  load(w0, rp, 0);
  if (prefetch > 0) {  // the run's bytes up to its segment's end: contiguous
    const int si = seg_of(first);
    const int seg_end = si == 0 ? (segs.n > 1 ? row1 : total) : si == 1 ? (segs.n > 2 ? row2 : total) : total;
    const size_t bytes = min(size_t(min(end, seg_end) - first) * stride, size_t(prefetch));
    for (size_t off = size_t(lane) * 128; off < bytes; off += 32 * 128) prefetch_l2(rp + off);
  }
  griddep_wait();  // the activations come from the op before (weights are read-only)
  while (stage(w0, w1) && stage(w1, w0)) {
  }
}

// Warps per row in the Split form: enough warps in flight to cover the memory latency even for
// short matrices; one in the others.
static int warps_per_row(const Context& c, GemvForm form, int64_t rows, int n_units) {
  const int64_t target = int64_t(c.sm_count()) * 32;
  if (form != GemvForm::Split || n_units <= 32 || rows >= target) return 1;
  return rows * 2 >= target || n_units <= 64 ? 2 : 4;
}

// The form the switches give (gemv_split_rows, gemv_rows_per_warp, gemv_stream), and the one that
// stands in for Pairs beyond 2 columns and for Stream where the rows do not fill its grid.
static GemvForm plain_form(const Context& c) { return c.gemv_split_rows ? GemvForm::Split : GemvForm::Whole; }
static GemvForm flags_form(const Context& c) {
  return c.gemv_stream ? GemvForm::Stream : c.gemv_rows_per_warp > 1 ? GemvForm::Pairs : plain_form(c);
}

GemvForm gemv_form(const Context& c, GgmlType type, int rows, int64_t cols, int n) {
  GemvForm f = flags_form(c);
  if (c.gemv_force >= 0) {
    f = GemvForm(c.gemv_force);
  } else {
    for (const GemvChoice& g : c.gemv_forms)
      if (g.type == type && g.rows == rows && g.cols == cols && g.n == n) {
        f = g.form;
        break;
      }
  }
  return f == GemvForm::Pairs && n > kGemvPairMaxCols ? plain_form(c) : f;
}

using StreamKernel = void (*)(GemvSegs, size_t, int64_t, Act, int, int, int);
template <class T>
static StreamKernel stream_kernel(int n) {
  static constexpr StreamKernel k[kGemvMaxCols] = {
      gemv_stream_kernel<T, 1>, gemv_stream_kernel<T, 2>, gemv_stream_kernel<T, 3>, gemv_stream_kernel<T, 4>,
      gemv_stream_kernel<T, 5>, gemv_stream_kernel<T, 6>, gemv_stream_kernel<T, 7>, gemv_stream_kernel<T, 8>};
  CUDA_ASSERT(n >= 1 && n <= kGemvMaxCols);
  return k[n - 1];
}

// Blocks of gemv_stream_kernel<T, n> an SM holds, asked once (gemv_stream_prepare asks for all).
template <class T>
static int stream_blocks_per_sm(int n) {
  static std::atomic<int> per_sm[kGemvMaxCols];  // 0: not asked yet
  int bps = per_sm[n - 1].load(std::memory_order_relaxed);
  if (bps == 0) {
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, stream_kernel<T>(n), kGemvThreads, 0));
    bps = std::max(bps, 1);
    per_sm[n - 1].store(bps, std::memory_order_relaxed);
  }
  return bps;
}

void gemv_stream_prepare() {
#define BATON_PREPARE(T) \
  for (int n = 1; n <= kGemvMaxCols; n++) stream_blocks_per_sm<T>(n);
  BATON_CUDA_WEIGHT_TYPES(BATON_PREPARE)
#undef BATON_PREPARE
}

// Warps of the streamed grid: as many as the GPU holds at once (or Context::gemv_stream_warps).
template <class T>
static int64_t stream_warps(const Context& c, int n) {
  return c.gemv_stream_warps > 0 ? c.gemv_stream_warps
                                 : int64_t(c.sm_count()) * stream_blocks_per_sm<T>(n) * (kGemvThreads / 32);
}

// The streamed form's launch, when the rows are at least one per warp the GPU holds at once
// (shorter matrices keep gemv_kernel, whose split rows give them more warps): false otherwise.
template <class T>
static bool stream_rows(Context& c, T, int n, int total, const GemvSegs& segs, size_t stride, int64_t cols,
                        const Act& act) {
  const int64_t resident = stream_warps<T>(c, n);
  if (total < resident) return false;
  const int per_warp = int(ceil_div(total, resident));
  const int64_t warps = ceil_div(total, per_warp);
  const unsigned grid = unsigned(ceil_div(warps, kGemvThreads / 32));
  const int64_t run_bytes = int64_t(per_warp) * int64_t(stride);
  const int prefetch = int(std::min<int64_t>(int64_t(c.gemv_prefetch_bytes) / warps, run_bytes));
  launch_early(c.early_launch, stream_kernel<T>(n), grid, kGemvThreads, static_cast<cudaStream_t>(c.stream()), segs,
               stride, cols, act, total, per_warp, prefetch);
  CUDA_CHECK_LAUNCH();
  return true;
}

// One launch for `count` matrices of type T (same width) and the activations act.
template <class T>
static void gemv_type(Context& c, const Weight* const* W, float* const* Y, int count, const Act& act, int n) {
  CUDA_ASSERT(count >= 1 && count <= kMaxSegs);
  const int n_units = int(W[0]->cols / T::unit);
  const size_t stride = W[0]->row_stride;
  const int64_t cols = W[0]->cols;
  int total = 0;
  for (int i = 0; i < count; i++) total += int(W[i]->rows);
  GemvForm form = gemv_form(c, W[0]->type, total, cols, n);
  GemvSegs segs{};
  segs.n = count;
  for (int i = 0; i < count; i++)  // what the streamed form reads; the others' warps and blocks below
    segs.s[i] = {static_cast<const uint8_t*>(W[i]->data), Y[i], int(W[i]->rows), 1, 0};
  if (form == GemvForm::Stream) {
    if (stream_rows(c, T{}, n, total, segs, stride, cols, act)) return;
    form = plain_form(c);  // too few rows for the grid
  }
  const int rpw = form == GemvForm::Pairs ? 2 : 1;
  int blocks = 0;
  for (int i = 0; i < count; i++) {
    const int wpr = warps_per_row(c, form, W[i]->rows, n_units);
    segs.s[i].wpr = wpr;
    segs.s[i].block0 = blocks;
    blocks += int(ceil_div(W[i]->rows, kGemvThreads / 32 / wpr * rpw));
  }
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  const unsigned grid = unsigned(blocks);
  auto go = [&](auto kernel) { launch_early(c.early_launch, kernel, grid, kGemvThreads, s, segs, stride, cols, act); };
  if (rpw == 2) {
    if (n == 1) go(gemv_kernel<T, 1, 2>);
    else go(gemv_kernel<T, 2, 2>);
  } else {
    switch (n) {
#define BATON_NC(N) \
  case N: go(gemv_kernel<T, N, 1>); break;
      BATON_NC(1) BATON_NC(2) BATON_NC(3) BATON_NC(4) BATON_NC(5) BATON_NC(6) BATON_NC(7) BATON_NC(8)
#undef BATON_NC
      default: CUDA_ASSERT(false);
    }
  }
  CUDA_CHECK_LAUNCH();
}

#define BATON_INSTANTIATE(T) \
  template void gemv_type<T>(Context&, const Weight* const*, float* const*, int, const Act&, int);
BATON_CUDA_WEIGHT_TYPES(BATON_INSTANTIATE)
#undef BATON_INSTANTIATE

static void check_weight(const Weight& W, const char* op) {
  if (!cuda_supports(W.type))
    input_error(cat("CUDA ", op, ": weight type ", type_name(W.type), " is not supported"));
  if (W.rows <= 0 || W.cols <= 0 || W.rows > INT32_MAX || W.row_stride != packed_row_bytes(W.type, W.cols))
    input_error(cat("CUDA ", op, ": bad weight shape ", W.rows, " x ", W.cols, " (row stride ", W.row_stride, ")"));
}

// The experts' GEMV (gemv_experts): blockIdx.y a (token, expert) pair, blockIdx.z one of up to two
// stacked tensors; the expert id comes from the routing kernel before it, so the weights' address
// is known only after griddep_wait. One column per pair; wpr warps per row as gemv_kernel's split
// rows, chosen for the launch's rows (all pairs').
struct ExpertSegs {
  const uint8_t* W[2];
  size_t expert_bytes[2];
  float* Y[2];
};

template <class T>
__global__ void __launch_bounds__(kGemvThreads)
gemv_experts_kernel(ExpertSegs segs, int rows, size_t stride, int64_t cols, Act act, const int32_t* __restrict__ ids,
                    int x_div, int wpr) {
  __shared__ float part[kGemvThreads / 32];
  griddep_release();
  griddep_wait();  // the ids (and the activations) come from the ops before
  const int p = blockIdx.y, m = blockIdx.z;
  const int e = ids[p];
  if (e < 0) return;  // the whole block
  const uint8_t* __restrict__ W = (m ? segs.W[1] : segs.W[0]) + size_t(e) * (m ? segs.expert_bytes[1] : segs.expert_bytes[0]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = int(blockIdx.x) * (kGemvThreads / 32 / wpr) + warp / wpr;
  const int sub = warp % wpr;
  const int n_units = int(cols / T::unit);
  const int step = 32 * wpr;
  const int j = p / x_div;  // the pair's input column
  Act a = act;
  if (a.qs) a.qs += int64_t(j) * cols, a.ds += int64_t(j) * (cols / 32);
  if (a.x) a.x += int64_t(j) * cols;
  float acc = 0.0f;
  if (row < rows) {
    const uint8_t* rp = W + size_t(row) * stride;
    for (int u0 = sub * 32 + lane; u0 < n_units; u0 += step * T::unroll) {
      typename T::W w[T::unroll];
#pragma unroll
      for (int k = 0; k < T::unroll; k++)
        if (u0 + k * step < n_units) w[k] = T::load(rp, cols, u0 + k * step);
#pragma unroll
      for (int k = 0; k < T::unroll; k++)
        if (u0 + k * step < n_units) acc += T::dot(w[k], a, 0, u0 + k * step);
    }
  }
  acc = warp_sum(acc);
  float* __restrict__ Y = (m ? segs.Y[1] : segs.Y[0]) + int64_t(p) * rows;
  if (wpr == 1) {
    if (row < rows && lane == 0) Y[row] = acc;
    return;
  }
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  if (sub == 0 && row < rows && lane == 0) {
    float v = 0.0f;
    for (int k = 0; k < wpr; k++) v += part[warp + k];
    Y[row] = v;
  }
}

void gemv_experts(Context& c, const ExpertOut* outs, int count, const float* X, int x_div, const int32_t* ids,
                  int pairs, bool x_q8) {
  CUDA_ASSERT(count >= 1 && count <= 2 && x_div >= 1);
  const Weight& W0 = outs[0].W->first;
  check_weight(W0, "gemv_experts");
  for (int i = 1; i < count; i++) {
    const Weight& Wi = outs[i].W->first;
    if (Wi.type != W0.type || Wi.rows != W0.rows || Wi.cols != W0.cols)
      input_error(cat("CUDA gemv_experts: the stacked tensors of one launch differ (", type_name(W0.type), " ", W0.rows,
                      " x ", W0.cols, " and ", type_name(Wi.type), " ", Wi.rows, " x ", Wi.cols, ")"));
  }
  if (pairs <= 0) return;
  if (pairs % x_div != 0) input_error(cat("CUDA gemv_experts: ", pairs, " pairs is not a multiple of ", x_div));
  const int64_t cols = W0.cols;
  const int n_x = pairs / x_div;
  Act act;
  act.cols = cols;
  act.x = X;
  if (q8_activations(W0.type)) {
    const Q8Act s = q8_scratch(c, cols, n_x);
    act.qs = s.qs;
    act.ds = reinterpret_cast<const float2*>(s.ds);
    if (!x_q8) quantize_act(c, X, cols, n_x, s.qs, s.ds);
  }
  ExpertSegs segs{};
  for (int i = 0; i < count; i++) {
    segs.W[i] = static_cast<const uint8_t*>(outs[i].W->first.data);
    segs.expert_bytes[i] = outs[i].W->expert_bytes;
    segs.Y[i] = outs[i].Y;
  }
  with_weight_type(W0.type, [&](auto t) {
    using T = decltype(t);
    // Split rows when the launch's rows (all pairs' and tensors') do not fill the GPU.
    const int wpr = warps_per_row(c, GemvForm::Split, W0.rows * pairs * count, int(cols / T::unit));
    const dim3 grid(unsigned(ceil_div(W0.rows, kGemvThreads / 32 / wpr)), unsigned(pairs), unsigned(count));
    launch_early(c.early_launch, gemv_experts_kernel<T>, grid, kGemvThreads, static_cast<cudaStream_t>(c.stream()),
                 segs, int(W0.rows), W0.row_stride, cols, act, ids, x_div, wpr);
  });
  CUDA_CHECK_LAUNCH();
}


// The launches gemv_n makes of `count` matrices: runs of consecutive matrices of one type, at most
// kMaxSegs each; f(i0, i1) for each run [i0, i1).
template <class F>
static void for_each_launch(const Weight* const* W, int count, F&& f) {
  for (int i0 = 0; i0 < count;) {
    int i1 = i0 + 1;
    while (i1 < count && i1 - i0 < kMaxSegs && W[i1]->type == W[i0]->type) i1++;
    f(i0, i1);
    i0 = i1;
  }
}

void gemv_n(Context& c, const Weight* const* W, float* const* Y, int count, const float* X, int n, bool x_q8) {
  CUDA_ASSERT(count >= 1);
  bool q8 = false;
  for (int i = 0; i < count; i++) {
    check_weight(*W[i], "gemv");
    if (W[i]->cols != W[0]->cols)
      input_error(cat("CUDA gemv: matrices of one input differ in width (", W[0]->cols, " and ", W[i]->cols, ")"));
    q8 |= q8_activations(W[i]->type);
  }
  if (n <= 0) return;
  const int64_t cols = W[0]->cols;
  Act act;
  act.cols = cols;
  act.x = X;
  if (q8) {  // once for all the matrices, unless the op that wrote X did
    const Q8Act s = q8_scratch(c, cols, n);
    act.qs = s.qs;
    act.ds = reinterpret_cast<const float2*>(s.ds);
    if (!x_q8) quantize_act(c, X, cols, n, s.qs, s.ds);
  }
  for (int j0 = 0; j0 < n; j0 += kGemvMaxCols) {
    const int nc = std::min(kGemvMaxCols, n - j0);
    Act a = act;
    a.qs = act.qs ? act.qs + int64_t(j0) * cols : nullptr;
    a.ds = act.ds ? act.ds + int64_t(j0) * (cols / 32) : nullptr;
    a.x = X + int64_t(j0) * cols;
    for_each_launch(W, count, [&](int i0, int i1) {
      const Weight* ws[kMaxSegs];
      float* ys[kMaxSegs];
      for (int i = i0; i < i1; i++) ws[i - i0] = W[i], ys[i - i0] = Y[i] + int64_t(j0) * W[i]->rows;
      with_weight_type(W[i0]->type, [&](auto t) { gemv_type<decltype(t)>(c, ws, ys, i1 - i0, a, nc); });
    });
  }
}

// The matrices and outputs of up to 8 products of one input, as gemv_n and gemm_n take them.
struct Outs {
  const Weight* W[8];
  float* Y[8];
  int k = 0;
  Outs(const MatmulOut* o, size_t n) {
    CUDA_ASSERT(n >= 1 && n <= 8);
    for (; k < int(n); k++) W[k] = o[k].W, Y[k] = o[k].Y;
  }
};

// The kernel a form runs for one launch, after gemv_type's fallbacks: 0 split rows, 1 one warp per
// row, 2 two rows per warp, 3 streamed. Only 0 sums a row in other partials than the rest.
enum Realized { kSplitRows, kOneWarp, kRowPairs, kStreamed };
struct LaunchShape {
  GgmlType type;
  int rows;
  int64_t cols;
  bool splits, streams;  // Split gives some matrix 2-4 warps per row; the rows fill the streamed grid
};
static Realized realized(const Context& c, GemvForm f, const LaunchShape& l, int n) {
  if ((f == GemvForm::Pairs && n > kGemvPairMaxCols) || (f == GemvForm::Stream && !l.streams)) f = plain_form(c);
  switch (f) {
    case GemvForm::Split: return l.splits ? kSplitRows : kOneWarp;
    case GemvForm::Whole: return kOneWarp;
    case GemvForm::Pairs: return kRowPairs;
    case GemvForm::Stream: return kStreamed;
  }
  return kOneWarp;
}

GemvTiming tune_gemv(Context& c, const std::vector<std::vector<MatmulOut>>& calls, const float* X, int n,
                     bool same_bits, int rounds) {
  GemvTiming t;
  for (float& us : t.us) us = -1.0f;
  if (calls.empty() || n < 1 || n > kGemvMaxCols || rounds < 1) return t;
  std::vector<LaunchShape> launches;  // distinct, in order of appearance
  for (const std::vector<MatmulOut>& call : calls) {
    const Outs o(call.data(), call.size());
    const Weight* const* ws = o.W;
    for_each_launch(ws, o.k, [&](int i0, int i1) {
      LaunchShape l{ws[i0]->type, 0, ws[i0]->cols, false, false};
      with_weight_type(l.type, [&](auto w) {
        using T = decltype(w);
        for (int i = i0; i < i1; i++) {
          l.rows += int(ws[i]->rows);
          l.splits |= warps_per_row(c, GemvForm::Split, ws[i]->rows, int(ws[i]->cols / T::unit)) > 1;
        }
        l.streams = l.rows >= stream_warps<T>(c, n);
      });
      bool seen = false;
      for (const LaunchShape& o : launches) seen |= o.type == l.type && o.rows == l.rows && o.cols == l.cols;
      if (!seen) launches.push_back(l);
    });
  }
  // Timed: each form that runs other kernels than the forms before it for some launch and, with
  // same_bits, sums every launch's rows as the flags' form does.
  const GemvForm dflt = flags_form(c);
  bool timed[kGemvForms] = {};
  for (int f = 0; f < kGemvForms; f++) {
    bool differs = true, keeps_bits = true;
    for (int g = 0; g < f; g++) {
      if (!timed[g]) continue;
      bool same = true;
      for (const LaunchShape& l : launches) same &= realized(c, GemvForm(f), l, n) == realized(c, GemvForm(g), l, n);
      differs &= !same;
    }
    for (const LaunchShape& l : launches)
      keeps_bits &= (realized(c, GemvForm(f), l, n) == kSplitRows) == (realized(c, dflt, l, n) == kSplitRows);
    timed[f] = differs && (keeps_bits || !same_bits);
  }
  auto pass = [&](bool x_q8) {
    for (const std::vector<MatmulOut>& call : calls) {
      const Outs o(call.data(), call.size());
      gemv_n(c, o.W, o.Y, o.k, X, n, x_q8);
    }
  };
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  const int force = c.gemv_force;
  float best[kGemvForms];
  for (float& b : best) b = -1.0f;
  c.gemv_force = int(dflt);
  pass(false);  // quantizes X into the scratch; the timed passes reuse it (the same for every form)
  for (int r = 0; r < rounds; r++)
    for (int f = 0; f < kGemvForms; f++) {
      if (!timed[f]) continue;
      c.gemv_force = f;
      pass(true);  // warm: the first launch of a kernel loads its code
      CUDA_CHECK(cudaEventRecord(e0, s));
      pass(true);
      CUDA_CHECK(cudaEventRecord(e1, s));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (best[f] < 0.0f || ms < best[f]) best[f] = ms;
    }
  c.gemv_force = force;
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  bool any = false;
  for (int f = 0; f < kGemvForms; f++) {
    if (best[f] < 0.0f) continue;
    t.us[f] = best[f] * 1000.0f / float(calls.size());
    if (!any || t.us[f] < t.us[int(t.best)]) t.best = GemvForm(f);
    any = true;
  }
  for (const LaunchShape& l : launches) {  // replaces an earlier choice for the same launch
    auto& v = c.gemv_forms;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](const GemvChoice& o) { return o.type == l.type && o.rows == l.rows && o.cols == l.cols && o.n == n; }),
            v.end());
    v.push_back({l.type, l.rows, l.cols, n, t.best});
  }
  return t;
}

void gemv(Context& c, const Weight& W, const float* X, int n, float* Y) {
  const Weight* w = &W;
  gemv_n(c, &w, &Y, 1, X, n, false);
}

void matmul(Context& c, const Weight& W, const float* X, int n, float* Y, bool x_q8) {
  const Weight* w = &W;
  if (n <= c.gemv_max_cols) gemv_n(c, &w, &Y, 1, X, n, x_q8);
  else gemm(c, W, X, n, Y);
}

void matmul_n(Context& c, const MatmulOut* outs, int count, const float* X, int n, bool x_q8) {
  const Outs o(outs, size_t(count));
  if (n <= c.gemv_max_cols) gemv_n(c, o.W, o.Y, o.k, X, n, x_q8);
  else gemm_n(c, o.W, o.Y, o.k, X, n);
}

void matmul_n(Context& c, std::initializer_list<MatmulOut> outs, const float* X, int n, bool x_q8) {
  matmul_n(c, outs.begin(), int(outs.size()), X, n, x_q8);
}

}  // namespace baton::cuda
