// A CUDA stage: upload the planned block once, allocate what the planner sized, run the family's
// forward (models/llama_forward.h) with the CUDA ops. Everything a step does is stream-ordered on
// the stage's one stream; forward() waits for the stream once, at the end, when the hidden state
// or the logits are on the host.
#include "runtime/gpu_stage.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf/error.h"
#include "gguf/gguf.h"
#include "kernels/cpu/ops.h"
#include "models/llama.h"
#include "models/llama_forward.h"
#include "runtime/buffers.h"
#include "runtime/kv_cache.h"
#include "runtime/link.h"
#include "runtime/lora.h"
#include "runtime/shape.h"

#if BATON_HAVE_CUDA || BATON_CUDA_HOST_EMULATION
#include "kernels/cuda/ops.h"
#endif

namespace baton {

// With BATON_CUDA_HOST_EMULATION the ops run on the host (kernels/cuda_host/ops_host.cpp): for tests.
#if BATON_HAVE_CUDA || BATON_CUDA_HOST_EMULATION

using GpuLayer = LayerT<cuda::Weight>;  // a layer's weights on the device

// What a captured step depends on besides device memory: its shape.
struct GraphKey {
  int n = 0;
  std::vector<uint8_t> logits;
  std::vector<int> commit_n;
  bool decode_only = false;  // one token per sequence: the rope and staging in the attention
  bool operator<(const GraphKey& o) const {
    return std::tie(n, logits, commit_n, decode_only) < std::tie(o.n, o.logits, o.commit_n, o.decode_only);
  }
};
constexpr size_t kMaxGraphs = 64;

// y = act(g) * u over n values (q8: and their 8-bit activations, as the gates take them).
static void launch_gate(cuda::Context& ctx, Activation act, const float* g, const float* u, float* y, int64_t n,
                        cuda::Q8Act q8 = {}) {
  switch (act) {
    case Activation::SiLU: return cuda::silu_gate(ctx, g, u, y, n, q8);
    case Activation::GeluTanh: return cuda::gelu_tanh_gate(ctx, g, u, y, n, q8);
    case Activation::SwiGluOai: return cuda::swiglu_oai_gate(ctx, g, u, y, n, q8);
  }
}

struct GpuStage::Impl {
  const ModelConfig& c;
  cuda::Context ctx;
  int begin = 0, end = 0, n_batch = 0, n_outputs = 0, n_seq = 0;
  GgmlType kv_type = GgmlType::F16;
  size_t k_row = 0, v_row = 0;
  std::vector<cuda::DeviceBuffer> owned;
  uint64_t bytes = 0;  // everything in `owned`

  std::vector<GpuLayer> layers;  // n_layer entries; [begin, end) are set
  cuda::Weight tok_embd, output;
  const float* output_norm = nullptr;
  std::vector<cuda::KvLayer> kv;  // [begin, end)
  std::map<const float*, const float*> freqs;  // host frequency table -> its device copy

  // Activations (device), one token per row, and the batch's int arrays.
  float *x = nullptr, *xb = nullptr, *xb2 = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *hb = nullptr,
        *hb2 = nullptr, *logits = nullptr;
  uint8_t *k_new = nullptr, *v_new = nullptr;
  // tok .. row0 and the commits' arrays are slices of `ints` (a step's n entries each, packed n
  // apart: one copy per step), set by forward() for the step's token count.
  int32_t *tok = nullptr, *pos = nullptr, *seq = nullptr, *first = nullptr, *row0 = nullptr;
  int32_t* ints = nullptr;
  std::vector<int32_t> h_ints;
  int32_t* ids = nullptr;          // argmax of each output row (kArgmaxOnly)
  std::vector<int32_t> h_ids;
  int top_k = 0;                   // K of a kTopK row (top_k_candidates)
  int32_t* top_ids = nullptr;      // each output row's K best ids and logits (kTopK)
  float* top_vals = nullptr;
  std::vector<int32_t> h_top_ids;
  std::vector<float> h_top_vals;
  std::vector<int32_t> h_first, h_row0, h_row;  // host side of first / row0, and the staging rows
  // A mixture of experts: the router's logits (device, host), an expert's gathered input rows, the
  // experts' outputs, their weighted sum, and the routed tokens and weights grouped by expert
  // (device, host). The routing itself is cpu::moe_route on the host, the CPU stage's own.
  float *moe_logits = nullptr, *xe = nullptr, *ye = nullptr, *acc = nullptr, *moe_w = nullptr;
  int32_t* moe_rows = nullptr;
  std::vector<float> h_logits, h_route_w, h_w;
  std::vector<int32_t> h_route_ids, h_rows, h_expert_first;
  // --cpu-moe: the experts stay in host memory (bound and packed here) and run on the CPU with
  // the CPU stage's own code (moe_experts) on this pool and host scratch.
  bool cpu_moe = false;
  // Steps of at most kMoeDeviceTokens tokens route on the device (BATON_MOE_DEVICE=0: never).
  bool moe_device = true;
  bool routes_on_device(int n) const {
    return moe_device && !cpu_moe && n <= kMoeDeviceTokens && c.n_expert <= cuda::kMoeRouteMaxExperts;
  }
  // LoRA adapters (runtime/lora.h): each adapted matrix's pairs by the matrix's device data (a
  // fused q/k/v or gate/up tensor's parts share an A), the embedding's, and the buffer of their
  // products (kLoraChunkFloats). Y += scale · B·(A·X), as the CPU forward adds them.
  struct Lora {
    cuda::Weight a, b;
    float scale = 1.f;
  };
  std::unordered_map<const void*, std::vector<Lora>> lora;
  std::vector<Lora> lora_embd;
  float* lora_buf = nullptr;
  int64_t lora_floats = int64_t(kLoraChunkFloats);  // the buffer's (BATON_LORA_CHUNK_FLOATS: fewer, for tests)
  // The columns of a pair's products that fit the buffer at once (A·X: the padded rank, B's cols).
  int lora_step(const Lora& p) const { return int(std::max<int64_t>(1, lora_floats / (p.b.rows + p.b.cols))); }

  ModelWeights host_w;
  std::unique_ptr<cpu::ThreadPool> pool;
  std::unique_ptr<Scratch> host_scratch;

  // The tokens a layer with n_cells cells per sequence commits: those whose cell no later token
  // of their sequence in the batch takes. kv_commit copies its tokens in parallel, so two tokens
  // of one cell (a prompt longer than a ring) would leave either; the CPU's in-order commit keeps
  // the later one.
  struct Commit {
    int32_t *row = nullptr, *seq = nullptr, *pos = nullptr;  // device, n entries
    std::vector<int32_t> h_row, h_seq, h_pos;
    int n = 0;
  };
  std::map<int, Commit> commits;  // by n_cells

  // Captured steps by shape (GpuStage::forward): token count, LogitsMode per token, commit counts.
  bool use_graphs = true;
  int n_ctx = 0;
  std::map<GraphKey, cuda::Graph> graphs;
  uint64_t graph_scratch = 0;  // the scratch generation the graphs were captured with
  GpuStage::Stats stats;

  // BATON_STEP_TRACE=1: host time per step in each phase of forward(), printed when the stage
  // goes (what a step waits for on the host: a copy that blocks, a slow graph launch, the sync).
  struct Trace {
    bool on = false;
    uint64_t steps = 0;
    double ns[5] = {};  // inputs, link in, ops, link out, results (with the wait for the GPU)
    std::chrono::steady_clock::time_point t;
    void mark(int phase) {
      if (!on) return;
      const auto now = std::chrono::steady_clock::now();
      if (phase >= 0) ns[phase] += double(std::chrono::duration_cast<std::chrono::nanoseconds>(now - t).count());
      t = now;
    }
  } trace;

  GpuLink* in = nullptr;   // device link from the previous stage (nullptr: host memory)
  GpuLink* out = nullptr;  // device link to the next stage
  DeviceChannel* net_in = nullptr;   // device channel from a stage in another process
  DeviceChannel* net_out = nullptr;  // device channel to a stage in another process

  Impl(const ModelConfig& cfg, int device) : c(cfg), ctx(device) {}

  std::vector<std::string> notes;  // what the stage measured at load (ModelStage::notes)

