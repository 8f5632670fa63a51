#include "quant/types.h"

#include <cctype>
#include <cstdlib>

namespace baton {
namespace {

using G = GgmlType;
// id, name, elements/block, bytes/block, computes
constexpr TypeTraits kTable[] = {
  {G::F32, "F32", 1, 4, true},        {G::F16, "F16", 1, 2, true},
  {G::Q4_0, "Q4_0", 32, 18, true},    {G::Q4_1, "Q4_1", 32, 20, true},
  {G::Q5_0, "Q5_0", 32, 22, true},    {G::Q5_1, "Q5_1", 32, 24, true},
  {G::Q8_0, "Q8_0", 32, 34, true},    {G::Q8_1, "Q8_1", 32, 36, false},
  {G::Q2_K, "Q2_K", 256, 84, true},   {G::Q3_K, "Q3_K", 256, 110, true},
  {G::Q4_K, "Q4_K", 256, 144, true},  {G::Q5_K, "Q5_K", 256, 176, true},
  {G::Q6_K, "Q6_K", 256, 210, true},  {G::Q8_K, "Q8_K", 256, 292, false},
  {G::IQ2_XXS, "IQ2_XXS", 256, 66, false}, {G::IQ2_XS, "IQ2_XS", 256, 74, false},
  {G::IQ3_XXS, "IQ3_XXS", 256, 98, false}, {G::IQ1_S, "IQ1_S", 256, 50, false},
  {G::IQ4_NL, "IQ4_NL", 32, 18, true},    {G::IQ3_S, "IQ3_S", 256, 110, false},
  {G::IQ2_S, "IQ2_S", 256, 82, false},     {G::IQ4_XS, "IQ4_XS", 256, 136, true},
  {G::I8, "I8", 1, 1, false},   {G::I16, "I16", 1, 2, false}, {G::I32, "I32", 1, 4, false},
  {G::I64, "I64", 1, 8, false}, {G::F64, "F64", 1, 8, false},
  {G::IQ1_M, "IQ1_M", 256, 56, false},     {G::BF16, "BF16", 1, 2, true},
  {G::TQ1_0, "TQ1_0", 256, 54, false},     {G::TQ2_0, "TQ2_0", 256, 66, false},
  {G::MXFP4, "MXFP4", 32, 17, true},
};

}  // namespace

const TypeTraits* type_traits(uint32_t id) {
  for (const TypeTraits& t : kTable)
    if (uint32_t(t.type) == id) return &t;
  return nullptr;
}

const TypeTraits& traits(GgmlType t) {
  const TypeTraits* tt = type_traits(uint32_t(t));
  if (!tt) std::abort();  // internal invariant: callers validate ids read from files
  return *tt;
}

const TypeTraits* type_by_name(std::string_view name) {
  for (const TypeTraits& t : kTable) {
    std::string_view n = t.name;
    if (n.size() != name.size()) continue;
    bool eq = true;
    for (size_t i = 0; i < n.size() && eq; i++)
      eq = std::toupper((unsigned char)n[i]) == std::toupper((unsigned char)name[i]);
    if (eq) return &t;
  }
  return nullptr;
}

}  // namespace baton
