#include "runtime/kv_cache.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "gguf/error.h"
#include "runtime/buffers.h"
#include "runtime/config.h"

namespace baton {

void check_kv_type(const ModelConfig& c, GgmlType type) {
  if (type != GgmlType::F16 && type != GgmlType::Q8_0)
    fail(ErrorKind::Usage, "KV cache type {} is not supported (f16 or q8_0)", type_name(type));
  if (type == GgmlType::Q8_0 && (c.head_dim_k % 32 != 0 || c.head_dim_v % 32 != 0))
    fail(ErrorKind::Usage, "a Q8_0 KV cache needs head dims that are multiples of 32 (this model: {}/{})",
         c.head_dim_k, c.head_dim_v);
}

int KvCache::cells(const ModelConfig& c, const KvCacheShape& s, int layer) {
  return int(kv_cells_per_seq(uint32_t(std::max(0, c.layer_window[size_t(layer)])), uint32_t(s.n_ctx)));
}

size_t KvCache::bytes(const ModelConfig& c, const KvCacheShape& s) {
  size_t total = 0;
  for (int l = s.layer_begin; l < s.layer_end; ++l) {
    const size_t per_cell = row_bytes(s.type, c.n_embd_k()) + row_bytes(s.type, c.n_embd_v());
    total += per_cell * size_t(cells(c, s, l)) * size_t(s.n_seq);
  }
  return total;
}

KvCache::KvCache(const ModelConfig& c, const KvCacheShape& s) : shape_(s) {
  check_kv_type(c, s.type);
  BATON_CHECK(0 <= s.layer_begin && s.layer_begin <= s.layer_end && s.layer_end <= c.n_layer);
  BATON_CHECK(s.n_seq >= 1 && s.n_ctx >= 1);
  layers_.resize(size_t(s.layer_end - s.layer_begin));
  for (int l = s.layer_begin; l < s.layer_end; ++l) {
    Layer& L = layers_[size_t(l - s.layer_begin)];
    cpu::KvLayerView& v = L.view;
    v.type = s.type;
    v.n_cells = cells(c, s, l);
    v.n_head_kv = c.n_head_kv;
    v.head_dim_k = c.head_dim_k;
    v.head_dim_v = c.head_dim_v;
    v.k_row = row_bytes(s.type, c.n_embd_k());
    v.v_row = row_bytes(s.type, c.n_embd_v());
    const size_t kb = v.k_row * size_t(v.n_cells) * size_t(s.n_seq), vb = v.v_row * size_t(v.n_cells) * size_t(s.n_seq);
    L.k.reset(new uint8_t[kb]);
    L.v.reset(new uint8_t[vb]);
    v.k = L.k.get();
    v.v = L.v.get();
    total_ += kb + vb;
  }
  max_rewind_ = max_rewind(c, s);
}

cpu::KvLayerView KvCache::layer(int layer) const {
  BATON_CHECK(layer >= shape_.layer_begin && layer < shape_.layer_end);
  return layers_[size_t(layer - shape_.layer_begin)].view;
}

int KvCache::copy_limit(const ModelConfig& c, const KvCacheShape& s) {
  int limit = INT_MAX;
  for (int l = s.layer_begin; l < s.layer_end; ++l)
    if (cells(c, s, l) < s.n_ctx) limit = std::min(limit, cells(c, s, l));
  return limit;
}

void KvCache::copy_prefix(int src, int dst, int n) {
  BATON_CHECK(src >= 0 && src < shape_.n_seq && dst >= 0 && dst < shape_.n_seq && src != dst);
  BATON_CHECK(n >= 0 && n <= shape_.n_ctx);
  for (const Layer& L : layers_) {
    const cpu::KvLayerView& v = L.view;
    BATON_CHECK(n <= v.n_cells);  // positions 0..n-1 in cells 0..n-1, one run per head
    for (int g = 0; g < v.n_head_kv; ++g) {
      std::memcpy(v.k_at(dst, g, 0), v.k_at(src, g, 0), size_t(n) * v.k_head_bytes());
      std::memcpy(v.v_at(dst, g, 0), v.v_at(src, g, 0), size_t(n) * v.v_head_bytes());
    }
  }
}

int KvCache::max_rewind(const ModelConfig& c, const KvCacheShape& s) {
  int r = INT_MAX;  // a ring layer keeps positions it can be rewound by: its cells beyond the window
  for (int l = s.layer_begin; l < s.layer_end; ++l)
    if (cells(c, s, l) < s.n_ctx) r = std::min(r, cells(c, s, l) - c.layer_window[size_t(l)] + 1);
  return r;
}

}  // namespace baton
