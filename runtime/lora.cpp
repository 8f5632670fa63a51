#include "runtime/lora.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "gguf/error.h"
#include "gguf/gguf.h"
#include "kernels/cpu/packed.h"
#include "kernels/cuda/layout.h"
#include "quant/quant.h"
#include "quant/types.h"
#include "runtime/config.h"
#include "runtime/shape.h"

namespace baton {

namespace {

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The base tensors the CPU forward runs through an adaptable matmul (models/llama.cpp).
bool adaptable(const std::string& name, int n_layer) {
  if (name == "output.weight" || name == "token_embd.weight") return true;
  const int l = (int)block_index(name);
  if (l < 0 || l >= n_layer) return false;
  for (LayerTensor t : {LayerTensor::Wq, LayerTensor::Wk, LayerTensor::Wv, LayerTensor::Wqkv, LayerTensor::Wo,
                        LayerTensor::Gate, LayerTensor::Up, LayerTensor::Down})
    if (name == layer_tensor_key(l, t)) return true;
  return false;
}


}  // namespace

uint64_t lora_pair_bytes(const LoraTensor& t) {
  return t.a->nbytes + t.b->nbytes;
}

int64_t lora_padded_rank(int64_t rank) { return (rank + 31) / 32 * 32; }

uint64_t lora_cpu_bytes(const LoraTensor& t) {
  const int64_t rp = lora_padded_rank(t.b->ne[0]);  // B [r, n_out] (the embedding's [r, n_embd])
  const uint64_t b = cpu::packed_bytes(GgmlType::F16, t.b->ne[1], rp);
  if (t.name == "token_embd.weight") return t.a->nbytes + b;
  return cpu::packed_bytes(GgmlType::F16, rp, t.a->ne[0]) + b;
}

uint64_t lora_gpu_bytes(const LoraTensor& t) {
  const int64_t rp = lora_padded_rank(t.b->ne[0]);
  const uint64_t row_p = cuda::packed_row_bytes(GgmlType::F16, rp);  // a row of the padded rank
  const uint64_t b = row_p * uint64_t(t.b->ne[1]);
  if (t.name == "token_embd.weight")  // A [r, n_vocab]
    return cuda::packed_row_bytes(lora_embd_gpu_type(t.a->type), rp) * uint64_t(t.a->ne[1]) + b;
  return cuda::packed_row_bytes(GgmlType::F16, t.a->ne[0]) * uint64_t(rp) + b;
}

LoraAdapters::LoraAdapters(const std::vector<LoraFile>& files, const gguf::File& base, const ModelConfig& cfg) {
  if (files.size() > size_t(kMaxLoraFiles))
    fail(ErrorKind::Usage, "{} LoRA adapters given; at most {} run at once", files.size(), kMaxLoraFiles);
  for (const LoraFile& lf : files) {
    files_.push_back(gguf::File::open(lf.path));
    const gguf::File& f = *files_.back();
    const std::string& path = f.path();
    const std::string type = f.get_or<std::string>("general.type", "");
    if (type != "adapter")
      fail(ErrorKind::Model, "{}: not a LoRA adapter (general.type is '{}', an adapter's is 'adapter')", path,
           type.empty() ? "(none)" : type);
    const std::string kind = f.get_or<std::string>("adapter.type", "");
    if (kind != "lora") fail(ErrorKind::Model, "{}: adapter.type is '{}'; only 'lora' adapters are supported", path, kind);
    const std::string arch = f.get_or<std::string>("general.architecture", "");
    if (arch != cfg.arch)
      fail(ErrorKind::Model, "{}: an adapter for architecture '{}', the model is '{}'", path, arch, cfg.arch);
    const float alpha = f.get_or<float>("adapter.lora.alpha", 0.f);

    // Pair the tensors: name -> (a, b).
    std::map<std::string, std::pair<const gguf::TensorInfo*, const gguf::TensorInfo*>> pairs;
    int norms = 0;
    for (const gguf::TensorInfo& t : f.tensors()) {
      if (ends_with(t.name, ".lora_a")) pairs[t.name.substr(0, t.name.size() - 7)].first = &t;
      else if (ends_with(t.name, ".lora_b")) pairs[t.name.substr(0, t.name.size() - 7)].second = &t;
      else if (ends_with(t.name, "_norm.weight")) ++norms;
      else fail(ErrorKind::Model, "{}: tensor '{}' is neither a .lora_a nor a .lora_b", path, t.name);
    }
    if (pairs.empty()) fail(ErrorKind::Model, "{}: the adapter has no .lora_a/.lora_b tensors", path);
    if (norms)
      warnings_.push_back(fmt::format("{}: {} norm weight{} of the adapter skipped (only matrices are adapted)", path,
                                      norms, norms > 1 ? "s" : ""));
    for (const auto& [name, ab] : pairs) {
      const auto [a, b] = ab;
      if (!a || !b)
        fail(ErrorKind::Model, "{}: '{}' has a .lora_{} but no .lora_{}", path, name, a ? "a" : "b", a ? "b" : "a");
      const gguf::TensorInfo* w = base.tensor(name);
      if (!w) fail(ErrorKind::Model, "{}: '{}' is not a tensor of the model (an adapter for another model?)", path, name);
      if (!adaptable(name, cfg.n_layer))
        fail(ErrorKind::Model, "{}: '{}': Baton adapts only the attention and dense FFN matrices, the output head and "
             "the token embedding", path, name);
      for (const gguf::TensorInfo* t : {a, b}) {
        const TypeTraits* tt = type_traits(uint32_t(t->type));
        if (t->n_dims != 2 || !tt || !tt->compute || t->ne[0] % tt->block_elems != 0)
          fail(ErrorKind::Model, "{}: '{}' ({} {}) is not a matrix Baton can multiply with", path, t->name,
               tt ? tt->name : "unknown type", t->shape_str());
      }
      // Ranks: A [n_in, r] and B [r, n_out]; the embedding's A [r, n_vocab] and B [r, n_embd].
      const bool embd = name == "token_embd.weight";
      const int64_t rank = b->ne[0];
      const bool ok = embd ? a->ne[0] == rank && a->ne[1] == w->ne[1] && b->ne[1] == w->ne[0]
                           : a->ne[1] == rank && a->ne[0] == w->ne[0] && b->ne[1] == w->ne[1];
      if (!ok)
        fail(ErrorKind::Model, "{}: '{}' is {} but its pair is {} and {} (an adapter for another model?)", path, name,
             w->shape_str(), a->shape_str(), b->shape_str());
      LoraTensor lt;
      lt.name = name;
      lt.a = a;
      lt.b = b;
      lt.scale = alpha != 0.f ? lf.scale * alpha / float(rank) : lf.scale;
      tensors_.push_back(lt);
    }
  }
}

LoraAdapters::~LoraAdapters() = default;

void LoraAdapters::add_to(ModelShape& shape) const {
  for (const LoraTensor& t : tensors_) {
    const uint64_t n = std::max(lora_cpu_bytes(t), lora_gpu_bytes(t));
    const int l = (int)block_index(t.name);
    if (l >= 0) shape.layers.at(size_t(l)).weight_bytes += n;
    else if (t.name == "token_embd.weight") shape.embedding_bytes += n;
    else shape.output_bytes += n;
  }
  if (!tensors_.empty()) shape.lora_gpu_buffer = kLoraChunkFloats * sizeof(float);
}

gguf::Writer lora_synth_writer(const gguf::File& base, const LoraSynthOptions& opt) {
  if (opt.rank < 1) fail(ErrorKind::Usage, "LoRA rank {} must be at least 1", opt.rank);
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::of_str(base.architecture()));
  w.set("general.type", gguf::Value::of_str("adapter"));
  w.set("adapter.type", gguf::Value::of_str("lora"));
  if (opt.alpha != 0.f) w.set("adapter.lora.alpha", gguf::Value::of_f32(opt.alpha));
  std::mt19937_64 rng(opt.seed);
  const TypeTraits& tt = traits(opt.type);
  // Rows of `cols` values drawn from normal(0, sd), stored in opt.type.
  auto add = [&](const std::string& name, int64_t cols, int64_t rows, float sd) {
    if (cols % tt.block_elems != 0 || !has_quantize(opt.type))
      fail(ErrorKind::Usage, "{}: rows of {} values do not fit {}", name, cols, tt.name);
    std::normal_distribution<float> normal(0.f, sd);
    std::vector<float> row(static_cast<size_t>(cols));
    std::vector<uint8_t> bytes(size_t(rows) * row_bytes(opt.type, cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (float& v : row) v = normal(rng);
      quantize_row(opt.type, row.data(), bytes.data() + size_t(r) * row_bytes(opt.type, cols), cols);
    }
    w.add_tensor(name, opt.type, {cols, rows}, bytes.data(), bytes.size());
  };
  const int64_t r = opt.rank;
  for (const std::string& name : opt.targets) {
    const gguf::TensorInfo* t = base.tensor(name);
    if (!t || t->n_dims != 2) fail(ErrorKind::Usage, "{}: no such matrix in {}", name, base.path());
    const int64_t n_in = t->ne[0], n_out = t->ne[1];
    if (name == "token_embd.weight") {  // A [r, n_vocab], B [r, n_embd]
      add(name + ".lora_a", r, n_out, 1.f);
      add(name + ".lora_b", r, n_in, opt.amplitude / std::sqrt(float(r)));
    } else {                            // A [n_in, r], B [r, n_out]
      add(name + ".lora_a", n_in, r, 1.f / std::sqrt(float(n_in)));
      add(name + ".lora_b", r, n_out, opt.amplitude / std::sqrt(float(r)));
    }
  }
  return w;
}

}  // namespace baton