  // The GEMV forms of a decode step's matmuls, measured on this GPU (cuda::tune_gemv) at one
  // column and at the widest launch n_seq sequences make; each op over all the stage's layers, as
  // a step reads them; same_bits: only forms that keep the products' bits. Inputs are small
  // nonzero values; the buffers are overwritten later anyway.
  void tune_gemvs(int n_seq, bool same_bits) {
    std::vector<std::vector<cuda::MatmulOut>> qkv, wo, ffn_in, down, head;
    for (int l = begin; l < end; ++l) {
      GpuLayer& L = layers[size_t(l)];
      qkv.push_back({{&L.wq, q}, {&L.wk, k}, {&L.wv, v}});
      wo.push_back({{&L.wo, xb}});
      if (c.is_moe()) continue;  // (the experts' launches depend on the routing)
      ffn_in.push_back({{&L.gate, hb}, {&L.up, hb2}});
      down.push_back({{&L.down, xb}});
    }
    if (output.data) head.push_back({{&output, logits}});
    const int widest = std::min({8, n_seq, n_batch});
    const size_t width = size_t(std::max({c.n_embd, c.n_embd_attn(), c.n_ff}));
    std::vector<float> host(size_t(widest) * width);
    for (size_t i = 0; i < host.size(); ++i) host[i] = float(int(i * 2654435761u % 2001) - 1000) * 1e-3f;
    if (end > begin) {
      cuda::copy_to_device(ctx, xb2, host.data(), size_t(widest) * size_t(c.n_embd_attn()) * sizeof(float));
      cuda::copy_to_device(ctx, hb, host.data(), size_t(widest) * size_t(c.n_ff) * sizeof(float));
    }
    cuda::copy_to_device(ctx, xb, host.data(), size_t(widest) * size_t(c.n_embd) * sizeof(float));
    const struct {
      const char* name;
      const std::vector<std::vector<cuda::MatmulOut>>& calls;
      const float* X;
    } ops[] = {{"q/k/v", qkv, xb}, {"output proj.", wo, xb2}, {"gate/up", ffn_in, xb}, {"down", down, hb},
               {"head", head, xb}};
    std::vector<int> widths{1};
    if (widest > 1) widths.push_back(widest);
    for (int n : widths) {
      for (const auto& op : ops) {
        if (op.calls.empty()) continue;
        const cuda::GemvTiming t = cuda::tune_gemv(ctx, op.calls, op.X, n, same_bits);
        std::string rows, types;  // of the first layer's matrices: "4096+1024+1024", "Q4_K/Q4_K/Q6_K" or "Q4_0"
        bool mixed = false;
        for (const cuda::MatmulOut& m : op.calls[0]) {
          rows += fmt::format("{}{}", rows.empty() ? "" : "+", m.W->rows);
          types += fmt::format("{}{}", types.empty() ? "" : "/", type_name(m.W->type));
          mixed |= m.W->type != op.calls[0][0].W->type;
        }
        if (!mixed) types = type_name(op.calls[0][0].W->type);
        std::string line = fmt::format("GEMV forms, {} ({} x {}, {}), {} column{}: {}  [", op.name, rows,
                                       op.calls[0][0].W->cols, types, n, n > 1 ? "s" : "", cuda::gemv_form_name(t.best));
        const char* sep = "";
        for (int f = 0; f < cuda::kGemvForms; ++f)
          if (t.us[f] >= 0.0f)
            line += fmt::format("{}{} {:.1f} us", std::exchange(sep, ", "), cuda::gemv_form_name(cuda::GemvForm(f)), t.us[f]);
        notes.push_back(line + "]");
      }
    }
  }

  const gguf::File* file = nullptr;  // the weights' mapping (its pages given back once uploaded)

  void* alloc(size_t n) {
    owned.emplace_back(std::max<size_t>(n, 16));
    bytes += owned.back().size();
    return owned.back().get();
  }
  template <class T>
  T* alloc_n(size_t n) { return static_cast<T*>(alloc(n * sizeof(T))); }
  const float* upload_floats(const float* host, size_t n) {
    if (!host) return nullptr;
    float* d = alloc_n<float>(n);
    owned.back().upload(host, n * sizeof(float));
    return d;
  }
  cuda::Weight upload_matrix(cuda::WeightUploader& up, const cpu::QMatrix& m, const char* what, uint64_t& done,
                             const std::function<void(uint64_t)>& progress) {
    if (!cuda::cuda_supports(m.type))
      fail(ErrorKind::Usage, "{}: tensor type {} is not supported by the CUDA backend (device {})", what,
           type_name(m.type), ctx.device());
    cuda::Weight w;
    owned.push_back(up.upload(m.type, m.data, m.rows, m.cols, w));
    if (file) file->release(m.data, m.row_bytes * uint64_t(m.rows));  // packed into staging: the host copy is spent
    bytes += owned.back().size();
    done += m.row_bytes * uint64_t(m.rows);
    if (progress) progress(done);
    return w;
  }
};

namespace {

// The CUDA backend of llama_layers / llama_head: device buffers of the stage, its stream.
// Everything a step's ops take from the host is in here by value, so the same object records a
// graph that stays valid for later steps of the same shape (GraphKey).
struct SeqRun {  // one sequence's tokens in a step: rows [t0, t0 + n), positions pos0..
  int t0 = 0, n = 0, seq = 0, pos0 = 0;
};

struct CudaLayers {
  GpuStage::Impl& g;
  std::vector<uint8_t> logits;  // the batch's LogitsMode per token
  std::vector<int> commit_n;    // tokens each layer's commit writes, per entry of g.commits (in map order)
  int max_len;                  // an upper bound of pos + 1 over the batch (n_ctx in a graph)
  std::vector<SeqRun> runs;     // the batch's sequences in row order (empty in a graph: split attention only)
  // Every token its sequence's only one in the step (a decode step): the attention stages each
  // token's own key and value itself (cuda::RopeStage) when rope_and_stage comes right before it.
  bool decode_only = false;
  int rope_l = -1, rope_n = 0;  // a rope_and_stage waiting for the attention
  float *x = g.x, *xb = g.xb, *xb2 = g.xb2, *q = g.q, *k = g.k, *v = g.v, *hb = g.hb, *hb2 = g.hb2;

  const GpuLayer& layer(int l) const { return g.layers[size_t(l)]; }
  const float* output_norm() const { return g.output_norm; }
  const cuda::Weight& output() const { return g.output; }

  // The ops that produce a matmul's input (norms, gates) wait for the next op. When that is a
  // GEMV with 8-bit activations reading their whole output, they also write those activations
  // and the GEMV does not launch quantize_act (cuda::Q8Act: one launch fewer per norm and gate);
  // otherwise they run as they are. Every op launches the pending one first (flush).
  struct Pending {
    enum Kind { None, Norm, Gate } kind = None;
    float* x = nullptr;  // Norm: x (+= ds·d when d), y = rms_norm(x) * w, rows of n
    const float* d = nullptr;
    const float* w = nullptr;
    float* y = nullptr;  // both: the output
    int rows = 0, n = 0;  // Gate: y = act(x) * u over rows * n values (n = the consumer's width)
    const float* u = nullptr;
    Activation act = Activation::SiLU;
    float ds = 1.f;  // Norm with d: the residual scale (granite)
  } pending;

  // Launches the pending op; `X`, `cols`, `n_cols`: the GEMV about to read X (0: none). Returns
  // whether X's 8-bit activations are in the scratch.
  bool flush(const float* X = nullptr, int64_t cols = 0, int n_cols = 0) {
    q8_of = nullptr;  // any op after the attention: its 8-bit output may be overwritten
    if (rope_l >= 0) rope_stage(std::exchange(rope_l, -1), rope_n);
    Pending p = pending;
    pending = {};
    if (p.kind == Pending::None) return false;
    const bool fuse = X == p.y && n_cols <= g.ctx.gemv_max_cols && cols == p.n && n_cols == p.rows && cols % 32 == 0;
    const cuda::Q8Act q8 = fuse ? cuda::q8_scratch(g.ctx, cols, n_cols) : cuda::Q8Act{};
    if (p.kind == Pending::Norm) {
      if (p.d) cuda::add_rms_norm(g.ctx, p.x, p.d, p.w, p.y, p.rows, p.n, g.c.rms_eps, q8, p.ds);
      else cuda::rms_norm(g.ctx, p.x, p.w, p.y, p.rows, p.n, g.c.rms_eps, q8);
    } else {
      launch_gate(g.ctx, p.act, p.x, p.u, p.y, int64_t(p.rows) * p.n, q8);
    }
    return fuse;
  }
  // Whether a GEMV of these matrices takes 8-bit activations (cuda::gemv_n quantizes for any).
  static bool q8_input(std::initializer_list<const cuda::Weight*> ws) {
    for (const cuda::Weight* w : ws)
      if (cuda::q8_activations(w->type)) return true;
    return false;
  }
  bool flush_for(std::initializer_list<const cuda::Weight*> ws, const float* X, int n) {
    const cuda::Weight& w0 = **ws.begin();
    return q8_input(ws) ? flush(X, w0.cols, n) : flush();
  }

  void rms_norm(const float* in, const float* w, float* out, int rows, int n) {
    flush();
    pending = {Pending::Norm, const_cast<float*>(in), nullptr, w, out, rows, n};  // in is only read without d
  }
  void add_rms_norm(float* x, const float* d, const float* w, float* out, int rows, int n, float s = 1.f) {
    flush();
    pending = {Pending::Norm, x, d, w, out, rows, n};
    pending.ds = s;
  }
  // The attention's output rows whose 8-bit activations its combine kernel wrote (cuda::attention
  // with q8_out), for the output projection right after it.
  const float* q8_of = nullptr;
  int q8_rows = 0;
  int64_t q8_cols = 0;
  bool take_q8(const float* X, int64_t cols, int n) const { return X == q8_of && n == q8_rows && cols == q8_cols; }

