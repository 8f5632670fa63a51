// Control vectors (llama.cpp's --control-vector files): GGUF files with general.architecture
// "controlvector", controlvector.model_hint (the architecture they were made for) and one F32
// tensor `direction.L` of n_embd values per steered layer L >= 1. Each file's directions, times
// its scale, are summed per layer and added to the hidden state after that layer (its output, as
// the next layer reads it), for the layers in [first, last] when a range is given.
#pragma once
#include <string>
#include <vector>

namespace baton {

struct ModelConfig;

struct ControlVectorFile {
  std::string path;
  float scale = 1.f;
};

class ControlVectors {
 public:
  // Error(Model) naming the file and the tensor: not a control vector, a width other than the
  // model's, a layer the model does not have, a tensor that is not direction.L in F32. first/last
  // (-1: no bound) is the inclusive range of layers steered; Error(Usage) when it is empty.
  ControlVectors(const std::vector<ControlVectorFile>& files, const ModelConfig& cfg, int first = -1, int last = -1);

  // What the forward adds to layer l's output (n_embd values), or null for a layer left alone.
  const float* layer(int l) const;
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  std::vector<std::vector<float>> sum_;  // n_layer entries; empty: none
  std::vector<std::string> warnings_;
};

}  // namespace baton
