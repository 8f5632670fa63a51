// general.file_type: the GGUF spec's enumeration of what most of a file's weights are stored as
// ("MOSTLY_Q4_K_M" = 15, ...). It names a quantization recipe, not one tensor type: a Q4_K_M file
// holds Q4_K, Q6_K and often Q8_0 or F16 tensors, so it is the honest short name for a model.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "gguf/gguf.h"
#include "quant/types.h"

namespace baton::gguf {

// The name without the MOSTLY_ prefix ("Q4_K_M", "F16", "F32" for ALL_F32); nullptr for a value
// the enumeration does not have (or no longer has).
const char* file_type_name(uint32_t file_type);

// The file type of a file whose 2-D weights are all `t` (K-quants map to their uniform "_S"
// recipe, Q4_K -> Q4_K_S); nullopt for a type no file type stands for.
std::optional<uint32_t> file_type_for(GgmlType t);

// What to call a model's weights in a table: general.file_type's name when the file has a known
// one, else the tensor type most 2-D layer weights (blk.*) have, else that of any 2-D tensor;
// "?" for a file without 2-D tensors.
std::string weight_type_label(const File& f);

}  // namespace baton::gguf
