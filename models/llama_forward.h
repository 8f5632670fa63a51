// The llama-family forward written once for every backend: the layer loop and the head as a
// sequence of ops, read top to bottom with the ModelConfig flags (q/k bias, q/k norm, post-norms,
// gate activation, final softcap). A backend B supplies the buffers and the ops:
//   members  x, xb, xb2, q, k, v, hb, hb2     activation buffers (host memory for the CPU,
//                                             device memory for CUDA), one token per row
//   layer(l)                                  the layer's weights: wq wk wv wo gate up down
//                                             (matrices) and attn_norm ffn_norm q_norm k_norm
//                                             post_attn_norm post_ffn_norm bq bk bv (vectors or null)
//   rms_norm(x, w, y, rows, n)                y = x / rms(x) * w per row
//   matmul(W, X, n, Y)  matmul_qkv(L, X, n)  matmul_gate_up(L, X, n)   (X: xb, or x without pre-norms)
//   moe(L, n)                                 a mixture-of-experts FFN, xb -> xb (see LayerT)
//   add(y, x, n, s)  add_rows(y, bias, rows, n)  gate(y = act(g) * u over n)  softcap(y, cap, n)
//   scale(y, s, n)                            y *= s
//   add_rms_norm(x, d, w, y, rows, n, s)      x += s·d, then y = rms_norm(x, w) (a backend may fuse them;
//                                             s: the residual scale, 1 but for granite)
//   rope_and_stage(l, n)   RoPE on q and k, and k/v converted into the KV type's staging rows
//   attention(l, n)        attention over cache + staged rows into xb2, then the commit
//   gather_logit_rows()    copies the rows of x that want logits to xb, returns their count
//   hidden_rows()          whether the batch's output rows are kHidden (then all of them are)
//   copy_hidden_rows(out, m)  the m normed rows of xb into out's rows (n_vocab floats apart)
//   output_norm(), output()
// The CPU backend is in models/llama.cpp, the CUDA one in runtime/gpu_stage.cpp. Each backend's
// ops are tested against the other's twins (tests/test_cuda_ops.cpp), so one loop serves both.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/config.h"

