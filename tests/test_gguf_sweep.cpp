// Corruption sweep: a small valid GGUF file cut at every byte offset, and with single bytes replaced
// throughout its header, metadata and tensor infos. Every variant must either parse into a file whose
// tensor views lie inside the buffer, or throw baton::Error: never crash, hang, or throw anything else.
// Run under ASan+UBSan by scripts/test.sh; each variant is its own exactly-sized heap buffer so an
// out-of-bounds read is caught.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "gguf/gguf.h"
#include "tests/helpers.h"

using namespace baton;
using namespace baton::gguf;

namespace {

std::vector<uint8_t> sample_file() {
  Writer w;
  w.set("general.architecture", Value::of_str("llama"));
  w.set("general.name", Value::of_str("sweep"));
  w.set("llama.block_count", Value::of_u32(3));
  w.set("llama.rope.freq_base", Value::of_f32(10000.0f));
  w.set("tokenizer.ggml.add_bos_token", Value::of_bool(true));
  w.set("tokenizer.ggml.tokens", Value::of_strs({"<s>", "a", "", "bc"}));
  w.set("tokenizer.ggml.token_type", Value::of_i32s({3, 1, 1, 1}));
  Value seven;
  seven.type = ValueType::UINT16;
  seven.u = 7;
  w.set("nested", Value::of_array(ValueType::ARRAY, {Value::of_array(ValueType::UINT16, {seven}),
                                                     Value::of_array(ValueType::UINT16, {})}));
  w.set("general.alignment", Value::of_u32(32));
  std::vector<uint8_t> a(8 * 4, 1), b(2 * 18, 2), c(34, 3);
  w.add_tensor("token_embd.weight", GgmlType::F32, {8}, a.data(), a.size());
  w.add_tensor("blk.0.attn_q.weight", GgmlType::Q4_0, {32, 2}, b.data(), b.size());
  w.add_tensor("output.weight", GgmlType::Q8_0, {32}, c.data(), c.size());
  return w.to_bytes();
}

enum class Outcome { Parsed, Rejected };

// Parses a private, exactly-sized copy. Parsed files are checked for the invariants the rest of
// Baton relies on; any exception other than baton::Error fails the test.
Outcome try_parse(const std::vector<uint8_t>& bytes) {
  std::unique_ptr<uint8_t[]> own(new uint8_t[std::max<size_t>(bytes.size(), 1)]);
  const uint8_t* buf = own.get();
  if (!bytes.empty()) std::memcpy(own.get(), bytes.data(), bytes.size());  // data() may be null
  std::unique_ptr<File> f;
  try {
    f = File::parse(buf, bytes.size(), "sweep");
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Model || std::string(e.what()).find("invalid GGUF") == std::string::npos)
      FAIL("unexpected error: " << e.what());
    return Outcome::Rejected;
  } catch (const std::exception& e) {
    FAIL("non-baton exception: " << e.what());
  }
  REQUIRE(f->data_offset() % f->alignment() == 0);
  for (const TensorInfo& t : f->tensors()) {
    REQUIRE(t.n_dims >= 1);
    REQUIRE(t.n_dims <= 4);
    REQUIRE(t.nbytes == row_bytes(t.type, t.ne[0]) * uint64_t(t.nrows()));
    REQUIRE(t.data >= buf + f->data_offset());
    REQUIRE(t.data + t.nbytes <= buf + bytes.size());
  }
  for (const auto& [key, value] : f->metadata()) REQUIRE(f->find(key) == &value);
  return Outcome::Parsed;
}

}  // namespace

TEST_CASE("gguf sweep: a file cut short anywhere is rejected", "[gguf][sweep]") {
  const auto good = sample_file();
  REQUIRE(try_parse(good) == Outcome::Parsed);  // the last tensor ends exactly at the end of the file
  for (size_t n = 0; n < good.size(); n++) {
    INFO("truncated to " << n << " of " << good.size() << " bytes");
    REQUIRE(try_parse(std::vector<uint8_t>(good.begin(), good.begin() + std::ptrdiff_t(n))) == Outcome::Rejected);
  }
}

TEST_CASE("gguf sweep: single bytes replaced in the header, metadata and tensor infos", "[gguf][sweep]") {
  const auto good = sample_file();
  const size_t data_offset = File::parse(good.data(), good.size())->data_offset();
  const auto t0 = std::chrono::steady_clock::now();
  size_t parsed = 0, rejected = 0;
  for (size_t at = 0; at < data_offset; at++) {
    const uint8_t orig = good[at];
    // 0x00 and 0xFF, then every single-bit flip.
    uint8_t values[10] = {0x00, 0xFF};
    for (int bit = 0; bit < 8; bit++) values[2 + bit] = uint8_t(orig ^ (1u << bit));
    for (uint8_t v : values) {
      if (v == orig) continue;
      auto b = good;
      b[at] = v;
      INFO("byte " << at << " changed from " << int(orig) << " to " << int(v));
      (try_parse(b) == Outcome::Parsed ? parsed : rejected)++;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Both outcomes occur: changed string bytes still parse, changed lengths and types do not.
  CHECK(parsed > 0);
  CHECK(rejected > parsed);
  WARN("byte sweep: " << parsed + rejected << " variants of " << good.size() << " bytes, " << parsed
                      << " parsed, " << rejected << " rejected, " << secs << " s");
}

TEST_CASE("gguf sweep: tensor data is never interpreted", "[gguf][sweep]") {
  const auto good = sample_file();
  auto ref = File::parse(good.data(), good.size());
  for (size_t at = ref->data_offset(); at < good.size(); at++) {
    auto b = good;
    b[at] ^= 0xFF;
    REQUIRE(try_parse(b) == Outcome::Parsed);
  }
}