  void matmul(const cuda::Weight& W, const float* X, int n, float* Y) {
    const bool ready = take_q8(X, W.cols, n);
    const bool x_q8 = flush_for({&W}, X, n) || ready;
    cuda::matmul(g.ctx, W, X, n, Y, x_q8);
    lora(W, X, n, Y);
  }
  void matmul_qkv(const GpuLayer& L, const float* X, int n) {
    const bool x_q8 = flush_for({&L.wq, &L.wk, &L.wv}, X, n);
    cuda::matmul_n(g.ctx, {{&L.wq, q}, {&L.wk, k}, {&L.wv, v}}, X, n, x_q8);
    for (auto [W, Y] : {std::pair{&L.wq, q}, {&L.wk, k}, {&L.wv, v}}) lora(*W, X, n, Y);
  }
  void matmul_gate_up(const GpuLayer& L, const float* X, int n) {
    const bool x_q8 = flush_for({&L.gate, &L.up}, X, n);
    cuda::matmul_n(g.ctx, {{&L.gate, hb}, {&L.up, hb2}}, X, n, x_q8);
    lora(L.gate, X, n, hb);
    lora(L.up, X, n, hb2);
  }
  // W's LoRA pairs added to its product Y = W·X: per chunk of columns A·X, B·(A·X), Y += s·that.
  void lora(const cuda::Weight& W, const float* X, int n, float* Y) {
    if (g.lora.empty()) return;
    const auto it = g.lora.find(W.data);
    if (it == g.lora.end()) return;
    for (const GpuStage::Impl::Lora& p : it->second) {
      const int step = g.lora_step(p);
      for (int j = 0; j < n; j += step) {
        const int m = std::min(step, n - j);
        float *h = g.lora_buf, *bh = g.lora_buf + size_t(m) * size_t(p.b.cols);
        cuda::matmul(g.ctx, p.a, X + size_t(j) * size_t(W.cols), m, h);
        cuda::matmul(g.ctx, p.b, h, m, bh);
        cuda::add(g.ctx, Y + size_t(j) * size_t(W.rows), bh, int64_t(m) * p.b.rows, p.scale);
      }
    }
  }
  // The embedding's pairs: each token's row of A through B, added to its row as the embedding is
  // scaled.
  void lora_embedding(const int32_t* tok, int n, float* x) {
    for (const GpuStage::Impl::Lora& p : g.lora_embd) {
      const int step = g.lora_step(p);
      for (int j = 0; j < n; j += step) {
        const int m = std::min(step, n - j);
        float *h = g.lora_buf, *bh = g.lora_buf + size_t(m) * size_t(p.b.cols);
        cuda::embed_rows(g.ctx, p.a, tok + j, m, h, 1.f);
        cuda::matmul(g.ctx, p.b, h, m, bh);
        cuda::add(g.ctx, x + size_t(j) * size_t(p.b.rows), bh, int64_t(m) * p.b.rows, p.scale * g.c.embd_scale);
      }
    }
  }
  // A mixture of experts over the normed rows in xb, into xb, as the CPU stage computes it: the
  // router on the device; steps of up to kMoeDeviceTokens tokens route there too (moe_on_device);
  // longer ones take its logits to the host (a wait per layer, so these steps are never captured
  // in graphs) for cpu::moe_route, then per chosen expert its rows gathered, gate and up, the
  // gate, down, and the weighted add into the sum.
  void moe(const GpuLayer& L, int n) {
    const ModelConfig& c = g.c;
    const int E = c.n_embd, K = c.n_expert_used, F = c.n_ff_exp, X = c.n_expert;
    // Routed on the device: the norm before writes xb's 8-bit activations for the experts' GEMV
    // (the router reads them too, or the floats; nothing in between uses the scratch).
    const bool x_q8 = g.routes_on_device(n) && !L.gate_exp.empty() && q8_input({&L.gate_exp[0]}) ? flush(xb, E, n)
                                                                                                   : flush();
    cuda::matmul(g.ctx, L.router, xb, n, g.moe_logits, x_q8);
    if (L.router_b) add_rows(g.moe_logits, L.router_b, n, X);
    if (!g.routes_on_device(n))
      cuda::copy_to_host(g.ctx, g.h_logits.data(), g.moe_logits, size_t(n) * size_t(X) * sizeof(float));
    if (g.cpu_moe) {  // the experts on the CPU: the rows they read come along
      Scratch& hs = *g.host_scratch;
      cuda::copy_to_host(g.ctx, hs.xb, xb, size_t(n) * size_t(E) * sizeof(float));
      g.ctx.synchronize();
      for (int t = 0; t < n; ++t)
        cpu::moe_route(g.h_logits.data() + size_t(t) * X, X, K, c.expert_weights_norm,
                       hs.route_ids.data() + size_t(t) * K, hs.route_w.data() + size_t(t) * K);
      moe_experts(c, g.host_w.layers[size_t(&L - g.layers.data())], hs.xb, n, hs, *g.pool);
      cuda::copy_to_device(g.ctx, g.acc, hs.acc, size_t(n) * size_t(E) * sizeof(float));  // (pageable: copied now)
      shared_expert(L, n);
      return;
    }
    if (g.routes_on_device(n)) return moe_on_device(L, n, x_q8);
    g.ctx.synchronize();
    for (int t = 0; t < n; ++t)
      cpu::moe_route(g.h_logits.data() + size_t(t) * X, X, K, c.expert_weights_norm,
                     g.h_route_ids.data() + size_t(t) * K, g.h_route_w.data() + size_t(t) * K);
    // Each expert's (token, weight) pairs, experts in order, tokens in order within one.
    std::vector<int32_t>& first = g.h_expert_first;
    cpu::moe_group(g.h_route_ids.data(), g.h_route_w.data(), n, K, X, first.data(), g.h_rows.data(), g.h_w.data());
    const size_t pairs = size_t(first[size_t(X)]);
    cuda::copy_to_device(g.ctx, g.moe_rows, g.h_rows.data(), pairs * sizeof(int32_t));  // (pageable: copied now)
    cuda::copy_to_device(g.ctx, g.moe_w, g.h_w.data(), pairs * sizeof(float));
    cuda::zero(g.ctx, g.acc, size_t(n) * size_t(E) * sizeof(float));
    // Decode (one token): every chosen expert's input is xb, so up to four experts' gate and up
    // matrices share one launch (8 outputs), and their gates one more; then each down and add.
    constexpr int kGroup = 4;
    int group[kGroup], in_group = 0;
    auto run_group = [&] {
      cuda::MatmulOut outs[2 * kGroup];
      for (int i = 0; i < in_group; ++i) {
        outs[2 * i] = {&L.gate_exp[size_t(group[i])], hb + size_t(i) * F};
        outs[2 * i + 1] = {&L.up_exp[size_t(group[i])], hb2 + size_t(i) * F};
      }
      cuda::matmul_n(g.ctx, outs, 2 * in_group, xb, 1);
      for (int i = 0; i < in_group; ++i) {
        expert_bias(L.gate_exp_b, group[i], hb + size_t(i) * F, 1, F);
        expert_bias(L.up_exp_b, group[i], hb2 + size_t(i) * F, 1, F);
      }
      gate_hb(int64_t(in_group) * F);
      for (int i = 0; i < in_group; ++i) {
        const int off = first[size_t(group[i])];
        cuda::matmul(g.ctx, L.down_exp[size_t(group[i])], hb + size_t(i) * F, 1, g.ye);
        expert_bias(L.down_exp_b, group[i], g.ye, 1, E);
        cuda::scatter_add_rows(g.ctx, g.acc, g.ye, g.moe_rows + off, g.moe_w + off, false, 1, E);
      }
      in_group = 0;
    };
    for (int e = 0; e < X; ++e) {
      const int off = first[size_t(e)], m = first[size_t(e) + 1] - off;
      if (m == 0) continue;
      if (n == 1) {
        group[in_group++] = e;
        if (in_group == kGroup) run_group();
        continue;
      }
      bool identity = m == n;
      for (int j = 0; j < m && identity; ++j) identity = g.h_rows[size_t(off + j)] == j;
      const float* in = xb;
      if (!identity) {
        cuda::gather_rows(g.ctx, xb, g.moe_rows + off, m, E, g.xe);
        in = g.xe;
      }
      cuda::matmul_n(g.ctx, {{&L.gate_exp[size_t(e)], hb}, {&L.up_exp[size_t(e)], hb2}}, in, m);
      expert_bias(L.gate_exp_b, e, hb, m, F);
      expert_bias(L.up_exp_b, e, hb2, m, F);
      gate_hb(int64_t(m) * F);
      cuda::matmul(g.ctx, L.down_exp[size_t(e)], hb, m, g.ye);
      expert_bias(L.down_exp_b, e, g.ye, m, E);
      cuda::scatter_add_rows(g.ctx, g.acc, g.ye, g.moe_rows + off, g.moe_w + off, false, m, E);
    }
    if (in_group > 0) run_group();
    shared_expert(L, n);
  }
  // The same on the device (steps of at most kMoeDeviceTokens tokens, Impl::routes_on_device): the
  // routing kernel writes each (token, rank) pair's expert and weight, and every pair is a column
  // of its expert's GEMV: gate and up of all pairs in one launch, the gate, down, the weighted sum
  // per token in ascending expert id (the CPU stage's order). Nothing waits for the host.
  void moe_on_device(const GpuLayer& L, int n, bool x_q8) {
    const ModelConfig& c = g.c;
    const int E = c.n_embd, K = c.n_expert_used, F = c.n_ff_exp, X = c.n_expert, P = n * K;
    cuda::moe_route(g.ctx, g.moe_logits, n, X, K, c.expert_weights_norm, g.moe_rows, g.moe_w);
    const cuda::ExpertWeights gate = stacked(L.gate_exp), up = stacked(L.up_exp), down = stacked(L.down_exp);
    if (gate.first.type == up.first.type) {
      const cuda::ExpertOut outs[] = {{&gate, hb}, {&up, hb2}};
      cuda::gemv_experts(g.ctx, outs, 2, xb, K, g.moe_rows, P, x_q8);
    } else {
      const cuda::ExpertOut o1[] = {{&gate, hb}}, o2[] = {{&up, hb2}};
      cuda::gemv_experts(g.ctx, o1, 1, xb, K, g.moe_rows, P, x_q8);
      cuda::gemv_experts(g.ctx, o2, 1, xb, K, g.moe_rows, P, x_q8 || cuda::q8_activations(gate.first.type));
    }
    if (!L.gate_exp_b.empty()) {  // stacked: expert e's at e · width
      cuda::add_rows_id(g.ctx, hb, L.gate_exp_b[0], g.moe_rows, P, F);
      cuda::add_rows_id(g.ctx, hb2, L.up_exp_b[0], g.moe_rows, P, F);
    }
    // The gate writes the down projection's 8-bit activations where its GEMV looks for them.
    const bool q8 = cuda::q8_activations(down.first.type);
    launch_gate(g.ctx, c.act, hb, hb2, hb, int64_t(P) * F, q8 ? cuda::q8_scratch(g.ctx, F, P) : cuda::Q8Act{});
    const cuda::ExpertOut od[] = {{&down, g.ye}};
    cuda::gemv_experts(g.ctx, od, 1, hb, 1, g.moe_rows, P, q8);
    if (!L.down_exp_b.empty()) cuda::add_rows_id(g.ctx, g.ye, L.down_exp_b[0], g.moe_rows, P, E);
    cuda::moe_combine(g.ctx, c.n_ff_shexp > 0 ? g.acc : xb, g.ye, g.moe_rows, g.moe_w, n, K, E);
    if (c.n_ff_shexp > 0) shared_expert(L, n);
  }
  // A stacked tensor's experts (row views, LayerT::gate_exp...) as one device array.
  static cuda::ExpertWeights stacked(const std::vector<cuda::Weight>& experts) {
    cuda::ExpertWeights w{experts[0], 0};
    if (experts.size() > 1)
      w.expert_bytes = size_t(static_cast<const uint8_t*>(experts[1].data) - static_cast<const uint8_t*>(experts[0].data));
    return w;
  }
  // Expert e's bias (gpt-oss; none when `biases` is empty) added to m rows of width w.
  void expert_bias(const std::vector<const float*>& biases, int e, float* y, int m, int w) {
    if (!biases.empty()) add_rows(y, biases[size_t(e)], m, w);
  }
  // hb = act(hb) * hb2 over count values, launched now (a mixture's experts, not a pending gate).
  void gate_hb(int64_t count) {
    launch_gate(g.ctx, g.c.act, hb, hb2, hb, count);
  }
  // The shared expert (qwen2moe), scaled per token by sigmoid(gate_inp_sh · x), added to the sum
  // of the routed experts in g.acc; then that sum into xb.
  void shared_expert(const GpuLayer& L, int n) {
    const ModelConfig& c = g.c;
    const int E = c.n_embd;
    if (c.n_ff_shexp > 0) {
      cuda::matmul_n(g.ctx, {{&L.gate_sh, hb}, {&L.up_sh, hb2}}, xb, n);
      gate_hb(int64_t(n) * c.n_ff_shexp);
      cuda::matmul(g.ctx, L.down_sh, hb, n, g.ye);
      cuda::matmul(g.ctx, L.gate_inp_sh, xb, n, g.moe_logits);  // (the router's logits are spent)
      cuda::scatter_add_rows(g.ctx, g.acc, g.ye, nullptr, g.moe_logits, true, n, E);
    }
    cuda::copy_on_device(g.ctx, xb, g.acc, size_t(n) * size_t(E) * sizeof(float));
  }
  void add(float* y, const float* in, int n, float s = 1.f) {
    flush();
    cuda::add(g.ctx, y, in, n, s);
  }
  void scale(float* y, float s, int n) {
    flush();
    cuda::scale(g.ctx, y, s, n);
  }
  void add_rows(float* y, const float* bias, int rows, int n) {
    flush();
    cuda::add_rows(g.ctx, y, bias, rows, n);
  }
  // y = act(gt) * u over n_total values; the down projection reads them as rows of n_ff.
  void gate(Activation act, const float* gt, const float* u, float* y, int n_total) {
    flush();
    const int F = g.c.n_ff;
    if (n_total % F != 0) {  // not rows of the FFN width: no consumer to pair with
      launch_gate(g.ctx, act, gt, u, y, n_total);
      return;
    }
    pending = {Pending::Gate, const_cast<float*>(gt), nullptr, nullptr, y, n_total / F, F, u, act};
  }
  void softcap(float* y, float cap, int n) {
    flush();
    cuda::softcap(g.ctx, y, cap, n);
  }

