// One forward for the llama family. Family differences are the ModelConfig flags, read top to
// bottom: embedding scale, q/k bias, q/k norm, RoPE style and per-layer base, sliding window,
// post-norms, gate activation, final softcap.
#include "models/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <unordered_map>

#include "gguf/gguf.h"
#include "kernels/cpu/matmul_multi.h"
#include "kernels/cpu/ops.h"
#include "models/llama_forward.h"
#include "quant/quant.h"
#include "runtime/kv_cache.h"

namespace baton {

namespace {

cpu::QMatrix matrix(const gguf::TensorInfo& t) {
  cpu::QMatrix m;
  m.type = t.type;
  m.data = t.data;
  m.cols = t.ne[0];
  m.rows = t.ne[1];
  m.row_bytes = row_bytes(t.type, t.ne[0]);
  return m;
}

// Rows [first, first + n) of a matrix: whole rows are contiguous in every type, so a view.
cpu::QMatrix rows_of(const cpu::QMatrix& m, int64_t first, int64_t n) {
  BATON_CHECK(0 <= first && first + n <= m.rows);
  cpu::QMatrix v = m;
  v.data = static_cast<const uint8_t*>(m.data) + size_t(first) * m.row_bytes;
  v.rows = n;
  return v;
}

const float* floats(const gguf::TensorInfo& t) { return reinterpret_cast<const float*>(t.data); }

// m's values as an F16 (or, never packed, F32) matrix of rows × cols (m at the top left, zeros
// elsewhere) in a buffer that `mem` keeps (F16: of packed_bytes(F16, rows, cols)); in the float
// tiles' layout when `pack` and this CPU packs such rows.
cpu::QMatrix float_padded(const cpu::QMatrix& m, int64_t rows, int64_t cols, bool pack, std::vector<cpu::PackedBuffer>& mem,
                        GgmlType type = GgmlType::F16) {
  cpu::QMatrix out;
  out.type = type;
  out.rows = rows;
  out.cols = cols;
  out.row_bytes = row_bytes(type, cols);
  std::vector<uint8_t> rm(size_t(rows) * out.row_bytes, 0);  // (all-zero bits: +0 in F16 and F32)
  std::vector<float> row(static_cast<size_t>(cols), 0.f);
  for (int64_t r = 0; r < m.rows; ++r) {
    dequantize_row(m.type, m.row(r), row.data(), m.cols);
    quantize_row(type, row.data(), rm.data() + size_t(r) * out.row_bytes, cols);
  }
  mem.push_back(cpu::alloc_packed(type == GgmlType::F16 ? cpu::packed_bytes(type, rows, cols) : rm.size()));
  uint8_t* buf = mem.back().get();
  out.data = buf;
  if (pack && cpu::packing_enabled(type, cols)) {
    cpu::QMatrix src = out;
    src.data = rm.data();
    cpu::pack_matrix(src, buf);
    out.packed = buf;
  } else {
    std::memcpy(buf, rm.data(), rm.size());
  }
  return out;
}

// Rows [first, first + n) of a matrix as float_padded made it: a view of the row-major copy, or of
// the packed one when `first` starts a 16-row group.
cpu::QMatrix padded_rows(const cpu::QMatrix& m, int64_t first, int64_t n) {
  if (!m.packed) return rows_of(m, first, n);
  BATON_CHECK(first % cpu::kPackRows == 0 && first + n <= m.rows);
  cpu::QMatrix v = m;
  v.packed = m.packed + cpu::packed_bytes(m.type, first, m.cols);
  v.data = v.packed;
  v.rows = n;
  return v;
}

// The adapters' pairs of the tensors this binding holds, keyed by the matrices they adapt, as
// F16 copies of the padded rank (ModelWeights::LoraMul); a fused tensor's B splits as the tensor
// does (q, k, v or gate, up rows). For a CPU stage (`cpu`) packed when every part starts a 16-row
// group, the embedding's A as mapped; for a GPU stage all row-major, the embedding's A too, padded
// (the device uploads them as they are: lora_gpu_bytes).
void attach_lora(ModelWeights& w, const LoraAdapters& adapters, const ModelConfig& c, int begin, int end,
                 bool with_embed, bool with_head, bool cpu) {
  struct Part {
    const cpu::QMatrix* m;
    int64_t first, rows;
  };
  std::unordered_map<std::string, std::vector<Part>> held;  // base tensor -> the matrices it is bound as
  auto whole = [](const cpu::QMatrix& m) { return Part{&m, 0, m.rows}; };
  if (with_head) held["output.weight"] = {whole(w.output)};
  for (int l = begin; l < end; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    const int64_t nq = c.n_embd_q(), nk = c.n_embd_k(), F = c.n_ff;
    if (c.fused_qkv) {
      held[layer_tensor_key(l, LayerTensor::Wqkv)] = {{&L.wq, 0, nq}, {&L.wk, nq, nk}, {&L.wv, nq + nk, c.n_embd_v()}};
    } else {
      held[layer_tensor_key(l, LayerTensor::Wq)] = {whole(L.wq)};
      held[layer_tensor_key(l, LayerTensor::Wk)] = {whole(L.wk)};
      held[layer_tensor_key(l, LayerTensor::Wv)] = {whole(L.wv)};
    }
    held[layer_tensor_key(l, LayerTensor::Wo)] = {whole(L.wo)};
    if (c.is_moe()) continue;
    if (c.fused_gate_up) {
      held[layer_tensor_key(l, LayerTensor::Up)] = {{&L.gate, 0, F}, {&L.up, F, F}};
    } else {
      held[layer_tensor_key(l, LayerTensor::Gate)] = {whole(L.gate)};
      held[layer_tensor_key(l, LayerTensor::Up)] = {whole(L.up)};
    }
    held[layer_tensor_key(l, LayerTensor::Down)] = {whole(L.down)};
  }
  for (const LoraTensor& t : adapters.tensors()) {
    const cpu::QMatrix A = matrix(*t.a), B = matrix(*t.b);
    const int64_t rp = lora_padded_rank(B.cols);
    const uint64_t b_bytes = cpu::packed_bytes(GgmlType::F16, B.rows, rp);  // what float_padded allocates
    if (t.name == "token_embd.weight") {
      if (!with_embed) continue;
      // (A GPU's copy of A: F16 rows when the file's are, else F32, so that both kinds of stage
      // multiply by the file's values: lora_embd_gpu_type.)
      const cpu::QMatrix a = cpu ? A : float_padded(A, A.rows, rp, false, w.lora_mem, lora_embd_gpu_type(A.type));
      w.lora_embd.push_back({a, float_padded(B, B.rows, rp, cpu, w.lora_mem), t.scale});
      w.lora_bytes += t.a->nbytes + b_bytes;  // (A as mapped)
    } else {
      const auto it = held.find(t.name);
      if (it == held.end()) continue;
      bool pack = cpu;
      for (const Part& p : it->second) pack &= p.first % cpu::kPackRows == 0;
      const cpu::QMatrix a = float_padded(A, rp, A.cols, cpu, w.lora_mem);
      const cpu::QMatrix b = float_padded(B, B.rows, rp, pack, w.lora_mem);
      for (const Part& p : it->second) w.lora.emplace(p.m->data, ModelWeights::LoraMul{a, padded_rows(b, p.first, p.rows), t.scale});
      w.lora_bytes += cpu::packed_bytes(GgmlType::F16, rp, A.cols) + b_bytes;
    }
  }
}

// y (n rows of b.rows) += s·B·h for h (n rows of b.cols, the padded rank): in slices of rows so
// that B·h never takes more than ~4 MiB (an adapted head is n_vocab wide).
void lora_add(const cpu::QMatrix& b, const float* h, int n, float* y, float s, cpu::ThreadPool& pool) {
  thread_local std::vector<float> bh;  // (only grows)
  const int step = int(std::max<int64_t>(1, (int64_t(1) << 20) / b.rows));
  for (int j = 0; j < n; j += step) {
    const int m = std::min(step, n - j);
    bh.resize(size_t(m) * size_t(b.rows));
    cpu::matmul(b, h + size_t(j) * size_t(b.cols), m, bh.data(), pool);
    cpu::add(y + size_t(j) * size_t(b.rows), bh.data(), m * int(b.rows), s);
  }
}

}  // namespace

ModelWeights bind_weights(const gguf::File& f, const ModelConfig& c, int begin, int end,
                          bool with_embed, bool with_head, cpu::ThreadPool* pack_pool,
                          const LoraAdapters* adapters, const ControlVectors* control) {
  BATON_CHECK(0 <= begin && begin <= end && end <= c.n_layer);
  ModelWeights w;
  // A norm weight as stored, or a copy with Gemma's +1 when the file did not fold it in.
  auto norm = [&](const std::string& name) -> const float* {
    const gguf::TensorInfo& t = f.require_tensor(name);
    if (!c.norm_add_one) return floats(t);
    std::vector<float> v(floats(t), floats(t) + t.nelements());
    for (float& x : v) x += 1.f;
    w.owned.push_back(std::move(v));
    return w.owned.back().data();
  };
  auto opt = [&](int l, LayerTensor t) { return c.has(t) ? floats(f.require_tensor(layer_tensor_key(l, t))) : nullptr; };
  auto mat = [&](int l, LayerTensor t) { return matrix(f.require_tensor(layer_tensor_key(l, t))); };

  if (with_embed || (with_head && c.tied_output)) w.tok_embd = matrix(f.require_tensor("token_embd.weight"));
  if (with_head) {
    w.output = c.tied_output ? w.tok_embd : matrix(f.require_tensor("output.weight"));
    w.output_norm = norm("output_norm.weight");
  }
  w.layers.resize(size_t(c.n_layer));
  for (int l = begin; l < end; ++l) {
    LayerWeights& L = w.layers[size_t(l)];
    if (c.fused_qkv) {
      const cpu::QMatrix qkv = mat(l, LayerTensor::Wqkv);
      L.wq = rows_of(qkv, 0, c.n_embd_q());
      L.wk = rows_of(qkv, c.n_embd_q(), c.n_embd_k());
      L.wv = rows_of(qkv, c.n_embd_q() + c.n_embd_k(), c.n_embd_v());
    } else {
      L.wq = mat(l, LayerTensor::Wq);
      L.wk = mat(l, LayerTensor::Wk);
      L.wv = mat(l, LayerTensor::Wv);
    }
    L.wo = mat(l, LayerTensor::Wo);
    if (c.is_moe()) {
      // below
    } else if (c.fused_gate_up) {
      const cpu::QMatrix gu = mat(l, LayerTensor::Up);
      L.gate = rows_of(gu, 0, c.n_ff);
      L.up = rows_of(gu, c.n_ff, c.n_ff);
    } else {
      L.gate = mat(l, LayerTensor::Gate);
      L.up = mat(l, LayerTensor::Up);
    }
    if (c.is_moe()) {
      L.router = mat(l, LayerTensor::GateInp);
      // Expert e of a stacked [cols, rows, n_expert] tensor: rows [e·rows, (e+1)·rows) of its 2-D view.
      auto experts = [&](LayerTensor t, int rows, std::vector<cpu::QMatrix>& out) {
        cpu::QMatrix all = mat(l, t);
        all.rows = int64_t(rows) * c.n_expert;
        for (int e = 0; e < c.n_expert; ++e) out.push_back(rows_of(all, int64_t(e) * rows, rows));
      };
      if (c.fused_gate_up_exps) {  // expert e: gate rows [2e·F, 2e·F + F), up rows after them
        cpu::QMatrix all = mat(l, LayerTensor::GateUpExps);
        const int64_t F = c.n_ff_exp;
        all.rows = 2 * F * c.n_expert;
        for (int e = 0; e < c.n_expert; ++e) {
          L.gate_exp.push_back(rows_of(all, 2 * F * e, F));
          L.up_exp.push_back(rows_of(all, 2 * F * e + F, F));
        }
      } else {
        experts(LayerTensor::GateExps, c.n_ff_exp, L.gate_exp);
        experts(LayerTensor::UpExps, c.n_ff_exp, L.up_exp);
      }
      experts(LayerTensor::DownExps, c.n_embd, L.down_exp);
      if (c.moe_bias) {  // expert e's bias: row e of the stacked [width, n_expert] F32 tensor
        L.router_b = opt(l, LayerTensor::BGateInp);
        auto biases = [&](LayerTensor t, int width, std::vector<const float*>& out) {
          for (int e = 0; e < c.n_expert; ++e) out.push_back(opt(l, t) + size_t(e) * size_t(width));
        };
        biases(LayerTensor::BGateExps, c.n_ff_exp, L.gate_exp_b);
        biases(LayerTensor::BUpExps, c.n_ff_exp, L.up_exp_b);
        biases(LayerTensor::BDownExps, c.n_embd, L.down_exp_b);
      }
      if (c.n_ff_shexp > 0) {
        L.gate_sh = mat(l, LayerTensor::GateShexp);
        L.up_sh = mat(l, LayerTensor::UpShexp);
        L.down_sh = mat(l, LayerTensor::DownShexp);
        L.gate_inp_sh = mat(l, LayerTensor::GateInpShexp);  // [n_embd]: one row
      }
    } else {
      L.down = mat(l, LayerTensor::Down);
    }
    if (c.pre_norms) {  // (olmo2 has none)
      L.attn_norm = norm(layer_tensor_key(l, LayerTensor::AttnNorm));
      L.ffn_norm = norm(layer_tensor_key(l, c.ffn_norm_tensor()));
    }
    if (c.qk_norm) {
      L.q_norm = norm(layer_tensor_key(l, LayerTensor::QNorm));
      L.k_norm = norm(layer_tensor_key(l, LayerTensor::KNorm));
    }
    if (c.post_norms) {
      L.post_attn_norm = norm(layer_tensor_key(l, LayerTensor::PostAttnNorm));
      L.post_ffn_norm = norm(layer_tensor_key(l, LayerTensor::PostFfnNorm));
    }
    L.bq = opt(l, LayerTensor::Bq);
    L.bk = opt(l, LayerTensor::Bk);
    L.bv = opt(l, LayerTensor::Bv);
    L.bo = opt(l, LayerTensor::Bo);
    L.sinks = opt(l, LayerTensor::Sinks);
  }
  if (adapters) attach_lora(w, *adapters, c, begin, end, with_embed, with_head, pack_pool != nullptr);
  for (int l = begin; control && l < end; ++l)
    if (const float* v = control->layer(l)) {
      std::vector<float> s(v, v + c.n_embd);
      for (float& x : s) x /= c.residual_scale;  // (the forward adds it to the branch the residual add scales)
      w.owned.push_back(std::move(s));
      w.layers[size_t(l)].control = w.owned.back().data();
    }
  if (pack_pool) {
    // In the order the forward reads them.
    std::vector<cpu::QMatrix*> to_pack;
    for (int l = begin; l < end; ++l) {
      LayerWeights& L = w.layers[size_t(l)];
      for (cpu::QMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down, &L.router, &L.gate_sh,
                              &L.up_sh, &L.down_sh, &L.gate_inp_sh})
        to_pack.push_back(m);
      for (size_t e = 0; e < L.gate_exp.size(); ++e)
        for (cpu::QMatrix* m : {&L.gate_exp[e], &L.up_exp[e], &L.down_exp[e]}) to_pack.push_back(m);
    }
    if (with_head) to_pack.push_back(&w.output);
    pack_matrices(w, to_pack, *pack_pool, &f);
    if (with_head && c.tied_output) w.tok_embd.packed = w.output.packed;
  }
  return w;
}

