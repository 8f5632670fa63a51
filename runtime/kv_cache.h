// The KV cache of one stage: for each layer of its range, n_seq sequence slots of cells holding
// K and V rows in F16 (default) or Q8_0. Full-attention layers keep n_ctx cells per slot;
// sliding-window layers keep a ring of min(window + kRingRewind - 1, n_ctx) cells (position p in
// cell p % n_cells; runtime/buffers.h, the planner's kv_cells): attention reads the batch's own keys
// from staging rows and commits them to the ring afterwards (cpu::attention), so the window is
// enough for any batch size, and the cells beyond it let a sequence be rewound by kRingRewind.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/ops.h"
#include "quant/types.h"

namespace baton {

struct ModelConfig;

struct KvCacheShape {
  int layer_begin = 0, layer_end = 0;
  int n_seq = 1;
  int n_ctx = 0;      // positions per sequence
  GgmlType type = GgmlType::F16;
};

class KvCache {
 public:
  KvCache(const ModelConfig& c, const KvCacheShape& shape);

  // Cells one sequence keeps for layer `layer` (absolute index), and the total bytes: the same
  // numbers the planner uses, so planned and allocated cannot differ.
  static int cells(const ModelConfig& c, const KvCacheShape& shape, int layer);
  static size_t bytes(const ModelConfig& c, const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  cpu::KvLayerView layer(int layer) const;  // absolute layer index within [layer_begin, layer_end)
  size_t bytes() const { return total_; }
  // How many positions a sequence can be rewound (truncated from its end, not to 0) without
  // losing cells a later query needs: kRingRewind when a ring layer is present, unlimited (INT_MAX)
  // otherwise.
  int max_rewind() const { return max_rewind_; }
  static int max_rewind(const ModelConfig& c, const KvCacheShape& shape);  // the same, from the shape
  // The longest sequence whose first positions copy_prefix can copy: the fewest cells a layer
  // keeps (a ring's; INT_MAX when every layer keeps n_ctx).
  static int copy_limit(const ModelConfig& c, const KvCacheShape& shape);
  // Sequence dst's first n positions become src's (n <= copy_limit; src holds at most that many).
  void copy_prefix(int src, int dst, int n);

 private:
  struct Layer {
    // Not zeroed: cells are written before any query reads them, and untouched pages of a large
    // allocation cost nothing until used (a cache sized for 16 × 4096 positions would otherwise be
    // written in full at load).
    std::unique_ptr<uint8_t[]> k, v;
    cpu::KvLayerView view;
  };
  KvCacheShape shape_;
  std::vector<Layer> layers_;
  int max_rewind_ = 0;
  size_t total_ = 0;
};

// Checks the cache type and head dims; throws Error(Usage) naming the problem.
void check_kv_type(const ModelConfig& c, GgmlType type);

}  // namespace baton