  void rope_and_stage(int l, int n) {
    flush();
    if (decode_only && g.ctx.rope_in_attention) {  // the attention right after it does it
      rope_l = l, rope_n = n;
      return;
    }
    rope_stage(l, n);
  }
  void rope_stage(int l, int n) {
    const ModelConfig& c = g.c;
    const int nq = c.n_embd_q(), nk = c.n_embd_k(), nv = c.n_embd_v();
    const float* fr = g.freqs.at(c.freqs(l).data());
    const bool neox = c.rope_style == RopeStyle::NeoX;
    cuda::rope_stage(g.ctx, g.kv_type, {q, size_t(nq), c.n_head}, {k, size_t(nk), g.k_new, g.k_row, nk},
                     {v, size_t(nv), g.v_new, g.v_row, nv}, n, c.head_dim_k, c.rope_dims(l), g.pos, fr, neox,
                     c.attn_factor(l));  // (rope_dims 0 on a NoPE layer: the staging only)
  }

  void attention(int l, int n) {
    const bool rope_here = std::exchange(rope_l, -1) == l;  // this layer's rope and staging still to do
    flush();
    cuda::AttentionArgs a = attention_args<cuda::AttentionArgs>(g.c, l, n, q, xb2, g.pos, g.seq, g.first, g.row0,
                                                                g.k_new, g.v_new);
    a.kv = g.kv[size_t(l - g.begin)];
    a.sinks = layer(l).sinks;
    // Long runs (prompt chunks) take the tiled prefill kernel, everything between them the split
    // attention, in groups of consecutive rows (the int arrays are per row, so a group is a view).
    auto split = [&](int t0, int t1) {
      if (t1 <= t0) return;
      cuda::AttentionArgs s = a;
      s.n_tokens = t1 - t0;
      s.q = a.q + size_t(t0) * a.q_stride;
      s.out = a.out + size_t(t0) * a.out_stride;
      s.pos = a.pos + t0, s.seq = a.seq + t0, s.first = a.first + t0, s.row0 = a.row0 + t0;
      cuda::attention(g.ctx, s, max_len);
    };
    // Only split attention over the whole batch (a decode step; always in a graph): its combine
    // also writes the 8-bit activations the output projection's GEMV reads.
    bool whole_split = true;
    for (const SeqRun& r : runs) whole_split &= r.n < g.ctx.prefill_min_tokens;
    const cuda::Weight& wo = layer(l).wo;
    const int64_t cols = int64_t(a.n_head) * a.kv.head_dim;
    if (whole_split && n <= g.ctx.gemv_max_cols && cuda::q8_activations(wo.type) && wo.cols == cols &&
        a.out_stride == size_t(cols)) {
      cuda::RopeStage rope;
      if (rope_here) {
        const ModelConfig& c = g.c;
        rope = {k, size_t(c.n_embd_k()), v, size_t(c.n_embd_v()), c.rope_dims(l), g.freqs.at(c.freqs(l).data()),
                c.rope_style == RopeStyle::NeoX, c.attn_factor(l)};
      }
      cuda::attention(g.ctx, a, max_len, true, commit_args(a), rope);  // the commit in the same launches
      q8_of = a.out, q8_rows = n, q8_cols = cols;
      return;
    }
    if (rope_here) rope_stage(l, n);
    int pending = 0;  // first row not yet attended
    for (const SeqRun& r : runs) {
      if (r.n < g.ctx.prefill_min_tokens) continue;
      split(pending, r.t0);
      cuda::AttentionArgs p = a;
      p.n_tokens = r.n;
      p.q = a.q + size_t(r.t0) * a.q_stride;
      p.out = a.out + size_t(r.t0) * a.out_stride;
      cuda::attention_prefill(g.ctx, p, r.seq, r.pos0, r.t0);  // staging rows are batch rows
      ++g.stats.prefill_runs;
      pending = r.t0 + r.n;
    }
    split(pending, n);
    commit(a);
  }
  cuda::KvCommit commit_args(const cuda::AttentionArgs& a) const {
    const auto it = g.commits.find(a.kv.n_cells);
    const int n_commit = commit_n[size_t(std::distance(g.commits.begin(), it))];
    return {g.k_new, g.v_new, it->second.row, it->second.seq, it->second.pos, n_commit};
  }
  void commit(const cuda::AttentionArgs& a) { cuda::kv_commit(g.ctx, a.kv, commit_args(a)); }