void pack_matrices(ModelWeights& w, std::vector<cpu::QMatrix*> mats, cpu::ThreadPool& pool, const gguf::File* file) {
  // Every packed copy in one buffer (alloc_packed gives a large one huge pages), each matrix at a
  // 64-byte boundary.
  std::erase_if(mats, [](const cpu::QMatrix* m) { return !m->data || !cpu::packing_enabled(m->type, m->cols); });
  auto rounded = [](size_t b) { return (b + 63) / 64 * 64; };
  size_t total = 0;
  for (const cpu::QMatrix* m : mats) total += rounded(cpu::packed_bytes(m->type, m->rows, m->cols));
  if (total == 0) return;
  cpu::PackedBuffer buf = cpu::alloc_packed(total);
  size_t at = 0;
  for (cpu::QMatrix* m : mats) {
    const size_t bytes = cpu::packed_bytes(m->type, m->rows, m->cols);
    // In slabs of whole 16-row groups (the packed layout is group after group) of about 32 MiB,
    // each slab's mapped pages given back once packed: a large head is never resident twice.
    const int64_t slab = std::max<int64_t>(1, int64_t((size_t(32) << 20) / m->row_bytes / cpu::kPackRows)) * cpu::kPackRows;
    for (int64_t r0 = 0; r0 < m->rows; r0 += slab) {
      cpu::QMatrix part = *m;
      part.data = m->row(r0);
      part.rows = std::min(slab, m->rows - r0);
      cpu::pack_matrix(part, buf.get() + at + cpu::packed_bytes(m->type, r0, m->cols), &pool);
      if (file) file->release(part.data, m->row_bytes * uint64_t(part.rows));
    }
    m->packed = buf.get() + at;
    w.packed_bytes += bytes;
    at += rounded(bytes);
  }
  w.packed.push_back(std::move(buf));
}

