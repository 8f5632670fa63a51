#include "runtime/quantize_model.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <thread>

#include "kernels/cpu/threadpool.h"
#include "quant/quant.h"
#include "runtime/shape.h"

namespace baton {

const std::vector<QuantFileType>& quant_file_types() {
  using T = GgmlType;
  static const std::vector<QuantFileType> kTypes = {
      {"F32", 0, T::F32, "32-bit floats"},
      {"F16", 1, T::F16, "16-bit floats"},
      {"BF16", 32, T::BF16, "bfloat16"},
      {"Q8_0", 7, T::Q8_0, "8.5 bits a weight, nearly lossless"},
      {"Q6_K", 18, T::Q6_K, "6.56 bits"},
      {"Q5_K_M", 17, T::Q5_K, "Q5_K, some attn_v/ffn_down Q6_K"},
      {"Q5_K_S", 16, T::Q5_K, "Q5_K"},
      {"Q5_1", 9, T::Q5_1, "6 bits, legacy"},
      {"Q5_0", 8, T::Q5_0, "5.5 bits, legacy"},
      {"Q4_K_M", 15, T::Q4_K, "Q4_K, some attn_v/ffn_down Q6_K: the usual choice"},
      {"Q4_K_S", 14, T::Q4_K, "Q4_K, the first layers' attn_v/ffn_down Q5_K"},
      {"Q4_1", 3, T::Q4_1, "5 bits, legacy"},
      {"Q4_0", 2, T::Q4_0, "4.5 bits, legacy"},
      {"IQ4_XS", 30, T::IQ4_XS, "4.25 bits, non-linear levels"},
      {"IQ4_NL", 25, T::IQ4_NL, "4.5 bits, non-linear levels"},
      {"Q3_K_L", 13, T::Q3_K, "Q3_K, attn_v/ffn_down/attn_output Q5_K"},
      {"Q3_K_M", 12, T::Q3_K, "Q3_K, attn_v/ffn_down/attn_output Q4_K-Q5_K"},
      {"Q3_K_S", 11, T::Q3_K, "Q3_K"},
      {"Q2_K", 10, T::Q2_K, "Q2_K, attn_v Q3_K-Q4_K, ffn_down/attn_output Q3_K: small, lossy"},
  };
  return kTypes;
}

const QuantFileType* find_quant_file_type(const std::string& name) {
  std::string up = name;
  for (char& c : up) c = char(std::toupper(static_cast<unsigned char>(c)));
  for (const QuantFileType& t : quant_file_types())
    if (up == t.name) return &t;
  return nullptr;
}

namespace {

// What the mix rules look at besides a tensor's name and shape.
struct ModelFacts {
  int n_layer = 0;
  int n_gqa = 1;        // query heads per KV head
  int n_expert = 1;
  bool has_output = false;  // an output.weight (else the embedding doubles as the head)
  bool is_70b = false;      // Llama 2/3 70B's 8-way shared attn_v: llama-quantize gives it more bits
};

ModelFacts facts_of(const gguf::File& f) {
  ModelFacts m;
  const std::string arch = f.has("general.architecture") ? f.architecture() : "";
  auto first_int = [&](const std::string& suffix, int64_t fallback) {
    const std::string key = arch + "." + suffix;
    if (arch.empty() || !f.has(key)) return fallback;
    const gguf::Value* v = f.find(key);
    if (v->type == gguf::ValueType::ARRAY) {  // per layer: the largest
      const auto all = f.get_ints(key);
      return all.empty() ? fallback : *std::max_element(all.begin(), all.end());
    }
    return f.get<int64_t>(key);
  };
  m.n_layer = int(first_int("block_count", 0));
  const int64_t heads = first_int("attention.head_count", 1), kv = first_int("attention.head_count_kv", heads);
  m.n_gqa = kv > 0 ? int(std::max<int64_t>(1, heads / kv)) : 1;
  m.n_expert = int(std::max<int64_t>(1, first_int("expert_count", 1)));
  m.has_output = f.tensor("output.weight") != nullptr;
  m.is_70b = arch == "llama" && m.n_layer == 80 && heads != kv;
  return m;
}

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::char_traits<char>::length(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}
bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Whether llama-quantize quantizes a tensor at all: the 2-D (and up) weights that are not norms,
// routers, or position / token-type embeddings (and not the recurrent models' small mixing ones).
bool is_quantizable(const gguf::TensorInfo& t, const QuantizeOptions& o) {
  const std::string& n = t.name;
  if (!ends_with(n, "weight") || t.n_dims < 2) return false;
  if (has(n, "_norm.weight") || has(n, "ffn_gate_inp.weight")) return false;
  if (n == "position_embd.weight" || n == "token_types.weight") return false;
  for (const char* p : {"ssm_conv1d.weight", "time_mix_first.weight", "time_mix_w1.weight", "time_mix_w2.weight",
                        "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
                        "attn_rel_b.weight"})
    if (has(n, p)) return false;
  return !(o.leave_output && n == "output.weight");
}

int layer_of(const std::string& name) {
  int layer = -1;
  return std::sscanf(name.c_str(), "blk.%d.", &layer) == 1 ? layer : -1;
}

// llama-quantize's adjustments to the recipe's type for one tensor (its rules for the file types
// above, without an importance matrix; Falcon's own branches left out: Baton does not run Falcon).
GgmlType mixed_type(const std::string& ft, GgmlType t, const gguf::TensorInfo& x, const ModelFacts& m,
                    const QuantizeOptions& o) {
  using T = GgmlType;
  const std::string& name = x.name;
  const int layer = layer_of(name), n = std::max(1, m.n_layer);
  // The first and last eighth of the layers, and every third one between: where more bits pay.
  const bool more_bits = layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2;
  auto is = [&](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(), [&](const char* s) { return ft == s; });
  };
  if (name == "output.weight" || (!m.has_output && name == "token_embd.weight")) {
    if (o.output_type) return *o.output_type;
    if (x.ne[0] % traits(t).block_elems != 0) return T::Q8_0;
    return t == T::Q8_0 ? t : T::Q6_K;
  }
  if (name == "token_embd.weight") return o.embedding_type ? *o.embedding_type : t;
  if (has(name, "attn_v.weight")) {
    if (ft == "Q2_K") t = m.n_gqa >= 4 ? T::Q4_K : T::Q3_K;
    else if (ft == "Q3_K_M") t = layer < 2 ? T::Q5_K : T::Q4_K;
    else if (ft == "Q3_K_L") t = T::Q5_K;
    else if (is({"IQ4_NL", "IQ4_XS"}) && m.n_gqa >= 4) t = T::Q5_K;
    else if (is({"Q4_K_M", "Q5_K_M"}) && more_bits) t = T::Q6_K;
    else if (ft == "Q4_K_S" && layer < 4) t = T::Q5_K;
    if (m.is_70b && (t == T::Q3_K || t == T::Q4_K)) t = T::Q5_K;
    if (m.n_expert == 8) t = T::Q8_0;
    return t;
  }
  if (has(name, "attn_k.weight")) return m.n_expert == 8 ? T::Q8_0 : t;
  if (has(name, "attn_q.weight")) return t;
  if (has(name, "ffn_down")) {
    if (ft == "Q2_K") t = T::Q3_K;
    else if (ft == "Q3_K_M") t = layer < n / 16 ? T::Q5_K : T::Q4_K;
    else if (ft == "Q3_K_L") t = T::Q5_K;
    else if (ft == "Q4_K_M") t = more_bits ? T::Q6_K : t;
    else if (layer < n / 8 && is({"IQ4_NL", "IQ4_XS"})) t = T::Q5_K;
    else if (ft == "Q5_K_M" && more_bits) t = T::Q6_K;
    else if (ft == "Q4_K_S" && layer < n / 8) t = T::Q5_K;
    return t;
  }
  if (has(name, "attn_output.weight")) {
    if (m.n_expert == 8) return is({"Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS"}) ? T::Q5_K : t;
    if (ft == "Q2_K") return T::Q3_K;
    if (ft == "Q3_K_M") return T::Q4_K;
    if (ft == "Q3_K_L") return T::Q5_K;
    return t;
  }
  if (has(name, "attn_qkv.weight")) {
    if (is({"Q3_K_M", "Q3_K_L"})) return T::Q4_K;
    if (ft == "Q4_K_M") return T::Q5_K;
    if (ft == "Q5_K_M") return T::Q6_K;
  }
  return t;
}

}  // namespace