  int gather_logit_rows() {
    flush();
    const size_t E = size_t(g.c.n_embd);
    int m = 0;
    for (size_t t = 0; t < logits.size(); ++t)
      if (logits[t]) cuda::copy_on_device(g.ctx, xb + size_t(m++) * E, x + t * E, E * sizeof(float));
    return m;
  }
  // Embeddings (kHidden rows): the m normed rows, packed (n_embd floats apart) at the start of
  // `out`; the host spreads them to their rows when it copies them back (GpuStage::forward).
  bool hidden_rows() const { return std::find(logits.begin(), logits.end(), kHidden) != logits.end(); }
  void copy_hidden_rows(float* out, int m) {
    flush();
    cuda::copy_on_device(g.ctx, out, xb, size_t(m) * size_t(g.c.n_embd) * sizeof(float));
  }
};

}  // namespace

// Tuning knobs of cuda::Context, for measuring them on a GPU (scripts/gpu-check.sh) without a
// rebuild: BATON_GEMV_MAX_COLS, the GEMV -> GEMM cut-over (steps of at most that many tokens are
// also the ones replayed from graphs), BATON_GEMM_SLAB_MIB, the FP16 slab of the GEMM (it may
// only shrink: the planner charges the default's scratch, gpu_ops_scratch_bytes), and BATON_PDL=0,
// which launches GEMVs plainly instead of as programmatic dependent launches (Context::early_launch).
// (BATON_LORA_CHUNK_FLOATS shrinks the LoRA products' chunks, so that tests see several.)
static int env_setting(const char* name, int lo, int hi, int dflt, const char* what) {
  const char* e = std::getenv(name);
  if (!e || !*e) return dflt;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  if (*end != '\0' || v < lo || v > hi) fail(ErrorKind::Usage, "{}={}: expected {} {}..{}", name, e, what, lo, hi);
  return int(v);
}

GpuStage::GpuStage(const gguf::File& f, const ModelConfig& cfg, const Stage& plan, const StageOptions& opt,
                   int device, const std::function<void(uint64_t)>& progress)
    : plan_(plan) {
  BATON_CHECK(opt.n_batch > 0 && opt.n_seq > 0 && opt.n_ctx > 0);
  check_kv_type(cfg, opt.kv_type);
  if (cfg.head_dim_k != cfg.head_dim_v)
    fail(ErrorKind::Usage, "the CUDA attention needs equal K and V head sizes (this model: {} and {})",
         cfg.head_dim_k, cfg.head_dim_v);
  const int hd = cfg.head_dim_k;
  if (hd != 32 && hd != 64 && hd != 96 && hd != 128 && hd != 256)
    fail(ErrorKind::Usage, "the CUDA attention takes head sizes 32, 64, 96, 128 and 256 (this model: {})", hd);
  impl_ = std::make_unique<Impl>(cfg, device);
  Impl& g = *impl_;
  g.file = &f;
  g.begin = int(plan.layer_begin);
  g.end = int(plan.layer_end);
  g.n_batch = opt.n_batch;
  g.n_seq = opt.n_seq;
  g.kv_type = opt.kv_type;
  g.use_graphs = opt.cuda_graphs;  // (not a mixture's steps that route on the host: forward())
  g.moe_device = env_setting("BATON_MOE_DEVICE", 0, 1, 1, "0 or 1") == 1;
  g.n_ctx = opt.n_ctx;
  g.ctx.gemv_max_cols = env_setting("BATON_GEMV_MAX_COLS", 1, 256, g.ctx.gemv_max_cols, "a column count");
  g.ctx.gemv_rows_per_warp = env_setting("BATON_GEMV_ROWS", 1, 2, g.ctx.gemv_rows_per_warp, "1 or 2");
  g.ctx.gemv_split_rows = env_setting("BATON_GEMV_SPLIT", 0, 1, 1, "0 or 1") == 1;
  g.ctx.gemv_stream = env_setting("BATON_GEMV_STREAM", 0, 1, 0, "0 or 1") == 1;
  g.ctx.gemv_tune = env_setting("BATON_GEMV_TUNE", 0, 2, g.ctx.gemv_tune, "a mode (0 off, 1 same bits, 2 any form)");
  if (g.ctx.gemv_stream || g.ctx.gemv_tune > 0) {  // the streamed form's occupancy asked before any capture
    g.ctx.make_current();
    cuda::gemv_stream_prepare();
  }
  const int prefetch_mib = int(g.ctx.gemv_prefetch_bytes >> 20);
  g.ctx.gemv_prefetch_bytes = size_t(env_setting("BATON_GEMV_PREFETCH_MIB", 0, 1024, prefetch_mib, "MiB")) << 20;
  g.ctx.early_launch = g.ctx.early_launch && env_setting("BATON_PDL", 0, 1, 1, "0 or 1") == 1;
  g.ctx.mma_prefill = g.ctx.mma_prefill && env_setting("BATON_MMA_ATTN", 0, 1, 1, "0 or 1") == 1;
  g.ctx.fused_attention = env_setting("BATON_ATTN_FUSED", 0, 1, 1, "0 or 1") == 1;
  g.ctx.rope_in_attention = env_setting("BATON_ATTN_ROPE", 0, 1, 1, "0 or 1") == 1;
  g.trace.on = env_setting("BATON_STEP_TRACE", 0, 1, 0, "0 or 1") == 1;
  const int slab_mib = int(g.ctx.gemm_slab_bytes >> 20);
  g.ctx.gemm_slab_bytes = size_t(env_setting("BATON_GEMM_SLAB_MIB", 1, slab_mib, slab_mib, "MiB")) << 20;
  g.k_row = row_bytes(opt.kv_type, cfg.n_embd_k());
  g.v_row = row_bytes(opt.kv_type, cfg.n_embd_v());

  // Weights: host views of the block (no CPU packing), packed into the device layout through two
  // pinned staging buffers (packing one while the other is copied).
  g.host_w = bind_weights(f, cfg, g.begin, g.end, plan.has_embedding, plan.has_output, nullptr, opt.lora, opt.control);
  const ModelWeights& w = g.host_w;
  g.cpu_moe = opt.cpu_moe && cfg.is_moe() && g.end > g.begin;
  if (g.cpu_moe) {  // the experts packed for the CPU kernels, the rest of the host views unused
    g.pool = std::make_unique<cpu::ThreadPool>(std::max(1, opt.n_threads));
    g.host_scratch = std::make_unique<Scratch>(cfg, opt.n_batch, opt.kv_type);
    std::vector<cpu::QMatrix*> experts;
    for (int l = g.begin; l < g.end; ++l) {
      LayerWeights& H = g.host_w.layers[size_t(l)];
      for (size_t e = 0; e < H.gate_exp.size(); ++e)
        for (cpu::QMatrix* m : {&H.gate_exp[e], &H.up_exp[e], &H.down_exp[e]}) experts.push_back(m);
    }
    pack_matrices(g.host_w, experts, *g.pool, &f);
    g.notes.push_back(fmt::format("experts of layers [{}, {}) in host memory, run by {} CPU threads (--cpu-moe)",
                                  g.begin, g.end, g.pool->size()));
  }
  uint64_t done = 0;
  cuda::WeightUploader up(g.ctx);
  g.layers.resize(size_t(cfg.n_layer));
  for (int l = g.begin; l < g.end; ++l) {
    const LayerWeights& H = w.layers[size_t(l)];
    GpuLayer& L = g.layers[size_t(l)];
    const std::string name = "layer " + std::to_string(l);
    L.wq = g.upload_matrix(up, H.wq, name.c_str(), done, progress);
    L.wk = g.upload_matrix(up, H.wk, name.c_str(), done, progress);
    L.wv = g.upload_matrix(up, H.wv, name.c_str(), done, progress);
    L.wo = g.upload_matrix(up, H.wo, name.c_str(), done, progress);
    if (cfg.is_moe()) {
      L.router = g.upload_matrix(up, H.router, name.c_str(), done, progress);
      if (!g.cpu_moe) {  // (--cpu-moe: the experts stay on the host)
        // Each stacked tensor in one upload, its experts row views of the device matrix.
        auto stacked = [&](const std::vector<cpu::QMatrix>& views, std::vector<cuda::Weight>& out) {
          cpu::QMatrix all = views[0];
          all.rows *= int64_t(views.size());
          const cuda::Weight w = g.upload_matrix(up, all, name.c_str(), done, progress);
          for (size_t e = 0; e < views.size(); ++e) {
            cuda::Weight v = w;
            v.data = static_cast<const uint8_t*>(w.data) + e * size_t(views[0].rows) * w.row_stride;
            v.rows = views[0].rows;
            out.push_back(v);
          }
        };
        if (cfg.fused_gate_up_exps) {  // one tensor: expert e's gate rows, then its up rows
          const int64_t F = cfg.n_ff_exp;
          cpu::QMatrix all = H.gate_exp[0];
          all.rows = 2 * F * cfg.n_expert;
          const cuda::Weight w = g.upload_matrix(up, all, name.c_str(), done, progress);
          for (int64_t e = 0; e < cfg.n_expert; ++e)
            for (auto [out, first] : {std::pair{&L.gate_exp, 2 * F * e}, {&L.up_exp, 2 * F * e + F}}) {
              cuda::Weight v = w;
              v.data = static_cast<const uint8_t*>(w.data) + size_t(first) * w.row_stride;
              v.rows = F;
              out->push_back(v);
            }
        } else {
          stacked(H.gate_exp, L.gate_exp);
          stacked(H.up_exp, L.up_exp);
        }
        stacked(H.down_exp, L.down_exp);
      }
      if (cfg.n_ff_shexp > 0) {
        L.gate_sh = g.upload_matrix(up, H.gate_sh, name.c_str(), done, progress);
        L.up_sh = g.upload_matrix(up, H.up_sh, name.c_str(), done, progress);
        L.down_sh = g.upload_matrix(up, H.down_sh, name.c_str(), done, progress);
        L.gate_inp_sh = g.upload_matrix(up, H.gate_inp_sh, name.c_str(), done, progress);
      }
    } else {
      L.gate = g.upload_matrix(up, H.gate, name.c_str(), done, progress);
      L.up = g.upload_matrix(up, H.up, name.c_str(), done, progress);
      L.down = g.upload_matrix(up, H.down, name.c_str(), done, progress);
    }
    const size_t E = size_t(cfg.n_embd);
    L.attn_norm = g.upload_floats(H.attn_norm, E);  // (null: no pre-norms, olmo2)
    L.ffn_norm = g.upload_floats(H.ffn_norm, E);
    L.q_norm = g.upload_floats(H.q_norm, size_t(cfg.q_norm_width()));  // a head, or the whole row
    L.k_norm = g.upload_floats(H.k_norm, size_t(cfg.k_norm_width()));
    L.post_attn_norm = g.upload_floats(H.post_attn_norm, E);
    L.post_ffn_norm = g.upload_floats(H.post_ffn_norm, E);
    L.bq = g.upload_floats(H.bq, size_t(cfg.n_embd_q()));
    L.bk = g.upload_floats(H.bk, size_t(cfg.n_embd_k()));
    L.bv = g.upload_floats(H.bv, size_t(cfg.n_embd_v()));
    L.bo = g.upload_floats(H.bo, E);
    L.sinks = g.upload_floats(H.sinks, size_t(cfg.n_head));
    L.control = g.upload_floats(H.control, E);
    if (cfg.is_moe() && cfg.moe_bias) {
      L.router_b = g.upload_floats(H.router_b, size_t(cfg.n_expert));
      // Each stacked bias tensor in one upload; expert e's bias at e · width.
      auto biases = [&](const std::vector<const float*>& host, size_t width, std::vector<const float*>& out) {
        const float* all = g.upload_floats(host[0], width * size_t(cfg.n_expert));
        for (int e = 0; e < cfg.n_expert; ++e) out.push_back(all + size_t(e) * width);
      };
      if (!g.cpu_moe) {
        biases(H.gate_exp_b, size_t(cfg.n_ff_exp), L.gate_exp_b);
        biases(H.up_exp_b, size_t(cfg.n_ff_exp), L.up_exp_b);
        biases(H.down_exp_b, E, L.down_exp_b);
      }
    }
    const std::vector<float>& fr = cfg.freqs(l);
    if (!g.freqs.count(fr.data())) g.freqs[fr.data()] = g.upload_floats(fr.data(), fr.size());
  }
  if (plan.has_embedding) g.tok_embd = g.upload_matrix(up, w.tok_embd, "token_embd", done, progress);
  if (plan.has_output) {
    const bool shared = cfg.tied_output && plan.has_embedding;  // one copy serves both
    g.output = shared ? g.tok_embd : g.upload_matrix(up, w.output, "output", done, progress);
    g.output_norm = g.upload_floats(w.output_norm, size_t(cfg.n_embd));
  }

  // LoRA pairs (the binding's row-major F16 copies), keyed by the device matrix they adapt.
  if (!w.lora.empty() || !w.lora_embd.empty()) {
    std::map<const void*, cuda::Weight> a_of;  // host A -> its device copy (shared by a fused tensor's parts)
    auto pair = [&](const ModelWeights::LoraMul& m, const char* what) {
      auto [it, fresh] = a_of.try_emplace(m.a.data);
      if (fresh) it->second = g.upload_matrix(up, m.a, what, done, progress);
      return Impl::Lora{it->second, g.upload_matrix(up, m.b, what, done, progress), m.scale};
    };
    auto adapt = [&](const cpu::QMatrix& host, const cuda::Weight& dev, const char* what) {
      if (!host.data) return;
      const auto [lo, hi] = w.lora.equal_range(host.data);
      for (auto it = lo; it != hi; ++it) g.lora[dev.data].push_back(pair(it->second, what));
    };
    for (int l = g.begin; l < g.end; ++l) {
      const LayerWeights& H = w.layers[size_t(l)];
      const GpuLayer& L = g.layers[size_t(l)];
      const std::string name = "layer " + std::to_string(l) + " LoRA";
      for (auto [h, d] : {std::pair{&H.wq, &L.wq}, {&H.wk, &L.wk}, {&H.wv, &L.wv}, {&H.wo, &L.wo}, {&H.gate, &L.gate},
                          {&H.up, &L.up}, {&H.down, &L.down}})
        adapt(*h, *d, name.c_str());
    }
    if (plan.has_output) adapt(w.output, g.output, "output LoRA");
    for (const ModelWeights::LoraMul& m : w.lora_embd) g.lora_embd.push_back(pair(m, "token_embd LoRA"));
    g.lora_floats = env_setting("BATON_LORA_CHUNK_FLOATS", 1, int(kLoraChunkFloats), int(kLoraChunkFloats), "a float count");
    g.lora_buf = g.alloc_n<float>(kLoraChunkFloats);
  }

  up.finish();
  g.host_w.lora.clear();  // (uploaded: the host copies are spent)
  g.host_w.lora_embd.clear();
  g.host_w.lora_mem.clear();

  // KV cache: the cells of each layer as the CPU cache has them (rings for sliding-window layers),
  // position-major on the device (kernels/cuda/ops.h).
  KvCacheShape ks;
  ks.layer_begin = g.begin;
  ks.layer_end = g.end;
  ks.n_seq = opt.n_seq;
  ks.n_ctx = opt.n_ctx;
  ks.type = opt.kv_type;
  max_rewind_ = KvCache::max_rewind(cfg, ks);
  copy_limit_ = KvCache::copy_limit(cfg, ks);
  for (int l = g.begin; l < g.end; ++l) {
    cuda::KvLayer L;
    L.type = opt.kv_type;
    L.n_cells = KvCache::cells(cfg, ks, l);
    L.k_row = g.k_row;
    L.v_row = g.v_row;
    L.n_head_kv = cfg.n_head_kv;
    L.head_dim = cfg.head_dim_k;
    L.k = g.alloc_n<uint8_t>(g.k_row * size_t(L.n_cells) * size_t(opt.n_seq));
    L.v = g.alloc_n<uint8_t>(g.v_row * size_t(L.n_cells) * size_t(opt.n_seq));
    g.kv.push_back(L);
  }

  // Scratch, sized for n_batch tokens once.
  const size_t B = size_t(opt.n_batch);
  g.x = g.alloc_n<float>(B * size_t(cfg.n_embd));
  g.xb = g.alloc_n<float>(B * size_t(cfg.n_embd));
  g.xb2 = g.alloc_n<float>(B * size_t(cfg.n_embd_attn()));
  g.q = g.alloc_n<float>(B * size_t(cfg.n_embd_q()));
  g.k = g.alloc_n<float>(B * size_t(cfg.n_embd_k()));
  g.v = g.alloc_n<float>(B * size_t(cfg.n_embd_v()));
  g.hb = g.alloc_n<float>(Scratch::ffn_rows(cfg, opt.n_batch));
  g.hb2 = g.alloc_n<float>(Scratch::ffn_rows(cfg, opt.n_batch));
  if (cfg.is_moe() && g.end > g.begin) {
    const size_t K = size_t(cfg.n_expert_used), E = size_t(cfg.n_embd);
    g.moe_logits = g.alloc_n<float>(B * size_t(cfg.n_expert));
    g.xe = g.alloc_n<float>(B * E);
    g.ye = g.alloc_n<float>(size_t(moe_expert_rows(B, K)) * E);
    g.acc = g.alloc_n<float>(B * E);
    g.moe_rows = g.alloc_n<int32_t>(B * K);
    g.moe_w = g.alloc_n<float>(B * K);
    g.h_logits.resize(B * size_t(cfg.n_expert));
    g.h_route_ids.resize(B * K);
    g.h_route_w.resize(B * K);
    g.h_rows.resize(B * K);
    g.h_w.resize(B * K);
    g.h_expert_first.resize(size_t(cfg.n_expert) + 1);
  }
  g.k_new = g.alloc_n<uint8_t>(B * g.k_row);
  g.v_new = g.alloc_n<uint8_t>(B * g.v_row);
  const size_t R = size_t(opt.outputs());  // output rows of a step
  g.n_outputs = int(R);
  if (plan.has_output) {
    g.logits = g.alloc_n<float>(R * size_t(cfg.n_vocab));
    g.ids = g.alloc_n<int32_t>(R);
    g.h_ids.reserve(R);
    g.top_k = top_k_candidates(cfg.n_vocab);
    if (g.top_k > 0) {
      g.top_ids = g.alloc_n<int32_t>(R * size_t(g.top_k));
      g.top_vals = g.alloc_n<float>(R * size_t(g.top_k));
      g.h_top_ids.reserve(R * size_t(g.top_k));
      g.h_top_vals.reserve(R * size_t(g.top_k));
    }
  }
  g.h_first.resize(B);
  g.h_row0.resize(B);
  g.h_row.resize(B);
  for (const cuda::KvLayer& L : g.kv) {
    if (g.commits.count(L.n_cells)) continue;
    Impl::Commit& cm = g.commits[L.n_cells];
    for (std::vector<int32_t>* h : {&cm.h_row, &cm.h_seq, &cm.h_pos}) h->reserve(B);
  }
  const size_t n_ints = (5 + 3 * g.commits.size()) * B;
  g.ints = g.alloc_n<int32_t>(n_ints);
  g.h_ints.reserve(n_ints);

  // The ops' shared scratch (activation quants, FP16 slabs, attention split partials), reserved
  // now for the widest step so that no op grows it (which would synchronize) during a step.
  size_t scratch = 0;
  for (int l = g.begin; l < g.end; ++l) {
    const GpuLayer& L = g.layers[size_t(l)];
    for (const cuda::Weight* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down, &L.router, &L.gate_sh,
                                  &L.up_sh, &L.down_sh, &L.gate_inp_sh})
      if (m->data) scratch = std::max(scratch, cuda::matmul_scratch_bytes(g.ctx, *m, opt.n_batch));
    if (!L.gate_exp.empty())  // every expert of a tensor has the first one's shape
      for (const cuda::Weight* m : {&L.gate_exp[0], &L.up_exp[0], &L.down_exp[0]})
        scratch = std::max(scratch, cuda::matmul_scratch_bytes(g.ctx, *m, opt.n_batch));
  }
  if (plan.has_output) scratch = std::max(scratch, cuda::matmul_scratch_bytes(g.ctx, g.output, opt.n_batch));
  for (const auto& [W, pairs] : g.lora)
    for (const Impl::Lora& p : pairs)
      for (const cuda::Weight* m : {&p.a, &p.b}) scratch = std::max(scratch, cuda::matmul_scratch_bytes(g.ctx, *m, opt.n_batch));
  for (const Impl::Lora& p : g.lora_embd) scratch = std::max(scratch, cuda::matmul_scratch_bytes(g.ctx, p.b, opt.n_batch));
  if (g.end > g.begin)
    for (int n = 1; n <= opt.n_batch; ++n)  // the split count depends on the token count
      scratch = std::max(scratch, cuda::attention_scratch_bytes(g.ctx, n, cfg.n_head, cfg.head_dim_k, opt.n_ctx));
  if (plan.has_output)
    scratch = std::max(scratch, cuda::sampling_scratch_bytes(int(cfg.n_vocab), int(std::min<size_t>(R, cuda::Context::kCounters)),
                                                             std::max(1, g.top_k)));
  // What the planner charged (a bound for any GPU), unless this GPU needs more.
  scratch = std::max<size_t>(scratch, gpu_ops_scratch_bytes(shape_from_gguf(f), uint32_t(opt.n_batch), plan.has_output,
                                                            uint32_t(R)));
  g.ctx.reserve(scratch);
  if (g.ctx.gemv_tune > 0) g.tune_gemvs(opt.n_seq, g.ctx.gemv_tune == 1);
  g.ctx.synchronize();
}