// ---- scratch ----

struct Scratch::Layout {
  size_t xb, xb2, q, k, v, hb, hb2, k_new, v_new, router, xe, ye, acc, total;
};

size_t Scratch::ffn_rows(const ModelConfig& c, int n_batch) {
  if (!c.is_moe()) return size_t(n_batch) * size_t(c.n_ff);
  return std::max(size_t(moe_expert_rows(uint64_t(n_batch), uint64_t(c.n_expert_used))) * size_t(c.n_ff_exp),
                  size_t(n_batch) * size_t(c.n_ff_shexp));
}

Scratch::Layout Scratch::layout(const ModelConfig& c, int n_batch, GgmlType kv_type) {
  const size_t B = size_t(n_batch), f = sizeof(float);
  auto align = [](size_t n) { return (n + 63) / 64 * 64; };
  Layout L{};
  size_t at = 0;
  auto take = [&](size_t bytes) { const size_t off = at; at += align(bytes); return off; };
  L.xb = take(B * c.n_embd * f);
  L.xb2 = take(B * c.n_embd_attn() * f);
  L.q = take(B * c.n_embd_q() * f);
  L.k = take(B * c.n_embd_k() * f);
  L.v = take(B * c.n_embd_v() * f);
  L.hb = take(ffn_rows(c, n_batch) * f);
  L.hb2 = take(ffn_rows(c, n_batch) * f);
  L.k_new = take(B * row_bytes(kv_type, c.n_embd_k()));
  L.v_new = take(B * row_bytes(kv_type, c.n_embd_v()));
  if (c.is_moe()) {
    L.router = take(B * c.n_expert * f);
    L.xe = take(B * c.n_embd * f);
    L.ye = take(size_t(moe_expert_rows(B, uint64_t(c.n_expert_used))) * c.n_embd * f);
    L.acc = take(B * c.n_embd * f);
  }
  L.total = at;
  return L;
}

