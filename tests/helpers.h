// Shared test helpers: paths to peer data, fetched models and generated files.
#pragma once
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "gguf/error.h"
#include "quant/types.h"
#include "runtime/batch.h"

namespace baton::test {

// Byte offsets of the fp16 scale fields inside one block of each quantized type. Tests write sane
// scales there and random bytes everywhere else, so every code the format allows shows up
// (extreme nibbles, 6-bit scales, high bits, -128).
inline std::vector<int> fp16_fields(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::Q8_0: case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS: return {0};
    case GgmlType::Q4_1: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K: return {0, 2};
    case GgmlType::Q2_K: return {80, 82};
    case GgmlType::Q3_K: return {108};
    case GgmlType::Q6_K: return {208};
    default: return {};
  }
}

// Byte offsets of the E8M0 exponent bytes (MXFP4's block scale 2^(e − 128)): tests write exponents
// in a sane range there (random_e8m0), as they write fp16 scales into fp16_fields.
inline std::vector<int> e8m0_fields(GgmlType t) {
  if (t == GgmlType::MXFP4) return {0};
  return {};
}
// An exponent giving |values| of about 2^-9 .. 1.5 (levels up to 12 times 2^-12 .. 2^-3).
template <class Rng>
uint8_t random_e8m0(Rng& rng) {
  return uint8_t(116 + rng() % 10);
}

// An output row as a pipeline returned it for `mode` (runtime/batch.h), against the full row of
// the same logits: what the CPU's reduction of `full` holds, word for word (for kTopK: the K best
// ids and their logits, in order). Rows without NaNs.
inline void check_output_row(uint8_t mode, const float* full, const float* got, int n_vocab) {
  std::vector<float> want(full, full + n_vocab);
  reduce_output_row(mode, want.data(), n_vocab);
  const size_t words = output_words(mode, size_t(n_vocab), 0);  // (not for kHidden rows)
  INFO("output mode " << int(mode) << ", " << words << " words");
  CHECK(std::memcmp(want.data(), got, words * sizeof(float)) == 0);
}

// Two batches of the same 12 tokens for the output-mode tests: sequence 0 with every third token
// an output row (full rows), sequence 1 with those rows asking in turn for the argmax, the top-k
// candidates and the full row.
inline std::pair<Batch, Batch> output_mode_batches(int n_vocab) {
  Batch full, mixed;
  for (int i = 0; i < 12; ++i) {
    const bool out = i % 3 == 2;
    full.add((5 + 9 * i) % n_vocab, i, 0, out);
    const LogitsMode cycle[3] = {kArgmaxOnly, kTopK, kLogitsRow};
    mixed.add((5 + 9 * i) % n_vocab, i, 1, uint8_t(!out ? kNoLogits : cycle[(i / 3) % 3]));
  }
  return {full, mixed};
}

// Every output row of `mixed` (rows `got`) against the full rows of the same logits (`full`):
// check_output_row for each; two argmax rows, one top-k and one full row.
inline void check_output_rows(const Batch& mixed, const float* full, const float* got, int n_vocab) {
  int n_mode[4] = {};
  for (size_t t = 0, r = 0; t < size_t(mixed.size()); ++t) {
    if (mixed.logits[t] == kNoLogits) continue;
    check_output_row(mixed.logits[t], full + r * size_t(n_vocab), got + r * size_t(n_vocab), n_vocab);
    n_mode[mixed.logits[t]]++;
    ++r;
  }
  CHECK(n_mode[kArgmaxOnly] == 2);
  CHECK(n_mode[kTopK] == 1);
  CHECK(n_mode[kLogitsRow] == 1);
}

inline std::string peer(const std::string& rel) { return std::string(BATON_PEER_DIR) + "/" + rel; }

// Path of a fetched model (scripts/fetch-model.sh NAME), or "" when it is absent. With
// BATON_REQUIRE_MODELS=1 (scripts/test.sh and CI) an absent model fails the test instead.
inline std::string real_model(const std::string& name, const std::string& file) {
  const char* c = std::getenv("BATON_CACHE");
  const char* h = std::getenv("HOME");
  std::string dir = c && *c ? c : std::string(h ? h : ".") + "/.cache/baton";
  std::string p = dir + "/models/" + file;
  if (std::filesystem::exists(p)) return p;
  const char* req = std::getenv("BATON_REQUIRE_MODELS");
  if (req && std::string(req) == "1") FAIL("model missing: run scripts/fetch-model.sh " << name);
  WARN("skipping: model not fetched; run scripts/fetch-model.sh " << name);
  return "";
}
inline std::string smollm2() { return real_model("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"); }
inline std::string gemma3() { return real_model("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"); }

// The whole file as bytes.
inline std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A fresh temporary directory per call, removed with everything in it when the test program
// exits (BATON_KEEP_TEST_DIRS=1 keeps them, to look at what a failing test wrote).
inline std::string temp_dir() {
  struct Made {
    std::vector<std::string> dirs;
    ~Made() {
      const char* keep = std::getenv("BATON_KEEP_TEST_DIRS");
      if (keep && std::strcmp(keep, "1") == 0) return;
      std::error_code ec;
      for (const std::string& d : dirs) std::filesystem::remove_all(d, ec);
    }
  };
  static Made made;
  std::string tmpl = (std::filesystem::temp_directory_path() / "baton-test-XXXXXX").string();
  char* d = mkdtemp(tmpl.data());
  REQUIRE(d != nullptr);
  made.dirs.push_back(d);
  return d;
}

// The message of the baton::Error (of kind Usage) that f() throws; "" when it throws none.
template <class F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const baton::Error& e) {
    CHECK(e.kind() == baton::ErrorKind::Usage);
    return e.what();
  }
  return "";
}

}  // namespace baton::test