std::vector<TensorPlan> plan_quantization(const gguf::File& in, const QuantizeOptions& o) {
  const QuantFileType* ft = find_quant_file_type(o.type);
  if (!ft) fail(ErrorKind::Usage, "unknown type '{}' (baton quantize --help lists them)", o.type);
  for (const auto& [what, t] : {std::pair{"--output-tensor-type", o.output_type}, std::pair{"--token-embedding-type", o.embedding_type}})
    if (t && !has_quantize(*t)) fail(ErrorKind::Usage, "{}: Baton cannot write {} tensors", what, type_name(*t));
  const ModelFacts m = facts_of(in);
  const bool mix = !o.pure && traits(ft->base).block_elems > 1;  // the plain float types: no rules
  std::vector<TensorPlan> plan;
  for (const gguf::TensorInfo& t : in.tensors()) {
    TensorPlan p;
    p.tensor = &t;
    p.to = t.type;
    if (is_quantizable(t, o)) {
      GgmlType to = mix ? mixed_type(ft->name, ft->base, t, m, o) : ft->base;
      if (!mix && o.embedding_type && t.name == "token_embd.weight") to = *o.embedding_type;
      if (!mix && o.output_type && t.name == "output.weight") to = *o.output_type;
      if (t.ne[0] % traits(to).block_elems != 0) {  // rows the type's blocks do not divide: its stand-in
        to = weight_type_for_row(to, t.ne[0]);
        p.fallback = true;
      }
      if (to != t.type) {
        if (traits(t.type).block_elems > 1 && !o.allow_requantize)
          fail(ErrorKind::Usage,
               "{} is already {}: quantizing it again loses more than quantizing the original weights "
               "(--allow-requantize does it anyway)",
               t.name, type_name(t.type));
        if (!traits(t.type).compute)
          fail(ErrorKind::Usage, "{}: Baton cannot read {} tensors", t.name, type_name(t.type));
        if (!has_quantize(to)) fail(ErrorKind::Usage, "{}: Baton cannot write {} tensors", t.name, type_name(to));
      }
      p.to = to;
    }
    p.bytes = p.to == t.type ? t.nbytes : row_bytes(p.to, t.ne[0]) * uint64_t(t.nrows());
    plan.push_back(p);
  }
  return plan;
}