size_t Scratch::bytes(const ModelConfig& c, int n_batch, GgmlType kv_type) {
  return layout(c, n_batch, kv_type).total;
}

Scratch::Scratch(const ModelConfig& c, int n_batch, GgmlType kv_type) : n_batch_(n_batch) {
  const Layout L = layout(c, n_batch, kv_type);
  mem_.resize(L.total + 64);
  uint8_t* base = mem_.data() + (64 - reinterpret_cast<uintptr_t>(mem_.data()) % 64) % 64;
  auto fp = [&](size_t off) { return reinterpret_cast<float*>(base + off); };
  xb = fp(L.xb); xb2 = fp(L.xb2); q = fp(L.q); k = fp(L.k); v = fp(L.v); hb = fp(L.hb); hb2 = fp(L.hb2);
  k_new = base + L.k_new;
  v_new = base + L.v_new;
  if (c.is_moe()) {
    router = fp(L.router); xe = fp(L.xe); ye = fp(L.ye); acc = fp(L.acc);
    route_ids.resize(size_t(n_batch) * size_t(c.n_expert_used));
    route_w.resize(route_ids.size());
    expert_first.resize(size_t(c.n_expert) + 1);
    expert_rows.resize(route_ids.size());
    expert_w.resize(route_ids.size());
  }
  first.resize(size_t(n_batch));
  row0.resize(size_t(n_batch));
  row.resize(size_t(n_batch));
}

// ---- forward ----

void embed(const ModelConfig& c, const ModelWeights& w, const Batch& batch, float* x, cpu::ThreadPool& pool) {
  cpu::embed_rows(w.tok_embd, batch.token.data(), batch.size(), x, c.embd_scale);
  for (const ModelWeights::LoraMul& t : w.lora_embd) {  // each token's row of A through B, scaled as the embedding
    thread_local std::vector<float> h;  // (only grows)
    const size_t rp = size_t(t.b.cols);
    h.assign(size_t(batch.size()) * rp, 0.f);
    for (int j = 0; j < batch.size(); ++j) cpu::embed_rows(t.a, &batch.token[size_t(j)], 1, h.data() + size_t(j) * rp, 1.f);
    lora_add(t.b, h.data(), batch.size(), x, t.scale * c.embd_scale, pool);
  }
}

void stage_rows(const Batch& batch, int n_seq, int32_t* first, int32_t* row0, int32_t* row) {
  const int n = batch.size();
  std::vector<int32_t> seq_first(size_t(n_seq), -1), seq_row0(size_t(n_seq), 0);
  int next = 0;
  for (int t = 0; t < n; ++t) {
    const int sq = batch.seq[size_t(t)];
    if (seq_first[size_t(sq)] < 0) {
      seq_first[size_t(sq)] = batch.pos[size_t(t)];
      seq_row0[size_t(sq)] = next;
      for (int u = t; u < n; ++u) next += batch.seq[size_t(u)] == sq;
    }
    first[t] = seq_first[size_t(sq)];
    row0[t] = seq_row0[size_t(sq)];
    row[t] = row0[t] + batch.pos[size_t(t)] - first[t];
    BATON_CHECK(row[t] < next);  // positions of a sequence are consecutive in the batch
  }
}

