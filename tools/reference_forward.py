#!/usr/bin/env python3
"""A float64 NumPy forward of a GGUF model, every position's logits: the independent check of
Baton's forward where two C++ runtimes disagree (llama.cpp's rounding flips a router's near-tie
that float64 does not). Written from the families' modeling code (Hugging Face transformers:
Llama/Mixtral, Qwen2/Qwen2-MoE, Qwen3/Qwen3-MoE, GptOss, Granite/GraniteMoe, Olmo2/Olmo3/Olmoe, SmolLM3, Ernie4_5,
Exaone4, Gemma, Glm4), not from Baton's.

    pip install numpy gguf
    python3 tools/reference_forward.py MODEL.gguf OUT.f32 ID ID ...    # OUT: [n_ids x n_vocab] float32
    baton logits -m MODEL.gguf --tokens "ID ID ..." --out baton.f32     # then compare the two files

Families: llama (with or without experts), qwen2, qwen3, qwen3moe, qwen2moe, gpt-oss (YaRN, sliding
windows on even layers, sinks, biases, the clamped SwiGLU), granite and granitemoe (embeddings times
embedding_multiplier, each block's output times residual_multiplier before its residual add, q.k
times attention_multiplier, logits divided by logits_scaling; the MoE's softmax over the top k router
logits), olmo2 (OLMo 2 and 3: no input norms, whole-row q/k norms, post-norms; OLMo 3's sliding
layers with plain RoPE, its full ones with YaRN), olmoe (whole-row q/k norms, top-k weights not
renormalized), smollm3 (llama's layer; the layers l with (l + 1) % 4 == 0, no_rope_layer_interval,
without RoPE), ernie4_5 (llama's layer, interleaved-pair RoPE, use_bias's optional q/k/v and output
biases), exaone4 (OLMo 2's norm placement with q/k norms per head; with a window, 3 of 4 layers
sliding and rotating, the global ones without RoPE) and gemma (Gemma 1: embeddings times
sqrt(n_embd), GeGLU with the tanh GELU, heads of attention.key_length, the stored norm weights used
as they are: the converter added Gemma's 1 to them) and glm4 (GLM-4-0414: input norms and
norms on the attention and MLP outputs before each residual add, q/k/v biases, gate_up_proj's
output chunked into gate then up, the first rope.dimension_count dims of each head rotated in
interleaved pairs); Llama 3 factors (rope_freqs.weight); no other
RoPE scaling or windows. Weights of any type gguf-py dequantizes. Prints the smallest router margin (the
logit gap between the last expert chosen and the first left out, over tokens and layers): where it
is below a runtime's rounding, that runtime may pick another expert.
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    path, out, ids = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
    r = GGUFReader(path)
    fields = {f.name: f for f in r.fields.values()}

    def meta(key, default=None):
        f = fields.get(key)
        if f is None:
            return default
        v = f.parts[f.data[0]]
        return v.tobytes().decode() if v.dtype == np.uint8 else v[0].item()

    arch = meta("general.architecture")
    g = lambda k, d=None: meta(f"{arch}.{k}", d)
    T = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        T[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
    E, L, H = g("embedding_length"), g("block_count"), g("attention.head_count")
    HKV = g("attention.head_count_kv", H)
    D = g("attention.key_length", E // H)
    R = g("rope.dimension_count", D)
    X, K = g("expert_count", 0), g("expert_used_count", 0)
    eps, base = g("attention.layer_norm_rms_epsilon"), g("rope.freq_base", 10000.0)
    renorm = arch not in ("qwen2moe", "olmoe")  # Mixtral and Qwen3-MoE renormalize the top-k probabilities
    granite = arch in ("granite", "granitemoe")
    # the llama, granite and smollm3 converters permute q/k for adjacent pairs; ERNIE 4.5 rotates
    # interleaved (adjacent) pairs itself, and so does GLM-4 (its rotate_half takes x[0::2], x[1::2])
    neox = arch not in ("llama", "smollm3", "ernie4_5", "glm4") and not granite
    # GLM-4 (Glm4ForCausalLM): Llama's pre-norm layer with norms on the attention and MLP outputs too
    # (post_self_attn_layernorm, post_mlp_layernorm: the files' post_attention_norm, post_ffw_norm).
    sandwich = arch == "glm4"
    # SmolLM3: every 4th layer uses no rotary embedding (its files carry no key for the interval)
    nope = [arch == "smollm3" and (l + 1) % 4 == 0 for l in range(L)]
    # Granite's multipliers (GGUF: embedding_scale, residual_scale, attention.scale, logit_scale;
    # 0 or absent: none).
    emb_mult = (g("embedding_scale", 0.0) or 1.0) if granite else 1.0
    res_mult = (g("residual_scale", 0.0) or 1.0) if granite else 1.0
    q_scale = (g("attention.scale", 0.0) or 1 / np.sqrt(D)) if granite else 1 / np.sqrt(D)
    logit_div = (g("logit_scale", 0.0) or 1.0) if granite else 1.0
    oai = arch == "gpt-oss"
    window = g("attention.sliding_window", 0) if oai else 0  # gpt-oss: layers 0, 2, 4, ... slide
    # OLMo 2 / OLMo 3 (Olmo2/Olmo3ForCausalLM) and OLMoE: q_norm and k_norm over the whole projected
    # rows; olmo2 has no input norms, its attention and MLP outputs normed before each residual add.
    # OLMo 3's files carry a window and a flag per layer (true: sliding); its sliding layers rotate
    # with the plain frequencies, its full ones with the YaRN ones.
    # EXAONE 4 (Exaone4ForCausalLM): OLMo 2's placement with per-head q/k norms; with a window (its
    # layer_types from the file's flags) only the sliding layers rotate ("global NoPE").
    olmo, post_only = arch in ("olmo2", "olmoe"), arch in ("olmo2", "exaone4")
    sliding = [False] * L
    if oai:
        sliding = [l % 2 == 0 for l in range(L)]
    elif arch in ("olmo2", "exaone4") and g("attention.sliding_window", 0) > 0:
        window = g("attention.sliding_window")
        f = fields.get(f"{arch}.attention.sliding_window_pattern")
        if f is not None and len(f.data) == L:
            sliding = [bool(f.parts[i][0]) for i in f.data]
        else:
            sliding = [(l + 1) % 4 != 0 for l in range(L)]
        if arch == "exaone4":
            nope = [not s for s in sliding]

    # RoPE frequencies; gpt-oss's YaRN as its config.json has it (beta_fast 32, beta_slow 1,
    # "truncate": false: the ramp's ends are not rounded to whole pairs).
    half = R // 2
    theta = base ** (-np.arange(half) * 2.0 / R)
    theta_plain, mscale = theta, 1.0
    if g("rope.scaling.type", "none") == "yarn":
        factor, ctx0 = g("rope.scaling.factor"), g("rope.scaling.original_context_length")
        turning = lambda r: R * np.log(ctx0 / (r * 2 * np.pi)) / (2 * np.log(base))
        lo, hi = max(turning(32.0), 0.0), min(turning(1.0), R - 1)
        if olmo:  # Olmo3's rope config leaves truncate at its default: the ramp's ends whole pairs
            lo, hi = max(np.floor(turning(32.0)), 0.0), min(np.ceil(turning(1.0)), R - 1)
        interp = np.clip((np.arange(half) - lo) / max(hi - lo, 0.001), 0, 1)
        theta = theta / factor * interp + theta * (1 - interp)
        mscale = 0.1 * np.log(factor) + 1
    if "rope_freqs.weight" in T:  # Llama 3's scaling as per-pair divisors of the frequencies
        theta, theta_plain = theta / T["rope_freqs.weight"], theta_plain / T["rope_freqs.weight"]

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(v, pos, plain=False):  # v [n, heads, D]; the first R dims of each head rotate
        a = pos[:, None] * (theta_plain if plain else theta)[None]
        m = 1.0 if plain else mscale
        c, s = np.cos(a)[:, None] * m, np.sin(a)[:, None] * m
        o = v.copy()
        if neox:
            x0, x1 = v[..., :half], v[..., half:R]
            o[..., :half], o[..., half:R] = x0 * c - x1 * s, x0 * s + x1 * c
        else:
            x0, x1 = v[..., 0:R:2], v[..., 1:R:2]
            o[..., 0:R:2], o[..., 1:R:2] = x0 * c - x1 * s, x0 * s + x1 * c
        return o

    silu = lambda z: z / (1 + np.exp(-z))
    # Gemma's gelu_pytorch_tanh: 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
    gelu_tanh = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    act = gelu_tanh if arch == "gemma" else silu

    def swiglu(h, gate, up, down):  # (GeGLU for gemma)
        return (act(h @ gate.T) * (h @ up.T)) @ down.T

    def oai_expert(h, b, e):  # gpt-oss: biases, the gate clamped above at 7, the up at ±7, and + 1
        gt = h @ T[b + "ffn_gate_exps.weight"][e].T + T[b + "ffn_gate_exps.bias"][e]
        u = h @ T[b + "ffn_up_exps.weight"][e].T + T[b + "ffn_up_exps.bias"][e]
        gt, u = np.minimum(gt, 7.0), np.clip(u, -7.0, 7.0)
        a = gt / (1 + np.exp(-1.702 * gt)) * (u + 1)
        return a @ T[b + "ffn_down_exps.weight"][e].T + T[b + "ffn_down_exps.bias"][e]

    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = T["token_embd.weight"][ids] * emb_mult
    if arch == "gemma":  # GemmaModel scales the embeddings by sqrt(hidden_size)
        x = x * np.sqrt(E)
    margin = np.inf
    for l in range(L):
        b = f"blk.{l}."
        h = x if post_only else rms(x, T[b + "attn_norm.weight"])
        q, k, v = (h @ T[b + f"attn_{m}.weight"].T for m in "qkv")
        if b + "attn_q.bias" in T:
            q, k, v = q + T[b + "attn_q.bias"], k + T[b + "attn_k.bias"], v + T[b + "attn_v.bias"]
        if olmo:  # over the whole rows
            q, k = rms(q, T[b + "attn_q_norm.weight"]), rms(k, T[b + "attn_k_norm.weight"])
        q, k, v = q.reshape(n, H, D), k.reshape(n, HKV, D), v.reshape(n, HKV, D)
        if b + "attn_q_norm.weight" in T and not olmo:
            q, k = rms(q, T[b + "attn_q_norm.weight"]), rms(k, T[b + "attn_k_norm.weight"])
        plain = olmo and sliding[l]  # (gpt-oss's sliding layers rotate as its full ones)
        if not nope[l]:
            q, k = rope(q, pos, plain), rope(k, pos, plain)
        o = np.zeros((n, H, D))
        for hh in range(H):
            kv = hh // (H // HKV)
            s = q[:, hh] @ k[:, kv].T * q_scale
            s[np.triu_indices(n, 1)] = -np.inf
            if window and sliding[l]:
                s[np.tril_indices(n, -window)] = -np.inf  # keys window or more tokens back
            sink = T[b + "attn_sinks.weight"][hh] if oai else -np.inf
            mx = np.maximum(s.max(1, keepdims=True), sink)
            p = np.exp(s - mx)
            o[:, hh] = (p / (p.sum(1, keepdims=True) + np.exp(sink - mx))) @ v[:, kv]
        a = o.reshape(n, H * D) @ T[b + "attn_output.weight"].T
        if b + "attn_output.bias" in T:  # (gpt-oss; ernie4_5's optional one)
            a = a + T[b + "attn_output.bias"]
        if post_only or sandwich:
            a = rms(a, T[b + "post_attention_norm.weight"])
        x = x + a * res_mult
        if post_only:
            y = swiglu(x, T[b + "ffn_gate.weight"], T[b + "ffn_up.weight"], T[b + "ffn_down.weight"])
            x = x + rms(y, T[b + "post_ffw_norm.weight"])
            continue
        h = rms(x, T[b + ("post_attention_norm.weight" if oai else "ffn_norm.weight")])
        if sandwich:  # gate_up_proj: the first n_ff rows the gate's, the rest the up projection's
            gate, up = np.split(T[b + "ffn_up.weight"], 2)
            x = x + rms(swiglu(h, gate, up, T[b + "ffn_down.weight"]), T[b + "post_ffw_norm.weight"])
            continue
        if X == 0:
            x = x + swiglu(h, T[b + "ffn_gate.weight"], T[b + "ffn_up.weight"], T[b + "ffn_down.weight"]) * res_mult
            continue
        logit = h @ T[b + "ffn_gate_inp.weight"].T
        if oai:
            logit = logit + T[b + "ffn_gate_inp.bias"]
        prob = np.exp(logit - logit.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        y = np.zeros_like(x)
        for t in range(n):
            chosen = np.argsort(-logit[t], kind="stable")[:K]
            if K < X:
                ranked = np.sort(logit[t])[::-1]
                margin = min(margin, ranked[K - 1] - ranked[K])
            w = prob[t, chosen]
            if renorm:
                w = w / w.sum()
            for e, we in zip(chosen, w):
                if oai:  # (its softmax over the k chosen logits is the renormalized top k)
                    y[t] += we * oai_expert(h[t], b, e)
                    continue
                y[t] += we * swiglu(h[t], T[b + "ffn_gate_exps.weight"][e], T[b + "ffn_up_exps.weight"][e],
                                    T[b + "ffn_down_exps.weight"][e])
        if b + "ffn_gate_inp_shexp.weight" in T:
            gate = 1 / (1 + np.exp(-(h @ T[b + "ffn_gate_inp_shexp.weight"].reshape(-1))))
            y += gate[:, None] * swiglu(h, T[b + "ffn_gate_shexp.weight"], T[b + "ffn_up_shexp.weight"],
                                        T[b + "ffn_down_shexp.weight"])
        x = x + y * res_mult
    head = T["output.weight"] if "output.weight" in T else T["token_embd.weight"]
    (rms(x, T["output_norm.weight"]) @ head.T / logit_div).astype(np.float32).tofile(out)
    if X:
        print(f"smallest router margin {margin:.5f}")


if __name__ == "__main__":
    main()
