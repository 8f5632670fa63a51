#include "gguf/file_type.h"

#include <map>
#include <utility>

namespace baton::gguf {
namespace {

// Values as the GGUF spec lists them, extended by the later ones llama.cpp's quantizer writes.
// 4 (Q4_1 with F16 embeddings), 5 and 6 (Q4_2, Q4_3) and 33..35 (the Q4_0 repacks) are retired.
struct Entry {
  uint32_t value;
  const char* name;
};
constexpr Entry kFileTypes[] = {
    {0, "F32"},       {1, "F16"},       {2, "Q4_0"},      {3, "Q4_1"},     {7, "Q8_0"},
    {8, "Q5_0"},      {9, "Q5_1"},      {10, "Q2_K"},     {11, "Q3_K_S"},  {12, "Q3_K_M"},
    {13, "Q3_K_L"},   {14, "Q4_K_S"},   {15, "Q4_K_M"},   {16, "Q5_K_S"},  {17, "Q5_K_M"},
    {18, "Q6_K"},     {19, "IQ2_XXS"},  {20, "IQ2_XS"},   {21, "Q2_K_S"},  {22, "IQ3_XS"},
    {23, "IQ3_XXS"},  {24, "IQ1_S"},    {25, "IQ4_NL"},   {26, "IQ3_S"},   {27, "IQ3_M"},
    {28, "IQ2_S"},    {29, "IQ2_M"},    {30, "IQ4_XS"},   {31, "IQ1_M"},   {32, "BF16"},
    {36, "TQ1_0"},    {37, "TQ2_0"},    {38, "MXFP4_MOE"},
};

}  // namespace

const char* file_type_name(uint32_t file_type) {
  for (const Entry& e : kFileTypes)
    if (e.value == file_type) return e.name;
  return nullptr;
}

std::optional<uint32_t> file_type_for(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return 0;
    case GgmlType::F16: return 1;
    case GgmlType::Q4_0: return 2;
    case GgmlType::Q4_1: return 3;
    case GgmlType::Q8_0: return 7;
    case GgmlType::Q5_0: return 8;
    case GgmlType::Q5_1: return 9;
    case GgmlType::Q2_K: return 10;
    case GgmlType::Q3_K: return 11;
    case GgmlType::Q4_K: return 14;
    case GgmlType::Q5_K: return 16;
    case GgmlType::Q6_K: return 18;
    case GgmlType::IQ4_NL: return 25;
    case GgmlType::IQ4_XS: return 30;
    case GgmlType::MXFP4: return 38;  // MXFP4_MOE: MXFP4 experts, the rest Q8_0 (what synth writes too)
    case GgmlType::BF16: return 32;
    default: return std::nullopt;
  }
}

std::string weight_type_label(const File& f) {
  if (const Value* v = f.find("general.file_type"); v && v->is_int()) {
    const bool is_signed = v->type == ValueType::INT8 || v->type == ValueType::INT16 ||
                           v->type == ValueType::INT32 || v->type == ValueType::INT64;
    const uint64_t value = is_signed ? (v->i < 0 ? UINT64_MAX : uint64_t(v->i)) : v->u;
    if (value <= UINT32_MAX)
      if (const char* name = file_type_name(uint32_t(value))) return name;
  }
  // No (usable) file type: count tensors rather than bytes, so one huge embedding matrix in
  // another type does not outvote every layer. Ties go to the type holding more bytes.
  auto majority = [&](bool layers_only) -> std::optional<GgmlType> {
    std::map<GgmlType, std::pair<size_t, uint64_t>> seen;  // count, bytes
    for (const TensorInfo& t : f.tensors()) {
      if (t.n_dims < 2 || (layers_only && t.name.rfind("blk.", 0) != 0)) continue;
      auto& s = seen[t.type];
      s.first++;
      s.second += t.nbytes;
    }
    if (seen.empty()) return std::nullopt;
    auto best = seen.begin();
    for (auto it = seen.begin(); it != seen.end(); ++it)
      if (it->second > best->second) best = it;
    return best->first;
  };
  if (auto t = majority(true)) return type_name(*t);
  if (auto t = majority(false)) return type_name(*t);
  return "?";
}

}  // namespace baton::gguf