void last_positions(const Batch& batch, int n_seq, std::vector<int32_t>& last) {
  last.assign(size_t(n_seq), -1);
  for (int t = 0; t < batch.size(); ++t)
    last[size_t(batch.seq[size_t(t)])] = std::max(last[size_t(batch.seq[size_t(t)])], batch.pos[size_t(t)]);
}

namespace {

// g = act(g) * u over count values.
void gate_rows(const ModelConfig& c, float* g, const float* u, int count) {
  if (c.act == Activation::SiLU) cpu::silu_gate(g, u, g, count);
  else if (c.act == Activation::SwiGluOai) cpu::swiglu_oai_gate(g, u, g, count);
  else cpu::gelu_tanh_gate(g, u, g, count);
}

// rows × width values y += bias per row (no bias: nothing).
void add_bias(float* y, const float* bias, int rows, int width) {
  if (!bias) return;
  for (int r = 0; r < rows; ++r) cpu::add(y + size_t(r) * size_t(width), bias, width);
}

}  // namespace

void moe_experts(const ModelConfig& c, const LayerWeights& L, const float* x, int n, Scratch& s, cpu::ThreadPool& pool) {
  const int E = c.n_embd, K = c.n_expert_used, F = c.n_ff_exp, X = c.n_expert;
  float *hb = s.hb, *hb2 = s.hb2;
  float* acc = s.acc;
  std::fill(acc, acc + size_t(n) * E, 0.f);
  // Expert e's gate, up and down biases (gpt-oss), or null.
  auto bias = [&](const std::vector<const float*>& b, int e) { return b.empty() ? nullptr : b[size_t(e)]; };
  if (n == 1) {
    constexpr int kGroup = cpu::kMaxTargets / 2;  // experts per pair of jobs
    cpu::MatmulTarget gu[2 * kGroup], dn[kGroup];
    float wt[kGroup];
    int ids[kGroup];
    int m = 0;
    auto run = [&] {
      if (m == 0) return;
      cpu::matmul_multi(gu, 2 * m, x, 1, pool);
      for (int j = 0; j < m; ++j) {
        add_bias(hb + size_t(j) * F, bias(L.gate_exp_b, ids[j]), 1, F);
        add_bias(hb2 + size_t(j) * F, bias(L.up_exp_b, ids[j]), 1, F);
      }
      gate_rows(c, hb, hb2, m * F);
      cpu::matmul_multi(dn, m, nullptr, 1, pool);
      for (int j = 0; j < m; ++j) add_bias(s.ye + size_t(j) * E, bias(L.down_exp_b, ids[j]), 1, E);
      const int32_t token0[kGroup] = {};  // every expert's row goes to the one token
      cpu::scatter_add_rows(acc, s.ye, token0, wt, false, m, E);
      m = 0;
    };
    // The token's experts in ascending id, the order the many-token path below adds them in (one
    // expert at a time): a token's sum then has the same bits whatever the batch around it.
    // (An insertion sort of the k ranks: stable, and no allocation per token as stable_sort's buffer.)
    thread_local std::vector<int> order;  // (only grows)
    order.resize(size_t(K));
    for (int i = 0; i < K; ++i) {
      int j = i;
      for (; j > 0 && s.route_ids[size_t(order[size_t(j - 1)])] > s.route_ids[size_t(i)]; --j) order[size_t(j)] = order[size_t(j - 1)];
      order[size_t(j)] = i;
    }
    for (int r = 0; r < K; ++r) {
      const int i = order[size_t(r)], e = s.route_ids[size_t(i)];
      if (e < 0) continue;
      gu[2 * m] = {&L.gate_exp[size_t(e)], hb + size_t(m) * F};
      gu[2 * m + 1] = {&L.up_exp[size_t(e)], hb2 + size_t(m) * F};
      dn[m] = {&L.down_exp[size_t(e)], s.ye + size_t(m) * E, hb + size_t(m) * F};
      wt[m] = s.route_w[size_t(i)];
      ids[m] = e;
      if (++m == kGroup) run();
    }
    run();
  } else {
    // Per expert, the tokens routed to it and their weights.
    cpu::moe_group(s.route_ids.data(), s.route_w.data(), n, K, X, s.expert_first.data(), s.expert_rows.data(),
                   s.expert_w.data());
    for (int e = 0; e < X; ++e) {
      const int off = s.expert_first[size_t(e)], m = s.expert_first[size_t(e) + 1] - off;
      if (m == 0) continue;
      const int32_t* rows = s.expert_rows.data() + off;
      cpu::gather_rows(x, rows, m, E, s.xe);
      const cpu::MatmulTarget gu[] = {{&L.gate_exp[size_t(e)], hb}, {&L.up_exp[size_t(e)], hb2}};
      cpu::matmul_multi(gu, 2, s.xe, m, pool);
      add_bias(hb, bias(L.gate_exp_b, e), m, F);
      add_bias(hb2, bias(L.up_exp_b, e), m, F);
      gate_rows(c, hb, hb2, m * F);
      cpu::matmul(L.down_exp[size_t(e)], hb, m, s.ye, pool);
      add_bias(s.ye, bias(L.down_exp_b, e), m, E);
      cpu::scatter_add_rows(acc, s.ye, rows, s.expert_w.data() + off, false, m, E);
    }
  }
}