GpuStage::~GpuStage() {
  const Impl::Trace& t = impl_->trace;
  if (t.on && t.steps > 0) {
    const double k = 1e-3 / double(t.steps);
    std::fprintf(stderr,
                 "step trace cuda:%d layers [%d, %d): %llu steps, host us per step: inputs %.1f, link in %.1f, "
                 "ops %.1f, link out %.1f, results %.1f\n",
                 impl_->ctx.device(), impl_->begin, impl_->end, (unsigned long long)t.steps, t.ns[0] * k, t.ns[1] * k,
                 t.ns[2] * k, t.ns[3] * k, t.ns[4] * k);
  }
}

void GpuStage::forward(const Batch& batch, float* x, float* logits) {
  Handoff h;
  forward(batch, x, logits, h);
}

void GpuStage::connect(GpuLink* in, GpuLink* out) {
  BATON_CHECK(!(in && plan_.has_embedding) && !(out && plan_.has_output));
  impl_->in = in;
  impl_->out = out;
}

void GpuStage::connect_channels(DeviceChannel* in, DeviceChannel* out) {
  BATON_CHECK(!(in && plan_.has_embedding) && !(out && plan_.has_output));
  BATON_CHECK(!(in && impl_->in) && !(out && impl_->out));
  impl_->net_in = in;
  impl_->net_out = out;
}