namespace baton {

// One layer's weights as a backend holds them: matrices of the backend's type M, vectors (in the
// backend's memory) or null when the family has none.
template <class M>
struct LayerT {
  M wq, wk, wv, wo, gate, up, down;
  // Mixture of experts (ModelConfig::is_moe; gate, up and down are then unset): the router
  // [n_expert rows], each expert's matrices (views into the stacked tensors), and the shared
  // expert with its gate (one row: sigmoid(gate_inp_sh · h) scales it) when the family has one.
  M router;
  std::vector<M> gate_exp, up_exp, down_exp;
  M gate_sh, up_sh, down_sh, gate_inp_sh;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_norm = nullptr;          // qk_norm
  const float* k_norm = nullptr;
  const float* post_attn_norm = nullptr;  // post_norms
  const float* post_ffn_norm = nullptr;
  const float* bq = nullptr;              // attn_bias
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* bo = nullptr;              // attn_out_bias
  const float* sinks = nullptr;           // attn_sinks: n_head logits
  // A control vector's share of this layer's output (runtime/control_vector.h), divided by the
  // residual scale: added to the FFN branch before the residual add. Null: none.
  const float* control = nullptr;
  // moe_bias: the router's bias (n_expert) and each expert's gate, up and down biases (F32 vectors
  // of n_ff_exp, n_ff_exp and n_embd in the backend's memory).
  const float* router_b = nullptr;
  std::vector<const float*> gate_exp_b, up_exp_b, down_exp_b;
};

// The attention arguments of layer l for n tokens, filled the same way by every backend
// (cpu::AttentionArgs, cuda::AttentionArgs: same fields, host or device pointers). The caller
// sets the cache view `kv`.
template <class Args>
Args attention_args(const ModelConfig& c, int l, int n, const float* q, float* out, const int32_t* pos,
                    const int32_t* seq, const int32_t* first, const int32_t* row0, const uint8_t* k_new,
                    const uint8_t* v_new) {
  Args a;
  a.n_tokens = n;
  a.q = q;
  a.q_stride = size_t(c.n_embd_q());
  a.out = out;
  a.out_stride = size_t(c.n_embd_attn());
  a.pos = pos;
  a.seq = seq;
  a.first = first;
  a.row0 = row0;
  a.k_new = k_new;
  a.v_new = v_new;
  a.n_head = c.n_head;
  a.scale = c.attn_scale;
  a.softcap = c.attn_softcap;
  a.window = c.layer_window[size_t(l)];
  return a;  // (the backend sets a.sinks, from its layer's weights)
}

template <class B>
void llama_layers(const ModelConfig& c, B& b, int n, int begin, int end) {
  const int E = c.n_embd, F = c.n_ff;
  for (int l = begin; l < end; ++l) {
    const auto& L = b.layer(l);

    // Attention block: norm, projections, q/k bias, q/k norm, RoPE, attention, output projection.
    // (After the first layer the previous layer's residual add has done the norm. Without
    // pre-norms, olmo2, the projections read the residual stream itself.)
    if (l == begin && L.attn_norm) b.rms_norm(b.x, L.attn_norm, b.xb, n, E);
    b.matmul_qkv(L, L.attn_norm ? b.xb : b.x, n);  // -> q, k, v
    if (L.bq) {
      b.add_rows(b.q, L.bq, n, c.n_embd_q());
      b.add_rows(b.k, L.bk, n, c.n_embd_k());
      b.add_rows(b.v, L.bv, n, c.n_embd_v());
    }
    if (L.q_norm) {  // per head, or over each token's whole q and k rows (qk_norm_full: olmo2, olmoe)
      const int qw = c.q_norm_width(), kw = c.k_norm_width();
      b.rms_norm(b.q, L.q_norm, b.q, n * (c.n_embd_q() / qw), qw);
      b.rms_norm(b.k, L.k_norm, b.k, n * (c.n_embd_k() / kw), kw);
    }
    b.rope_and_stage(l, n);
    b.attention(l, n);  // q + cache + staged rows -> xb2
    b.matmul(L.wo, b.xb2, n, b.xb);
    if (L.bo) b.add_rows(b.xb, L.bo, n, E);
    if (L.post_attn_norm) b.rms_norm(b.xb, L.post_attn_norm, b.xb, n, E);

    // FFN block: residual add (the branch times residual_scale: granite) and norm (one op), gate
    // and up, activation, down. Without pre-norms (olmo2, never a mixture) gate and up read x.
    if (L.ffn_norm) b.add_rms_norm(b.x, b.xb, L.ffn_norm, b.xb, n, E, c.residual_scale);
    else b.add(b.x, b.xb, n * E, c.residual_scale);
    if (c.is_moe()) {
      b.moe(L, n);  // xb -> the experts' weighted sum in xb
    } else {
      b.matmul_gate_up(L, L.ffn_norm ? b.xb : b.x, n);  // -> hb, hb2
      b.gate(c.act, b.hb, b.hb2, b.hb, n * F);
      b.matmul(L.down, b.hb, n, b.xb);
    }
    if (L.post_ffn_norm) b.rms_norm(b.xb, L.post_ffn_norm, b.xb, n, E);
    if (L.control) b.add_rows(b.xb, L.control, n, E);
    if (l + 1 < end && b.layer(l + 1).attn_norm)  // and the next layer's norm
      b.add_rms_norm(b.x, b.xb, b.layer(l + 1).attn_norm, b.xb, n, E, c.residual_scale);
    else
      b.add(b.x, b.xb, n * E, c.residual_scale);
  }
}

// Final norm and output matmul for the rows that want logits, in batch order, into `logits`
// (n_logits rows of n_vocab floats). Overwrites xb. A batch whose output rows are kHidden (never
// mixed with other modes: check_batch) gets the normed hidden states instead, n_embd floats at
// the start of each row, and no output matmul.
template <class B>
void llama_head(const ModelConfig& c, B& b, float* logits) {
  const int m = b.gather_logit_rows();
  if (m == 0) return;
  b.rms_norm(b.xb, b.output_norm(), b.xb, m, c.n_embd);
  if (b.hidden_rows()) return b.copy_hidden_rows(logits, m);  // kHidden (embeddings): no output matmul
  b.matmul(b.output(), b.xb, m, logits);
  if (c.logit_scale != 1) b.scale(logits, 1.f / c.logit_scale, m * c.n_vocab);  // granite
  if (c.final_softcap > 0) b.softcap(logits, c.final_softcap, m * c.n_vocab);
}

}  // namespace baton
