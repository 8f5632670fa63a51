// Fixture generator (not part of the build): quantizes fixed pseudo-random rows with ggml's own
// reference quantizers (quantize_row_*_ref in ggml-quants.c; for IQ4_NL/IQ4_XS the imatrix-free
// quantize_iq4_* that llama-quantize calls) for the types the PyPI `gguf`
// package cannot quantize, so tests/test_quant.cpp can byte-compare Baton's k-quant quantizers.
// Run it through tests/gen_ggml_quant_fixtures.sh, which says how.
//
// Output per type T in the directory given as argv[1]: T.ggml.q.f32 (input rows, float32) and
// T.ggml.q.bin (ggml's blocks). Inputs stay within the range where ggml's rounding helper is
// defined (|x/scale| < 2^22), which rules out pathological outliers.
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The few ggml symbols ggml-quants.c needs besides itself; none is reached by the _ref paths.
void ggml_abort(const char* file, int line, const char* fmt, ...) {
  fprintf(stderr, "ggml_abort at %s:%d: %s\n", file, line, fmt);
  abort();
}
size_t ggml_row_size(int type, int64_t n) { (void)type; (void)n; abort(); }
const char* ggml_type_name(int type) { (void)type; return "?"; }
size_t ggml_type_size(int type) { (void)type; abort(); }

typedef void (*quant_fn)(const float*, void*, int64_t);
void quantize_row_q2_K_ref(const float*, void*, int64_t);
void quantize_row_q3_K_ref(const float*, void*, int64_t);
void quantize_row_q4_K_ref(const float*, void*, int64_t);
void quantize_row_q5_K_ref(const float*, void*, int64_t);
void quantize_row_q6_K_ref(const float*, void*, int64_t);
void quantize_row_q8_K_ref(const float*, void*, int64_t);
size_t quantize_iq4_nl(const float*, void*, int64_t, int64_t, const float*);
size_t quantize_iq4_xs(const float*, void*, int64_t, int64_t, const float*);

// The IQ4 formats as llama-quantize writes them without an importance matrix (one row).
static void quantize_row_iq4_nl(const float* x, void* y, int64_t n) { quantize_iq4_nl(x, y, 1, n, NULL); }
static void quantize_row_iq4_xs(const float* x, void* y, int64_t n) { quantize_iq4_xs(x, y, 1, n, NULL); }

enum { QK_K = 256, BLOCKS = 16 };

static uint64_t rng_state = 0x5eed2026u;
static uint64_t next_u64(void) {  // splitmix64
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double uniform(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; }
static float gaussian(void) {
  double u = uniform(), v = uniform();
  if (u < 1e-300) u = 1e-300;
  return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

// Block kinds chosen to reach the different branches of the scale searches.
static void fill_block(float* x, int kind) {
  const float scale = (float)ldexp(1.0, (int)(next_u64() % 24) - 14);
  for (int i = 0; i < QK_K; i++) {
    float g = gaussian();
    switch (kind) {
      case 0: case 1: case 2: x[i] = g * scale; break;              // plain Gaussian
      case 3: x[i] = g * g * g * scale; break;                      // heavy tails
      case 4: x[i] = fabsf(g) * scale + 0.1f * scale; break;        // all positive
      case 5: x[i] = -fabsf(g) * scale; break;                      // all negative
      case 6: x[i] = g * scale + (i == 77 ? 30.0f * scale : 0.0f); break;  // one outlier
      case 7: x[i] = 0.37f; break;                                  // constant
      case 8: x[i] = 0.0f; break;                                   // zero
      case 9: x[i] = (float)((i % 16) - 8) * 0.25f; break;          // exact grid
      case 10: x[i] = g * 1e-6f; break;                             // tiny
      case 11: x[i] = (next_u64() % 4 == 0) ? 0.0f : g * scale; break;   // sparse
      case 12: x[i] = g * scale * (float)(1 + (i / 16) % 4 * 8); break;  // varying sub-blocks
      case 13: x[i] = g * scale + 2.0f * scale; break;              // offset mean
      case 14: x[i] = (i / 32 == 3) ? 0.0f : g * scale; break;      // one empty sub-block
      default: x[i] = sinf((float)i * 0.1f) * scale; break;         // smooth
    }
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  const struct { const char* name; quant_fn fn; size_t block_bytes; } types[] = {
    {"Q2_K", quantize_row_q2_K_ref, 84},  {"Q3_K", quantize_row_q3_K_ref, 110},
    {"Q4_K", quantize_row_q4_K_ref, 144}, {"Q5_K", quantize_row_q5_K_ref, 176},
    {"Q6_K", quantize_row_q6_K_ref, 210}, {"Q8_K", quantize_row_q8_K_ref, 292},
    {"IQ4_NL", quantize_row_iq4_nl, 8 * 18}, {"IQ4_XS", quantize_row_iq4_xs, 136},  // bytes per 256
  };
  static float x[BLOCKS * QK_K];
  static uint8_t q[BLOCKS * 292];
  for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
    for (int b = 0; b < BLOCKS; b++) fill_block(x + b * QK_K, b);
    memset(q, 0, sizeof q);
    types[t].fn(x, q, BLOCKS * QK_K);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.ggml.q.f32", argv[1], types[t].name);
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(x, sizeof x, 1, f) != 1 || fclose(f)) { perror(path); return 1; }
    snprintf(path, sizeof path, "%s/%s.ggml.q.bin", argv[1], types[t].name);
    f = fopen(path, "wb");
    if (!f || fwrite(q, types[t].block_bytes * BLOCKS, 1, f) != 1 || fclose(f)) { perror(path); return 1; }
  }
  return 0;
}
