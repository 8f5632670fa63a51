// The constants of gpt-oss's clamped SwiGLU gate ("SwiGLU-OAI"), shared by the CPU kernel
// (cpu::swiglu_oai_gate), the CUDA kernel (cuda::swiglu_oai_gate) and their tests:
//   y = x·σ(α·x)·(u' + 1),  x = min(g, limit),  u' = clamp(u, −limit, limit).
// Plain constants: the header compiles under nvcc as under the host compiler.
#pragma once

namespace baton {

constexpr float kSwigluOaiAlpha = 1.702f;  // the sigmoid's slope: x·σ(1.702 x) approximates GELU
constexpr float kSwigluOaiLimit = 7.0f;    // the gate is clamped from above, the up value on both sides

}  // namespace baton