namespace {

// The CPU backend of llama_layers / llama_head (models/llama_forward.h): host buffers of the
// stage's Scratch, the bound (and packed) weights, the stage's KV cache and thread pool.
struct CpuLayers {
  const ModelConfig& c;
  const ModelWeights& w;
  KvCache* kv;  // null for the head
  const Batch& batch;
  Scratch& s;
  cpu::ThreadPool& pool;
  float* x;
  float *xb = s.xb, *xb2 = s.xb2, *q = s.q, *k = s.k, *v = s.v, *hb = s.hb, *hb2 = s.hb2;
  std::vector<float> angles;  // RoPE cos | sin per token, for the frequency table `angles_of`
  const float* angles_of = nullptr;

  const LayerWeights& layer(int l) const { return w.layers[size_t(l)]; }
  const float* output_norm() const { return w.output_norm; }
  const cpu::QMatrix& output() const { return w.output; }

  // Row-local ops (norm, residual add, gate) are not run when called but queued, and run by the
  // next matmul for each of its input rows inside the job that quantizes them (cpu::RowFn): on
  // several threads and with no barrier of their own, where run one after another on the calling
  // thread they left the other threads waiting. Any other op runs the queue first (flush), in
  // call order. A row's arithmetic is the same either way, so the bits never depend on which.
  struct RowOp {
    enum Kind { Norm, Add, Silu, Gelu, SwigluOai, Commit } kind;
    const float* a;  // Norm: input; Add: addend; gate: g
    const float* b;  // Norm: weight (or null); gate: u
    float* y;
    int rows, len;  // rows × len elements; Add and the gates are one flat row (rows 1); Commit: rows
                    // = tokens, len 1
    int layer = 0;  // Commit: the layer whose staged K/V rows go into the cache
    float s = 1.f;  // Add: y += s·a (the residual scale)
  };
  // The length of row j of o when a matmul over n rows runs it as its prologue, or 0 when o does
  // not split into n rows: per-token ops (norm, commit) need exactly n rows, flat ones n parts.
  static int fused_len(const RowOp& o, int n) {
    if (o.kind == RowOp::Norm || o.kind == RowOp::Commit) return o.rows == n ? o.len : 0;
    const size_t total = size_t(o.rows) * size_t(o.len);
    return total % size_t(n) == 0 ? int(total / size_t(n)) : 0;
  }
  static constexpr int kMaxRowOps = 4;
  RowOp ops[kMaxRowOps];
  int n_ops = 0;

  void apply(const RowOp& o, size_t off, int len) const {
    switch (o.kind) {
      case RowOp::Norm: cpu::rms_norm(o.a + off, o.b, o.y + off, 1, len, c.rms_eps); break;
      case RowOp::Add: cpu::add(o.y + off, o.a + off, len, o.s); break;
      case RowOp::Silu: cpu::silu_gate(o.a + off, o.b + off, o.y + off, len); break;
      case RowOp::Gelu: cpu::gelu_tanh_gate(o.a + off, o.b + off, o.y + off, len); break;
      case RowOp::SwigluOai: cpu::swiglu_oai_gate(o.a + off, o.b + off, o.y + off, len); break;
      case RowOp::Commit: commit(o.layer, int(off)); break;
    }
  }
  void queue(const RowOp& o) {
    if (n_ops == kMaxRowOps) flush();
    ops[n_ops++] = o;
  }
  void flush() {
    for (int i = 0; i < n_ops; ++i)
      for (int r = 0; r < ops[i].rows; ++r) apply(ops[i], size_t(r) * size_t(ops[i].len), ops[i].len);
    n_ops = 0;
  }
  // The queue as the prologue of a matmul over n input rows, or null after running it here when
  // an op does not split into those n rows.
  const cpu::RowFn* prologue(int n) {
    if (n_ops == 0) return nullptr;
    for (int i = 0; i < n_ops; ++i) {
      fused[i] = fused_len(ops[i], n);
      if (fused[i] == 0) {
        flush();
        return nullptr;
      }
    }
    pre = [this](int j) {
      for (int i = 0; i < n_ops; ++i) apply(ops[i], size_t(j) * size_t(fused[i]), fused[i]);
    };
    return &pre;
  }
  int fused[kMaxRowOps] = {};  // prologue(): each op's row length
  cpu::RowFn pre;
  // Runs the queue as the prologue of a matmul over n rows (then empties it).
  template <class F>
  void with_prologue(int n, F&& mm) {
    mm(prologue(n));
    n_ops = 0;
  }

  void rms_norm(const float* in, const float* wt, float* out, int rows, int n) {
    queue({RowOp::Norm, in, wt, out, rows, n});
  }
  void add_rms_norm(float* x, const float* d, const float* wt, float* out, int rows, int n, float s = 1.f) {
    add(x, d, rows * n, s);
    rms_norm(x, wt, out, rows, n);
  }
  void matmul(const cpu::QMatrix& W, const float* X, int n, float* Y) { run_targets({{&W, Y}}, X, n); }
  void matmul_qkv(const LayerWeights& L, const float* X, int n) {
    run_targets({{&L.wq, q}, {&L.wk, k}, {&L.wv, v}}, X, n);  // one job in decode
  }
  void matmul_gate_up(const LayerWeights& L, const float* X, int n) { run_targets({{&L.gate, hb}, {&L.up, hb2}}, X, n); }

