// general.file_type names and the weight-type label `baton bench` prints: the file type wins when
// the file has one, else the type most layer weights have (counted, so a huge embedding in
// another type does not decide it).
#include <string>
#include <vector>

#include "gguf/file_type.h"
#include "gguf/gguf.h"
#include "helpers.h"

using namespace baton;
using namespace baton::gguf;

namespace {

struct T {
  std::string name;
  GgmlType type;
  std::vector<int64_t> dims;
};

// A file with the given tensors (zero bytes) and, when set, a general.file_type value.
std::vector<uint8_t> file_bytes(const std::vector<T>& tensors, const Value* file_type) {
  Writer w;
  w.set("general.architecture", Value::of_str("test"));
  if (file_type) w.set("general.file_type", *file_type);
  for (const T& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.dims) n *= d;
    const std::vector<uint8_t> zeros(row_bytes(t.type, n));
    w.add_tensor(t.name, t.type, t.dims, zeros.data(), zeros.size());
  }
  return w.to_bytes();
}

std::string label(const std::vector<T>& tensors, const Value* file_type = nullptr) {
  const auto bytes = file_bytes(tensors, file_type);
  return weight_type_label(*File::parse(bytes.data(), bytes.size(), "test.gguf"));
}

// A Gemma-3-270M-like mix: the tied embedding (by far the most bytes) is Q8_0, most layer weights
// Q4_K, a few Q6_K, norms F32.
const std::vector<T> kQ4KM = {
    {"token_embd.weight", GgmlType::Q8_0, {256, 4096}},
    {"blk.0.attn_norm.weight", GgmlType::F32, {256}},
    {"blk.0.attn_q.weight", GgmlType::Q4_K, {256, 256}},
    {"blk.0.attn_k.weight", GgmlType::Q4_K, {256, 64}},
    {"blk.0.attn_v.weight", GgmlType::Q6_K, {256, 64}},
    {"blk.0.attn_output.weight", GgmlType::Q4_K, {256, 256}},
    {"blk.0.ffn_gate.weight", GgmlType::Q4_K, {256, 512}},
    {"blk.0.ffn_up.weight", GgmlType::Q4_K, {256, 512}},
    {"blk.0.ffn_down.weight", GgmlType::Q6_K, {512, 256}},
};

}  // namespace

TEST_CASE("file type names follow the GGUF enumeration") {
  CHECK(std::string(file_type_name(0)) == "F32");
  CHECK(std::string(file_type_name(1)) == "F16");
  CHECK(std::string(file_type_name(2)) == "Q4_0");
  CHECK(std::string(file_type_name(3)) == "Q4_1");
  CHECK(std::string(file_type_name(7)) == "Q8_0");
  CHECK(std::string(file_type_name(15)) == "Q4_K_M");
  CHECK(std::string(file_type_name(18)) == "Q6_K");
  CHECK(std::string(file_type_name(32)) == "BF16");
  for (uint32_t retired : {4u, 5u, 6u, 33u, 34u, 35u}) CHECK(file_type_name(retired) == nullptr);
  CHECK(file_type_name(1000) == nullptr);
}

TEST_CASE("every type synth writes has a file type whose name starts with the type's") {
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
                     GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K,
                     GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS,
                     GgmlType::MXFP4}) {
    INFO(type_name(t));
    const auto ft = file_type_for(t);
    REQUIRE(ft);
    const char* name = file_type_name(*ft);
    REQUIRE(name);
    CHECK(std::string(name).rfind(type_name(t), 0) == 0);
  }
  CHECK(file_type_for(GgmlType::Q8_K) == std::nullopt);  // never a file's main type
  CHECK(std::string(file_type_name(*file_type_for(GgmlType::Q4_K))) == "Q4_K_S");
}

TEST_CASE("the weight label is the file type when the file has one") {
  const Value q4km = Value::of_u32(15);
  CHECK(label(kQ4KM, &q4km) == "Q4_K_M");
  const Value q4km_signed = Value::of_i32(15);  // a writer that used int32 for it
  CHECK(label(kQ4KM, &q4km_signed) == "Q4_K_M");
  // The key names the recipe, whatever the tensors say.
  const Value q4_1 = Value::of_u32(3);
  CHECK(label(kQ4KM, &q4_1) == "Q4_1");
}

TEST_CASE("without a usable file type the label is the most common layer weight type") {
  CHECK(label(kQ4KM) == "Q4_K");  // not Q8_0, though the embedding holds the most bytes
  for (const Value& bad : {Value::of_u32(5), Value::of_u32(9999), Value::of_i32(-1), Value::of_str("Q4_0")}) {
    CHECK(label(kQ4KM, &bad) == "Q4_K");
  }
  // Equal counts: the type with more bytes.
  CHECK(label({{"blk.0.a.weight", GgmlType::Q8_0, {32, 2}}, {"blk.0.b.weight", GgmlType::F16, {32, 8}}}) == "F16");
  // No layer weights: any 2-D tensor; none at all: "?".
  CHECK(label({{"output.weight", GgmlType::Q6_K, {256, 4}}, {"output_norm.weight", GgmlType::F32, {256}}}) == "Q6_K");
  CHECK(label({{"blk.0.attn_norm.weight", GgmlType::F32, {64}}}) == "?");
}
