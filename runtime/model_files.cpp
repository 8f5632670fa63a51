#include "runtime/model_files.h"

#include <cstdlib>
#include <filesystem>

#include "gguf/error.h"

namespace baton {

const std::vector<KnownModel>& known_models() {
  static const std::vector<KnownModel> k = {
    {"smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct, Q4_1 (llama architecture, ChatML)"},
    {"gemma3-270m", "gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M instruct, Q4_K_M"},
  };
  return k;
}

std::string cache_dir() {
  if (const char* c = std::getenv("BATON_CACHE"); c && *c) return c;
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/baton";
  return ".cache/baton";
}

std::string resolve_model(const std::string& m) {
  namespace fs = std::filesystem;
  if (m.empty()) fail(ErrorKind::Usage, "no model given: use -m PATH or -m NAME (e.g. -m smollm2-135m)");
  for (const auto& k : known_models()) {
    if (m != k.name) continue;
    std::string p = cache_dir() + "/models/" + k.file;
    if (!fs::exists(p))
      fail(ErrorKind::Model, "model '{}' is not downloaded yet: run scripts/fetch-model.sh {} (expected at {})",
           m, k.name, p);
    return p;
  }
  std::error_code ec;
  if (!fs::exists(m, ec)) {
    std::string names;
    for (const auto& k : known_models()) names += std::string(names.empty() ? "" : ", ") + k.name;
    fail(ErrorKind::Model, "model file '{}' does not exist (known names: {})", m, names);
  }
  return m;
}

}  // namespace baton