void quantize_model(const gguf::File& in, const std::vector<TensorPlan>& plan, const QuantizeOptions& o,
                    const std::string& out, int threads, const std::function<void(size_t, size_t)>& progress) {
  const QuantFileType* ft = find_quant_file_type(o.type);
  BATON_CHECK(ft != nullptr);
  gguf::Writer w(in.version() >= 3 ? 3 : in.version());
  for (const auto& [key, value] : in.metadata()) {
    if (key == "split.no" || key == "split.count" || key == "split.tensors.count") continue;
    w.set(key, value);
  }
  w.set("general.quantization_version", gguf::Value::of_u32(2));
  w.set("general.file_type", gguf::Value::of_u32(ft->ftype));
  threads = std::max(1, threads);
  size_t done = 0;
  for (const TensorPlan& p : plan) {
    const gguf::TensorInfo& t = *p.tensor;
    std::vector<int64_t> dims(t.ne, t.ne + t.n_dims);
    auto tick = [&, total = plan.size()] {
      if (progress) progress(++done, total);
    };
    if (p.to == t.type) {
      w.add_tensor_lazy(t.name, t.type, dims, [&t, tick](uint8_t* dst, size_t n) {
        std::copy(t.data, t.data + n, dst);
        tick();
      });
      continue;
    }
    w.add_tensor_lazy(t.name, p.to, dims, [&t, to = p.to, threads, tick](uint8_t* dst, size_t) {
      const int64_t cols = t.ne[0], rows = t.nrows();
      const size_t in_row = row_bytes(t.type, cols), out_row = row_bytes(to, cols);
      // Rows in contiguous parts, one a thread: each row is quantized on its own, so the bytes
      // do not depend on the thread count.
      const int parts = int(std::clamp<int64_t>(rows / 16, 1, threads));
      cpu::run_on_threads(parts, [&](int k) {
        std::vector<float> row(static_cast<size_t>(cols));
        for (int64_t r = rows * k / parts; r < rows * (k + 1) / parts; ++r) {
          dequantize_row(t.type, t.data + size_t(r) * in_row, row.data(), cols);
          quantize_row(to, row.data(), dst + size_t(r) * out_row, cols);
        }
      });
      tick();
    });
  }
  w.write(out);
}

}  // namespace baton
