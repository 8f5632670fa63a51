#include "runtime/control_vector.h"

#include <charconv>

#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/config.h"

namespace baton {

ControlVectors::ControlVectors(const std::vector<ControlVectorFile>& files, const ModelConfig& cfg, int first, int last) {
  if (first >= 0 && last >= 0 && first > last)
    fail(ErrorKind::Usage, "--control-vector-layer-range {} {}: the first layer is after the last", first, last);
  sum_.resize(size_t(cfg.n_layer));
  for (const ControlVectorFile& cf : files) {
    const auto f = gguf::File::open(cf.path);
    const std::string& path = f->path();
    const std::string arch = f->get_or<std::string>("general.architecture", "");
    if (arch != "controlvector")
      fail(ErrorKind::Model, "{}: not a control vector (general.architecture is '{}', not 'controlvector')", path, arch);
    const std::string hint = f->get_or<std::string>("controlvector.model_hint", "");
    if (!hint.empty() && hint != cfg.arch)
      warnings_.push_back(fmt::format("{}: a control vector made for '{}', applied to a '{}' model", path, hint, cfg.arch));
    for (const gguf::TensorInfo& t : f->tensors()) {
      int l = -1;
      const char* b = t.name.data() + 10;
      const char* e = t.name.data() + t.name.size();
      if (!t.name.starts_with("direction.") || std::from_chars(b, e, l).ptr != e || b == e)
        fail(ErrorKind::Model, "{}: tensor '{}' is not a direction.L of a control vector", path, t.name);
      if (l < 1 || l >= cfg.n_layer)
        fail(ErrorKind::Model, "{}: '{}' steers layer {}, and the model's layers that can be steered are 1..{}", path,
             t.name, l, cfg.n_layer - 1);
      if (t.type != GgmlType::F32 || t.n_dims != 1 || t.ne[0] != cfg.n_embd)
        fail(ErrorKind::Model, "{}: '{}' must be {} F32 values (the model's width); it is {} {}", path, t.name,
             cfg.n_embd, t.nelements(), type_name(t.type));
      if ((first >= 0 && l < first) || (last >= 0 && l > last)) continue;
      std::vector<float>& s = sum_[size_t(l)];
      s.resize(size_t(cfg.n_embd), 0.f);
      const float* v = reinterpret_cast<const float*>(t.data);
      for (size_t i = 0; i < s.size(); ++i) s[i] += cf.scale * v[i];
    }
  }
}

const float* ControlVectors::layer(int l) const {
  return l >= 0 && size_t(l) < sum_.size() && !sum_[size_t(l)].empty() ? sum_[size_t(l)].data() : nullptr;
}

}  // namespace baton