cuda::Context& GpuStage::context() { return impl_->ctx; }

void GpuStage::forward(const Batch& batch, float* x, float* logits, Handoff& h) {
  Impl& g = *impl_;
  BATON_CHECK(h.in_slot < 0 || g.in);
  // The input slot goes back to the previous stage when the step has enqueued its copy out of it
  // (the link orders the refill after that copy on the device), or when the step fails.
  struct SlotGuard {
    GpuLink* link;
    int slot;
    ~SlotGuard() {
      if (link && slot >= 0) link->release(slot);
    }
  } in_guard{g.in, h.in_slot};
  h.in_slot = -1;
  h.out_slot = -1;
  const ModelConfig& c = g.c;
  const int n = batch.size();
  BATON_CHECK(n >= 1 && n <= g.n_batch);
  g.trace.mark(-1);
  g.trace.steps += g.trace.on;
  g.ctx.make_current();

  // Staging rows are the batch rows: the attention and commit kernels read a sequence's staged
  // keys from row0 on, so each sequence's tokens must be contiguous in the batch (as the engine
  // and the pipeline build them).
  // Sequence copies first, on the stream (so after every earlier batch's writes, and outside any
  // graph a step captures): positions 0..n-1 are cells 0..n-1 of each layer, one run of rows.
  for (const SeqCopy& cp : batch.copies)
    for (const cuda::KvLayer& L : g.kv) {
      BATON_CHECK(cp.n <= L.n_cells);
      const size_t from = size_t(cp.src) * size_t(L.n_cells), to = size_t(cp.dst) * size_t(L.n_cells);
      cuda::copy_on_device(g.ctx, L.k + to * L.k_row, L.k + from * L.k_row, size_t(cp.n) * L.k_row);
      cuda::copy_on_device(g.ctx, L.v + to * L.v_row, L.v + from * L.v_row, size_t(cp.n) * L.v_row);
    }
  stage_rows(batch, g.n_seq, g.h_first.data(), g.h_row0.data(), g.h_row.data());
  int max_len = 1;
  for (int t = 0; t < n; ++t) {
    if (g.h_row[size_t(t)] != t)
      fail(ErrorKind::Usage, "CUDA stage: the tokens of sequence {} are not contiguous in the batch", batch.seq[size_t(t)]);
    max_len = std::max(max_len, batch.pos[size_t(t)] + 1);
  }
  // The step's int arrays: slice k of the packed host array (n entries from k * n) goes to the
  // same slice of g.ints, all in one copy. A graph is captured per token count, so its pointers
  // are those of every later step of its shape.
  const size_t N = size_t(n);
  g.h_ints.resize((5 + 3 * g.commits.size()) * N);
  size_t slot = 0;
  auto put = [&](const int32_t* src, size_t count) {
    std::copy_n(src, count, g.h_ints.data() + slot * N);
    return g.ints + N * slot++;
  };
  g.tok = put(batch.token.data(), N);
  g.pos = put(batch.pos.data(), N);
  g.seq = put(batch.seq.data(), N);
  g.first = put(g.h_first.data(), N);
  g.row0 = put(g.h_row0.data(), N);
  std::vector<int32_t> last;  // per sequence, its last position in the batch
  last_positions(batch, g.n_seq, last);
  for (auto& [n_cells, cm] : g.commits) {
    cm.h_row.clear();
    cm.h_seq.clear();
    cm.h_pos.clear();
    for (int t = 0; t < n; ++t) {
      if (batch.pos[size_t(t)] <= last[size_t(batch.seq[size_t(t)])] - n_cells) continue;  // a later token takes its cell
      cm.h_row.push_back(g.h_row[size_t(t)]);
      cm.h_seq.push_back(batch.seq[size_t(t)]);
      cm.h_pos.push_back(batch.pos[size_t(t)]);
    }
    cm.n = int(cm.h_row.size());
    cm.row = put(cm.h_row.data(), size_t(cm.n));
    cm.seq = put(cm.h_seq.data(), size_t(cm.n));
    cm.pos = put(cm.h_pos.data(), size_t(cm.n));
  }
  cuda::copy_to_device(g.ctx, g.ints, g.h_ints.data(), slot * N * sizeof(int32_t));  // pageable: copied before return

  const size_t xbytes = size_t(n) * size_t(c.n_embd) * sizeof(float);
  g.trace.mark(0);
  if (!plan_.has_embedding) {
    if (in_guard.slot >= 0) {
      g.in->receive(in_guard.slot, g.x, xbytes);
      g.in->release(std::exchange(in_guard.slot, -1));
    } else if (g.net_in) {
      g.net_in->recv(g.x, xbytes);
    } else {
      cuda::copy_to_device(g.ctx, g.x, x, xbytes);
    }
  }
  g.trace.mark(1);
  const size_t m = size_t(batch.n_logits()), V = size_t(c.n_vocab);
  BATON_CHECK(m <= size_t(g.n_outputs));  // (the pipeline cuts batches that ask more)
  // kArgmaxOnly rows: the argmax on the device, and only the ids come back (a greedy step does
  // not copy vocabulary rows to the host); kTopK rows: the K best ids and logits; full rows only
  // when some token asks for them.
  bool any_row = false, any_argmax = false, any_top = false;
  for (uint8_t mode : batch.logits)
    any_row |= mode == kLogitsRow, any_argmax |= mode == kArgmaxOnly, any_top |= mode == kTopK;

  // The step's ops: embedding lookup, the family's layers, the head and the argmax. Steps of at
  // most gemv_max_cols tokens (decode: no cuBLAS) are captured once per shape and replayed; the
  // attention then takes n_ctx as its bound, so one graph serves every position.
  const bool graph = g.use_graphs && n <= g.ctx.gemv_max_cols && (!c.is_moe() || g.routes_on_device(n));
  CudaLayers b{g, batch.logits, {}, graph ? g.n_ctx : max_len, {}};
  for (const auto& [n_cells, cm] : g.commits) b.commit_n.push_back(cm.n);
  b.decode_only = true;
  for (int t = 0; t < n; ++t) b.decode_only &= g.h_first[size_t(t)] == batch.pos[size_t(t)] && g.h_row0[size_t(t)] == t;
  if (!graph)
    for (int t = 0; t < n; ++t) {
      if (t == 0 || batch.seq[size_t(t)] != batch.seq[size_t(t - 1)]) b.runs.push_back({t, 0, batch.seq[size_t(t)], batch.pos[size_t(t)]});
      b.runs.back().n++;
    }
  const bool embed = plan_.has_embedding, head = plan_.has_output;
  auto record = [&g, b, n, embed, head, any_argmax, any_top, m]() mutable {
    const ModelConfig& cfg = g.c;
    if (embed) {
      cuda::embed_rows(g.ctx, g.tok_embd, g.tok, n, g.x, cfg.embd_scale);
      b.lora_embedding(g.tok, n, g.x);
    }
    llama_layers(cfg, b, n, g.begin, g.end);
    b.flush();
    if (head) {
      llama_head(cfg, b, g.logits);
      b.flush();
      if (any_argmax) cuda::argmax(g.ctx, g.logits, cfg.n_vocab, int(m), g.ids);
      if (any_top) cuda::top_k(g.ctx, g.logits, cfg.n_vocab, int(m), g.top_k, g.top_ids, g.top_vals);
    }
  };
  if (graph) {
    GraphKey key{n, b.logits, b.commit_n, b.decode_only};
    if (g.graph_scratch != g.ctx.scratch_generation()) {  // the scratch moved: the graphs point at the old one
      g.graphs.clear();
      g.graph_scratch = g.ctx.scratch_generation();
    }
    auto it = g.graphs.find(key);
    if (it == g.graphs.end()) {
      if (g.graphs.size() >= kMaxGraphs) g.graphs.clear();  // shapes keep changing: start over
      it = g.graphs.emplace(std::move(key), cuda::capture(g.ctx, std::function<void()>(record))).first;
      ++g.stats.captured;
    }
    cuda::launch(g.ctx, it->second);
    ++g.stats.launched;
  } else {
    record();
  }
  g.trace.mark(2);

  if (plan_.has_output) {
    if (any_argmax) {
      g.h_ids.resize(m);
      cuda::copy_to_host(g.ctx, g.h_ids.data(), g.ids, m * sizeof(int32_t));
    }
    const size_t K = size_t(g.top_k);
    if (any_top) {
      g.h_top_ids.resize(m * K);
      g.h_top_vals.resize(m * K);
      cuda::copy_to_host(g.ctx, g.h_top_ids.data(), g.top_ids, m * K * sizeof(int32_t));
      cuda::copy_to_host(g.ctx, g.h_top_vals.data(), g.top_vals, m * K * sizeof(float));
    }
    if (any_row && m > 0) cuda::copy_to_host(g.ctx, logits, g.logits, m * V * sizeof(float));
    const size_t E = size_t(c.n_embd);  // kHidden rows (all of the batch's rows, or none): packed on the device
    const bool hidden = std::find(batch.logits.begin(), batch.logits.end(), kHidden) != batch.logits.end();
    if (hidden) {
      cuda::copy_to_host(g.ctx, logits, g.logits, m * E * sizeof(float));
      g.ctx.synchronize();
      for (size_t r = m; r-- > 1;) std::memmove(logits + r * V, logits + r * E, E * sizeof(float));  // (V >= E)
    }
    if (any_argmax || any_top) {
      g.ctx.synchronize();
      for (size_t t = 0, r = 0; t < size_t(n); ++t) {
        if (batch.logits[t] == kNoLogits) continue;
        if (batch.logits[t] == kArgmaxOnly) set_argmax_token(logits + r * V, g.h_ids[r]);
        if (batch.logits[t] == kTopK) set_top_k_row(logits + r * V, g.top_k, &g.h_top_ids[r * K], &g.h_top_vals[r * K]);
        ++r;
      }
    }
  } else if (g.out) {
    // Enqueued behind the step: the next stage's stream waits for it on the device, and this
    // stream's next step runs after it, so nothing here waits for the GPU.
    h.out_slot = g.out->send(g.x, xbytes);
    g.trace.mark(3);
    return;
  } else if (g.net_out) {
    g.net_out->send(g.x, xbytes);  // the same: the stream orders the next step after the send
    return;
  } else {
    cuda::copy_to_host(g.ctx, x, g.x, xbytes);
  }
  g.ctx.synchronize();
  g.trace.mark(4);
}