  // The targets' products of X (one matmul() when alone) with their LoRA pairs' A·X beside them in
  // the same job; then the pairs' B·(A·X), a job for each run of pairs of one rank, added into
  // their targets' Y (s·B·(A·X)).
  void run_targets(std::initializer_list<cpu::MatmulTarget> base, const float* X, int n) {
    cpu::MatmulTarget t[cpu::kMaxTargets];
    const ModelWeights::LoraMul* pair[cpu::kMaxTargets];
    float* pair_y[cpu::kMaxTargets];
    int nt = 0, np = 0;
    for (const cpu::MatmulTarget& b : base) t[nt++] = b;
    thread_local std::vector<float> h, bh;  // A·X of every pair, B·(A·X) of a slice (only grow)
    size_t h_floats = 0;
    if (!w.lora.empty())
      for (const cpu::MatmulTarget& b : base) {
        const auto [lo, hi] = w.lora.equal_range(b.W->data);
        for (auto it = lo; it != hi; ++it) {
          BATON_CHECK(nt < cpu::kMaxTargets);  // (3 targets and kMaxLoraFiles pairs of each at most)
          pair[np] = &it->second;
          pair_y[np++] = b.Y;
          h_floats += size_t(n) * size_t(it->second.a.rows);
          ++nt;
        }
      }
    h.resize(h_floats);
    for (int i = 0, at = 0; i < np; at += n * int(pair[i]->a.rows), ++i) t[int(base.size()) + i] = {&pair[i]->a, h.data() + at};
    with_prologue(n, [&](const cpu::RowFn* p) {
      if (nt == 1) cpu::matmul(*t[0].W, X, n, t[0].Y, pool, p);
      else cpu::matmul_multi(t, nt, X, n, pool, p);
    });
    for (int i0 = 0, h0 = 0; i0 < np;) {
      int i1 = i0;
      int64_t rows = 0;  // of the run's B matrices together
      for (; i1 < np && pair[i1]->b.cols == pair[i0]->b.cols; ++i1) rows += pair[i1]->b.rows;
      const int rp = int(pair[i0]->b.cols);
      const int step = int(std::max<int64_t>(1, (int64_t(1) << 20) / rows));  // B·h of ~4 MiB a slice
      for (int j = 0; j < n; j += step) {
        const int m = std::min(step, n - j);
        bh.resize(size_t(m) * size_t(rows));
        cpu::MatmulTarget bt[cpu::kMaxTargets];
        for (int i = i0, at = 0; i < i1; at += m * int(pair[i]->b.rows), ++i)
          bt[i - i0] = {&pair[i]->b, bh.data() + at, h.data() + h0 + size_t(i - i0) * size_t(n) * rp + size_t(j) * rp};
        cpu::matmul_multi(bt, i1 - i0, nullptr, m, pool);
        for (int i = i0, at = 0; i < i1; at += m * int(pair[i]->b.rows), ++i)
          cpu::add(pair_y[i] + size_t(j) * size_t(pair[i]->b.rows), bh.data() + at, m * int(pair[i]->b.rows), pair[i]->scale);
      }
      h0 += (i1 - i0) * n * rp;
      i0 = i1;
    }
  }
  void add(float* y, const float* in, int n, float s = 1.f) {
    RowOp o{RowOp::Add, in, nullptr, y, 1, n};
    o.s = s;
    queue(o);
  }
  void scale(float* y, float s, int n) {
    flush();
    cpu::scale(y, s, n);
  }
  void add_rows(float* y, const float* bias, int rows, int n) {
    flush();
    add_bias(y, bias, rows, n);
  }
  void gate(Activation act, const float* g, const float* u, float* y, int n) {
    const RowOp::Kind k = act == Activation::SiLU       ? RowOp::Silu
                          : act == Activation::GeluTanh ? RowOp::Gelu
                                                        : RowOp::SwigluOai;
    queue({k, g, u, y, 1, n});
  }
  void softcap(float* y, float cap, int n) {
    flush();
    cpu::softcap(y, cap, n);
  }

  std::vector<int32_t> seq_last;  // per sequence slot: its last position in the batch
  void stage_rows() {
    baton::stage_rows(batch, kv->shape().n_seq, s.first.data(), s.row0.data(), s.row.data());
    last_positions(batch, kv->shape().n_seq, seq_last);
  }

  void rope_and_stage(int l, int n) {
    flush();
    const int nq = c.n_embd_q(), nk = c.n_embd_k(), nv = c.n_embd_v();
    const GgmlType kvt = kv->shape().type;
    const size_t k_row = row_bytes(kvt, nk), v_row = row_bytes(kvt, nv);
    const float* freqs = c.freqs(l).data();
    const bool neox = c.rope_style == RopeStyle::NeoX;
    const int half = c.rope_dim / 2;
    const bool rotate = !c.is_nope(l);  // (a NoPE layer stages q and k as projected)
    if (rotate && freqs != angles_of) {  // the angles of every token, once per distinct frequency table
                                         // (a table is global or local: so is attn_factor)
      angles.resize(size_t(n) * size_t(2 * half));
      for (int t = 0; t < n; ++t)
        cpu::rope_angles(batch.pos[size_t(t)], freqs, half, angles.data() + size_t(t) * 2 * half,
                         angles.data() + size_t(t) * 2 * half + half, c.attn_factor(l));
      angles_of = freqs;
    }
    const cpu::RowFn token = [&](int t) {
      if (rotate) {
        const float* cs = angles.data() + size_t(t) * 2 * half;
        const float* sn = cs + half;
        cpu::rope_rotate(q + size_t(t) * nq, c.n_head, c.head_dim_k, c.rope_dim, cs, sn, neox);
        cpu::rope_rotate(k + size_t(t) * nk, c.n_head_kv, c.head_dim_k, c.rope_dim, cs, sn, neox);
      }
      cpu::kv_convert(kvt, k + size_t(t) * nk, s.k_new + size_t(s.row[size_t(t)]) * k_row, nk);
      cpu::kv_convert(kvt, v + size_t(t) * nv, s.v_new + size_t(s.row[size_t(t)]) * v_row, nv);
    };
    cpu::run_rows(token, n, pool);
  }