uint64_t GpuStage::measured_bytes() const { return impl_->bytes + impl_->ctx.scratch_size(); }
GpuStage::Stats GpuStage::stats() const { return impl_->stats; }
std::vector<std::string> GpuStage::notes() const { return impl_->notes; }

#else  // no CUDA in this build, and no emulation

struct GpuStage::Impl {};

GpuStage::GpuStage(const gguf::File&, const ModelConfig&, const Stage& plan, const StageOptions&, int device,
                   const std::function<void(uint64_t)>&)
    : plan_(plan) {
  fail(ErrorKind::Usage, "device cuda:{}: this build of baton has no CUDA backend (rebuild with -DBATON_CUDA=ON)",
       device);
}
GpuStage::~GpuStage() = default;
void GpuStage::forward(const Batch&, float*, float*) { BATON_CHECK(false); }
void GpuStage::forward(const Batch&, float*, float*, Handoff&) { BATON_CHECK(false); }
void GpuStage::connect(GpuLink*, GpuLink*) { BATON_CHECK(false); }
void GpuStage::connect_channels(DeviceChannel*, DeviceChannel*) { BATON_CHECK(false); }
cuda::Context& GpuStage::context() { BATON_CHECK(false); std::abort(); }
GpuStage::Stats GpuStage::stats() const { return {}; }
uint64_t GpuStage::measured_bytes() const { return 0; }
std::vector<std::string> GpuStage::notes() const { return {}; }

#endif

}  // namespace baton