  // Attention over cache + staged batch rows; the commit of the batch's rows to the cache is
  // queued for the output projection's prologue.
  void attention(int l, int n) {
    flush();
    const cpu::KvLayerView cache = kv->layer(l);
    cpu::AttentionArgs a = attention_args<cpu::AttentionArgs>(c, l, n, q, xb2, batch.pos.data(), batch.seq.data(),
                                                              s.first.data(), s.row0.data(), s.k_new, s.v_new);
    a.kv = cache;
    a.sinks = layer(l).sinks;
    cpu::attention(a, pool);
    RowOp commit_rows{RowOp::Commit, nullptr, nullptr, nullptr, n, 1};
    commit_rows.layer = l;
    queue(commit_rows);
  }
  // Token t's staged K/V rows of layer l into its cache cells.
  void commit(int l, int t) const {
    const cpu::KvLayerView cache = kv->layer(l);
    const size_t kh = cache.k_head_bytes(), vh = cache.v_head_bytes();
    const int sq = batch.seq[size_t(t)], p = batch.pos[size_t(t)];
    // A ring shorter than the batch's run of this sequence: a later token takes the same cell. It
    // alone writes it, so the tokens' commits never race and the last one wins, as in order.
    if (p + cache.n_cells <= seq_last[size_t(sq)]) return;
    const uint8_t* kr = s.k_new + size_t(s.row[size_t(t)]) * cache.k_row;
    const uint8_t* vr = s.v_new + size_t(s.row[size_t(t)]) * cache.v_row;
    for (int g = 0; g < cache.n_head_kv; ++g) {
      std::memcpy(cache.k_at(sq, g, p), kr + size_t(g) * kh, kh);
      std::memcpy(cache.v_at(sq, g, p), vr + size_t(g) * vh, vh);
    }
  }

  // Mixture of experts over the normed rows in xb, the result into xb: every token's k experts
  // and weights from the router, the routed experts (moe_experts), the shared expert.
  void moe(const LayerWeights& L, int n) {
    const int E = c.n_embd, K = c.n_expert_used, X = c.n_expert;
    matmul(L.router, xb, n, s.router);  // (the queued residual add and norm run as its prologue)
    add_bias(s.router, L.router_b, n, X);    for (int t = 0; t < n; ++t)
      cpu::moe_route(s.router + size_t(t) * X, X, K, c.expert_weights_norm, s.route_ids.data() + size_t(t) * K,
                     s.route_w.data() + size_t(t) * K);
    float* acc = s.acc;
    moe_experts(c, L, xb, n, s, pool);
    if (c.n_ff_shexp > 0) {  // the shared expert, scaled per token by sigmoid(gate_inp_sh · x)
      const int S = c.n_ff_shexp;
      const cpu::MatmulTarget gu[] = {{&L.gate_sh, hb}, {&L.up_sh, hb2}};
      cpu::matmul_multi(gu, 2, xb, n, pool);
      gate_rows(c, hb, hb2, n * S);
      cpu::matmul(L.down_sh, hb, n, s.ye, pool);
      cpu::matmul(L.gate_inp_sh, xb, n, s.router, pool);  // (the router's logits are spent)
      cpu::scatter_add_rows(acc, s.ye, nullptr, s.router, true, n, E);
    }
    std::memcpy(xb, acc, size_t(n) * E * sizeof(float));
  }

  int gather_logit_rows() {
    flush();
    int m = 0;  // rows that want logits, gathered so the output matmul sees only them
    for (int t = 0; t < batch.size(); ++t)
      if (batch.logits[size_t(t)])
        std::memcpy(xb + size_t(m++) * c.n_embd, x + size_t(t) * c.n_embd, size_t(c.n_embd) * sizeof(float));
    return m;
  }
  // Embeddings (kHidden rows): the normed hidden states are the output, each at the start of its row.
  bool hidden_rows() const { return std::find(batch.logits.begin(), batch.logits.end(), kHidden) != batch.logits.end(); }
  void copy_hidden_rows(float* out, int m) {
    flush();
    const size_t E = size_t(c.n_embd);
    for (int r = 0; r < m; ++r) std::memcpy(out + size_t(r) * size_t(c.n_vocab), xb + size_t(r) * E, E * sizeof(float));
  }
};

}  // namespace

void forward_layers(const ModelConfig& c, const ModelWeights& w, KvCache& kv, const Batch& batch,
                    int begin, int end, float* x, Scratch& s, cpu::ThreadPool& pool) {
  const int n = batch.size();
  BATON_CHECK(n >= 1 && n <= s.n_batch());
  CpuLayers b{c, w, &kv, batch, s, pool, x};
  b.stage_rows();
  llama_layers(c, b, n, begin, end);
  b.flush();
}

void head(const ModelConfig& c, const ModelWeights& w, const Batch& batch, const float* x,
          float* logits, Scratch& s, cpu::ThreadPool& pool) {
  CpuLayers b{c, w, nullptr, batch, s, pool, const_cast<float*>(x)};  // the head only reads x
  llama_head(c, b, logits);
  b.flush();
}

}  // namespace baton
