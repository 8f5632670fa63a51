// GGUF reader and writer: exact round trips, typed getters, the peer vocab files, rejected
// versions, the checks on hostile fields, and proof that parsing never touches tensor data.
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>

#include "gguf/gguf.h"
#include "tests/helpers.h"

using namespace baton;
using namespace baton::gguf;
using Catch::Matchers::Contains;
using namespace std::string_view_literals;

namespace {

Value scalar(ValueType t, uint64_t u, int64_t i = 0, double f = 0) {
  Value v;
  v.type = t;
  v.u = u;
  v.i = i;
  v.f = f;
  return v;
}
Value u8(uint8_t x) { return scalar(ValueType::UINT8, x); }
Value i8(int8_t x) { return scalar(ValueType::INT8, 0, x); }
Value u16(uint16_t x) { return scalar(ValueType::UINT16, x); }
Value i16(int16_t x) { return scalar(ValueType::INT16, 0, x); }
Value i64(int64_t x) { return scalar(ValueType::INT64, 0, x); }
Value f64(double x) { return scalar(ValueType::FLOAT64, 0, 0, x); }

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = uint8_t(rng());
  return b;
}

// Position of the first occurrence of `needle` in `hay` (the test fails when it is absent).
size_t find_bytes(const std::vector<uint8_t>& hay, std::string_view needle) {
  auto it = std::search(hay.begin(), hay.end(), needle.begin(), needle.end());
  REQUIRE(it != hay.end());
  return size_t(it - hay.begin());
}
template <class T> void poke(std::vector<uint8_t>& b, size_t at, T v) {
  REQUIRE(at + sizeof v <= b.size());
  std::memcpy(b.data() + at, &v, sizeof v);
}

std::unique_ptr<File> parse(const std::vector<uint8_t>& b) { return File::parse(b.data(), b.size(), "test.gguf"); }

// Every metadata value type, including extremes, empty strings/arrays and nested arrays.
std::vector<std::pair<std::string, Value>> all_value_kinds() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<std::string, Value>> kv = {
    {"t.uint8", u8(255)},
    {"t.int8", i8(-128)},
    {"t.uint16", u16(65535)},
    {"t.int16", i16(-32768)},
    {"t.uint32", Value::of_u32(4294967295u)},
    {"t.int32", Value::of_i32(std::numeric_limits<int32_t>::min())},
    {"t.float32", Value::of_f32(-1.5e-40f)},  // subnormal
    {"t.float32.inf", Value::of_f32(std::numeric_limits<float>::infinity())},
    {"t.bool.true", Value::of_bool(true)},
    {"t.bool.false", Value::of_bool(false)},
    {"t.string", Value::of_str(std::string("h\xc3\xa9llo, w\0rld"sv))},
    {"t.string.empty", Value::of_str("")},
    {"t.uint64", Value::of_u64(std::numeric_limits<uint64_t>::max())},
    {"t.int64", i64(std::numeric_limits<int64_t>::min())},
    {"t.float64", f64(3.141592653589793)},
    {"t.float64.nan", f64(nan)},
    {"a.uint8", Value::of_array(ValueType::UINT8, {u8(0), u8(1), u8(255)})},
    {"a.int8", Value::of_array(ValueType::INT8, {i8(-1), i8(127)})},
    {"a.uint16", Value::of_array(ValueType::UINT16, {u16(7)})},
    {"a.int16", Value::of_array(ValueType::INT16, {i16(-7), i16(300)})},
    {"a.uint32", Value::of_array(ValueType::UINT32, {Value::of_u32(1), Value::of_u32(0xdeadbeef)})},
    {"a.int32", Value::of_i32s({-3, 0, 2147483647})},
    {"a.float32", Value::of_f32s({0.5f, -0.0f, 1e30f})},
    {"a.bool", Value::of_array(ValueType::BOOL, {Value::of_bool(false), Value::of_bool(true)})},
    {"a.string", Value::of_strs({"", "a", "two words", std::string(300, 'x')})},
    {"a.uint64", Value::of_array(ValueType::UINT64, {Value::of_u64(1ull << 63)})},
    {"a.int64", Value::of_array(ValueType::INT64, {i64(-1), i64(1)})},
    {"a.float64", Value::of_array(ValueType::FLOAT64, {f64(-2.25), f64(1e300)})},
    {"a.empty", Value::of_array(ValueType::FLOAT32, {})},
    {"a.empty.string", Value::of_array(ValueType::STRING, {})},
    {"a.array.uint32", Value::of_array(ValueType::ARRAY, {
        Value::of_array(ValueType::UINT32, {Value::of_u32(1), Value::of_u32(2)}),
        Value::of_array(ValueType::UINT32, {}),
        Value::of_array(ValueType::INT8, {i8(-9)})})},
    {"a.array.string", Value::of_array(ValueType::ARRAY, {
        Value::of_strs({"x", ""}), Value::of_strs({})})},
    {"a.array.array", Value::of_array(ValueType::ARRAY, {
        Value::of_array(ValueType::ARRAY, {Value::of_array(ValueType::BOOL, {Value::of_bool(true)})})})},
  };
  return kv;
}

}  // namespace

TEST_CASE("gguf: arrays keep their elements by kind, and item() gives each back as the Value put in", "[gguf]") {
  for (const auto& [key, v] : all_value_kinds()) {
    if (v.type != ValueType::ARRAY) {
      CHECK(v.size() == 0);
      continue;
    }
    INFO(key);
    // Where the elements live: strings in one block of text, scalars at their stored width,
    // arrays as Values.
    CHECK(v.strs.size() == (v.elem == ValueType::STRING ? v.size() : 0));
    CHECK(v.arr.size() == (v.elem == ValueType::ARRAY ? v.size() : 0));
    CHECK(v.raw.size() == v.size() * scalar_width(v.elem));
    std::vector<Value> items;
    for (size_t k = 0; k < v.size(); ++k) {
      items.push_back(v.item(k));
      CHECK(items.back().type == v.elem);
    }
    CHECK(Value::of_array(v.elem, items) == v);
  }
  // The signed, unsigned and float fields each come back whole.
  const Value a = Value::of_array(ValueType::INT64, {i64(std::numeric_limits<int64_t>::min())});
  CHECK(a.item(0).i == std::numeric_limits<int64_t>::min());
  CHECK(Value::of_array(ValueType::UINT64, {Value::of_u64(~0ull)}).item(0).u == ~0ull);
  CHECK(Value::of_f32s({-1.5e-40f}).item(0).f == double(-1.5e-40f));
}

TEST_CASE("gguf: every metadata value type round-trips exactly (v2 and v3)", "[gguf]") {
  const auto kv = all_value_kinds();
  std::set<ValueType> kinds;
  for (const auto& [k, v] : kv) {
    kinds.insert(v.type);
    if (v.type == ValueType::ARRAY) kinds.insert(v.elem);
  }
  REQUIRE(kinds.size() == 13);  // all 13 GGUF value types are exercised

  for (uint32_t version : {2u, 3u}) {
    Writer w(version);
    for (const auto& [k, v] : kv) w.set(k, v);
    const std::vector<uint8_t> bytes = w.to_bytes();
    auto f = parse(bytes);
    CHECK(f->version() == version);
    CHECK(f->tensors().empty());
    CHECK(f->alignment() == 32);
    CHECK(f->data_offset() == bytes.size());
    CHECK(bytes.size() % 32 == 0);
    REQUIRE(f->metadata().size() == kv.size());
    for (size_t k = 0; k < kv.size(); k++) {
      INFO("key " << kv[k].first);
      CHECK(f->metadata()[k].first == kv[k].first);
      CHECK(f->metadata()[k].second == kv[k].second);
      REQUIRE(f->find(kv[k].first) != nullptr);
      CHECK(*f->find(kv[k].first) == kv[k].second);
    }
    CHECK(f->get<std::string>("t.string").size() == 13);  // the embedded NUL survives
    CHECK(std::isnan(f->get<double>("t.float64.nan")));

    // Writing to disk gives the same bytes, and File::open (mmap) reads the same metadata.
    const std::string path = test::temp_dir() + "/kv.gguf";
    w.write(path);
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(disk == bytes);
    auto g = File::open(path);
    CHECK(g->metadata() == f->metadata());
    CHECK(g->path() == path);
    std::filesystem::remove_all(std::filesystem::path(path).parent_path());
  }
}

TEST_CASE("gguf: Writer::set replaces a key in place", "[gguf]") {
  Writer w;
  w.set("a", Value::of_u32(1));
  w.set("b", Value::of_str("x"));
  w.set("a", Value::of_str("replaced"));
  auto bytes = w.to_bytes();
  auto f = parse(bytes);
  REQUIRE(f->metadata().size() == 2);
  CHECK(f->metadata()[0].first == "a");
  CHECK(f->get<std::string>("a") == "replaced");
}

TEST_CASE("gguf: tensors of several types round-trip with their alignment", "[gguf]") {
  struct Spec { const char* name; GgmlType type; std::vector<int64_t> dims; };
  const std::vector<Spec> specs = {
    {"f32.odd", GgmlType::F32, {7, 3}},          // 84 bytes: the next offset needs padding
    {"f16.vec", GgmlType::F16, {5}},
    {"q4_0.mat", GgmlType::Q4_0, {64, 2}},
    {"q4_k.3d", GgmlType::Q4_K, {256, 1, 2}},
    {"q8_0.4d", GgmlType::Q8_0, {32, 3, 2, 1}},
    {"bf16.tiny", GgmlType::BF16, {3}},
    {"q6_k.row", GgmlType::Q6_K, {256}},
    {"i32.ids", GgmlType::I32, {2, 2}},
  };
  uint32_t custom = GENERATE(0u, 1u, 32u, 64u, 256u);  // 0: no general.alignment key (default 32)
  const uint32_t align = custom ? custom : 32;
  INFO("alignment " << align);

  Writer w;
  w.set("general.architecture", Value::of_str("test"));
  if (custom) w.set("general.alignment", Value::of_u32(custom));
  std::vector<std::vector<uint8_t>> data;
  for (size_t k = 0; k < specs.size(); k++) {
    int64_t n = 1;
    for (int64_t d : specs[k].dims) n *= d;
    const auto& tt = traits(specs[k].type);
    data.push_back(random_bytes(size_t(n / tt.block_elems) * tt.block_bytes, uint32_t(k + 1)));
    if (k == 3)  // one tensor produced by a callback, as `baton synth` does
      w.add_tensor_lazy(specs[k].name, specs[k].type, specs[k].dims,
                        [bytes = data[k]](uint8_t* dst, size_t nbytes) { std::memcpy(dst, bytes.data(), nbytes); });
    else
      w.add_tensor(specs[k].name, specs[k].type, specs[k].dims, data[k].data(), data[k].size());
  }
  const std::vector<uint8_t> bytes = w.to_bytes();

  auto check = [&](const File& f) {
    CHECK(f.alignment() == align);
    CHECK(f.data_offset() % align == 0);
    REQUIRE(f.tensors().size() == specs.size());
    uint64_t prev_end = 0;
    for (size_t k = 0; k < specs.size(); k++) {
      const TensorInfo& t = f.tensors()[k];
      INFO("tensor " << specs[k].name);
      CHECK(t.name == specs[k].name);
      CHECK(t.type == specs[k].type);
      REQUIRE(t.n_dims == specs[k].dims.size());
      for (uint32_t d = 0; d < 4; d++) CHECK(t.ne[d] == (d < t.n_dims ? specs[k].dims[d] : 1));
      CHECK(t.nbytes == data[k].size());
      CHECK(t.offset % align == 0);
      CHECK(t.offset >= prev_end);
      prev_end = t.offset + t.nbytes;
      CHECK(t.data == f.base() + f.data_offset() + t.offset);  // a view, not a copy
      CHECK(std::memcmp(t.data, data[k].data(), data[k].size()) == 0);
      CHECK(&f.require_tensor(specs[k].name) == &t);
    }
    CHECK(f.data_offset() + prev_end == f.file_size());
    CHECK(f.tensor("absent") == nullptr);
    CHECK_THROWS_WITH(f.require_tensor("absent"), Contains("missing tensor 'absent'"));
  };
  check(*parse(bytes));
  CHECK(parse(bytes)->tensors()[0].shape_str() == "[7, 3]");

  const std::string dir = test::temp_dir();
  w.write(dir + "/t.gguf");
  auto f = File::open(dir + "/t.gguf");
  check(*f);
  CHECK(f->file_size() == bytes.size());
  CHECK(std::memcmp(f->base(), bytes.data(), bytes.size()) == 0);
  std::filesystem::remove_all(dir);
}

namespace {
// Runs `fn`, which must throw baton::Error of kind Model; returns its message.
template <class Fn> std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::Model);
    return e.what();
  }
  FAIL("no baton::Error was thrown");
  return {};
}
}  // namespace

TEST_CASE("gguf: typed getters convert when exact and name the key otherwise", "[gguf]") {
  Writer w;
  w.set("general.architecture", Value::of_str("llama"));
  w.set("llama.block_count", Value::of_u32(30));
  w.set("u8", u8(200));
  w.set("i8", i8(-5));
  w.set("u64.max", Value::of_u64(std::numeric_limits<uint64_t>::max()));
  w.set("i32.neg", Value::of_i32(-1));
  w.set("i64.min", i64(std::numeric_limits<int64_t>::min()));
  w.set("f32", Value::of_f32(0.25f));
  w.set("f64", f64(-1e300));
  w.set("s", Value::of_str("text"));
  w.set("b", Value::of_bool(true));
  w.set("arr.s", Value::of_strs({"a", "b"}));
  w.set("arr.f", Value::of_f32s({1.5f, -2}));
  w.set("arr.i", Value::of_i32s({-7, 9}));
  w.set("arr.b", Value::of_array(ValueType::BOOL, {Value::of_bool(true), Value::of_bool(false)}));
  w.set("arr.u64", Value::of_array(ValueType::UINT64, {Value::of_u64(~0ull)}));
  auto bytes = w.to_bytes();
  auto f = parse(bytes);

  CHECK(f->get<uint32_t>("u8") == 200);
  CHECK(f->get<int32_t>("i8") == -5);
  CHECK(f->get<int64_t>("i8") == -5);
  CHECK(f->get<uint64_t>("u64.max") == std::numeric_limits<uint64_t>::max());
  CHECK(f->get<int64_t>("i64.min") == std::numeric_limits<int64_t>::min());
  CHECK(f->get<float>("f32") == 0.25f);
  CHECK(f->get<double>("f64") == -1e300);
  CHECK(f->get<float>("u8") == 200.0f);
  CHECK(f->get<std::string>("s") == "text");
  CHECK(f->get<bool>("b"));
  CHECK(f->get_strings("arr.s").to_vector() == std::vector<std::string>{"a", "b"});
  CHECK(f->get_floats("arr.f") == std::vector<float>{1.5f, -2});
  CHECK(f->get_ints("arr.i") == std::vector<int64_t>{-7, 9});
  CHECK(f->get_ints("arr.b") == std::vector<int64_t>{1, 0});
  CHECK(f->get_or<uint32_t>("absent", 7) == 7);
  CHECK(f->get_or<uint32_t>("u8", 7) == 200);
  CHECK(f->architecture() == "llama");
  CHECK(f->arch_key("block_count") == "llama.block_count");
  CHECK(f->get<uint32_t>(f->arch_key("block_count")) == 30);

  // Missing key.
  std::string m = error_of([&] { f->get<uint32_t>("no.such.key"); });
  CHECK_THAT(m, Contains("missing metadata key 'no.such.key'") && Contains("test.gguf"));
  CHECK_THAT(error_of([&] { f->get_strings("nope"); }), Contains("'nope'"));
  // Wrong type: the key, what was found and what was wanted.
  CHECK_THAT(error_of([&] { f->get<uint32_t>("s"); }), Contains("'s'") && Contains("string") && Contains("integer"));
  CHECK_THAT(error_of([&] { f->get<bool>("u8"); }), Contains("'u8'") && Contains("uint8") && Contains("bool"));
  CHECK_THAT(error_of([&] { f->get<std::string>("b"); }), Contains("'b'") && Contains("bool"));
  CHECK_THAT(error_of([&] { f->get<float>("s"); }), Contains("'s'") && Contains("number"));
  CHECK_THAT(error_of([&] { f->get<uint32_t>("b"); }), Contains("'b'") && Contains("integer"));
  CHECK_THAT(error_of([&] { f->get<int32_t>("f32"); }), Contains("'f32'") && Contains("float32"));
  CHECK_THAT(error_of([&] { f->get_strings("arr.f"); }), Contains("'arr.f'") && Contains("array of strings"));
  CHECK_THAT(error_of([&] { f->get_floats("arr.s"); }), Contains("'arr.s'") && Contains("array of floats"));
  CHECK_THAT(error_of([&] { f->get_ints("arr.s"); }), Contains("'arr.s'") && Contains("array of integers"));
  CHECK_THAT(error_of([&] { f->get_ints("s"); }), Contains("'s'"));
  CHECK_THAT(error_of([&] { f->get_or<uint32_t>("s", 1); }), Contains("'s'"));
  // Integers that do not fit the requested width.
  CHECK_THAT(error_of([&] { f->get<uint32_t>("u64.max"); }), Contains("'u64.max'") && Contains("out of range"));
  CHECK_THAT(error_of([&] { f->get<int64_t>("u64.max"); }), Contains("'u64.max'") && Contains("out of range"));
  CHECK_THAT(error_of([&] { f->get<int32_t>("i64.min"); }), Contains("'i64.min'") && Contains("out of range"));
  CHECK_THAT(error_of([&] { f->get<uint32_t>("i32.neg"); }), Contains("'i32.neg'") && Contains("negative"));
  CHECK_THAT(error_of([&] { f->get<uint64_t>("i8"); }), Contains("'i8'") && Contains("negative"));
  CHECK_THAT(error_of([&] { f->get_ints("arr.u64"); }), Contains("'arr.u64'") && Contains("out of range"));
}

TEST_CASE("gguf: the peer vocab files parse with the token counts their metadata gives", "[gguf]") {
  // Counts and fields checked by hand against the `gguf` Python package (GGUFReader) on these files.
  struct Vocab { const char* file; const char* arch; const char* model; const char* pre; size_t n_tokens; size_t n_merges; };
  const Vocab vocabs[] = {
    {"ggml-vocab-llama-spm.gguf", "llama", "llama", "default", 32000, 0},
    {"ggml-vocab-gpt-2.gguf", "gpt2", "gpt2", "gpt-2", 50257, 50000},
    {"ggml-vocab-falcon.gguf", "falcon", "gpt2", "falcon", 65024, 64784},
    {"ggml-vocab-starcoder.gguf", "starcoder2", "gpt2", "starcoder", 49152, 48872},
  };
  for (const Vocab& v : vocabs) {
    INFO(v.file);
    auto f = File::open(test::peer(std::string("tokenizer/") + v.file));
    CHECK(f->version() == 3);
    CHECK(f->tensors().empty());
    CHECK(f->architecture() == v.arch);
    CHECK(f->get<std::string>("tokenizer.ggml.model") == v.model);
    CHECK(f->get<std::string>("tokenizer.ggml.pre") == v.pre);
    const auto& tokens = f->get_strings("tokenizer.ggml.tokens");
    CHECK(tokens.size() == v.n_tokens);
    // Every per-token array the file has agrees with the token list, and so does vocab_size.
    CHECK(f->get_ints("tokenizer.ggml.token_type").size() == tokens.size());
    if (f->has("tokenizer.ggml.scores")) CHECK(f->get_floats("tokenizer.ggml.scores").size() == tokens.size());
    if (f->has(f->arch_key("vocab_size"))) CHECK(f->get<uint64_t>(f->arch_key("vocab_size")) == tokens.size());
    CHECK(f->get_or<uint32_t>("tokenizer.ggml.bos_token_id", 0) < tokens.size());
    CHECK(f->get_or<uint32_t>("tokenizer.ggml.eos_token_id", 0) < tokens.size());
    if (v.n_merges) CHECK(f->get_strings("tokenizer.ggml.merges").size() == v.n_merges);
    else CHECK_FALSE(f->has("tokenizer.ggml.merges"));
  }
  // llama-spm is the one file that states vocab_size explicitly.
  CHECK(File::open(test::peer("tokenizer/ggml-vocab-llama-spm.gguf"))->get<uint32_t>("llama.vocab_size") == 32000);
}

namespace {

// A small valid file whose fields the hostile-input cases below overwrite one at a time.
std::vector<uint8_t> small_file() {
  Writer w;
  w.set("general.architecture", Value::of_str("llama"));
  w.set("flag", Value::of_bool(true));
  w.set("text", Value::of_str("hello"));
  w.set("list", Value::of_array(ValueType::UINT32, {Value::of_u32(1), Value::of_u32(2)}));
  w.set("general.alignment", Value::of_u32(32));
  const std::vector<float> w1(16, 1.0f);
  w.add_tensor("w1", GgmlType::F32, {16}, w1.data(), 64);
  const std::vector<uint8_t> w2(2 * 18, 0);
  w.add_tensor("w2", GgmlType::Q4_0, {32, 2}, w2.data(), w2.size());
  return w.to_bytes();
}

// Offset of the length field of the GGUF string `s` (u64 length followed by the bytes).
size_t string_at(const std::vector<uint8_t>& b, const std::string& s) {
  std::string needle(8, '\0');
  const uint64_t n = s.size();
  std::memcpy(needle.data(), &n, 8);
  return find_bytes(b, needle + s);
}

}  // namespace

TEST_CASE("gguf: v1 and big-endian files are rejected with messages that say so", "[gguf]") {
  auto b = small_file();
  auto v1 = b;
  poke<uint32_t>(v1, 4, 1);
  CHECK_THAT(error_of([&] { parse(v1); }), Contains("version 1 is not supported") && Contains("byte offset 4"));

  // A big-endian writer keeps the magic bytes and stores the version (and all else) byte-swapped.
  auto be = b;
  poke<uint32_t>(be, 4, __builtin_bswap32(3));
  poke<uint64_t>(be, 8, __builtin_bswap64(2));
  CHECK_THAT(error_of([&] { parse(be); }), Contains("big-endian"));
  auto be2 = b;
  poke<uint32_t>(be2, 4, __builtin_bswap32(2));
  CHECK_THAT(error_of([&] { parse(be2); }), Contains("big-endian"));
  auto swapped_magic = b;
  std::memcpy(swapped_magic.data(), "FUGG", 4);
  CHECK_THAT(error_of([&] { parse(swapped_magic); }), Contains("big-endian"));

  auto v4 = b;
  poke<uint32_t>(v4, 4, 4);
  CHECK_THAT(error_of([&] { parse(v4); }), Contains("unsupported GGUF version 4"));
}

TEST_CASE("gguf: hostile fields are rejected naming the field and the byte offset", "[gguf]") {
  const auto good = small_file();
  REQUIRE_NOTHROW(parse(good));
  const size_t flag = string_at(good, "flag"), list = string_at(good, "list"), text = string_at(good, "text");
  const size_t align = string_at(good, "general.alignment");
  const size_t w1 = string_at(good, "w1"), w2 = string_at(good, "w2");
  // Inside a tensor info: name (8 + 2 bytes), n_dims (4), dims (8 each), type (4), offset (8).
  const size_t w1_dims = w1 + 14, w2_dims = w2 + 14;
  const size_t w1_type = w1_dims + 8, w2_type = w2_dims + 16, w2_off = w2_type + 4;

  struct Case { const char* what; std::function<size_t(std::vector<uint8_t>&)> mutate; const char* says; };
  const Case cases[] = {
    {"magic", [](auto& b) { b[0] = 'X'; return 0; }, "not a GGUF file"},
    {"too short", [](auto& b) { b.resize(3); return 0; }, "too short"},
    {"tensor count", [](auto& b) { poke<uint64_t>(b, 8, 1ull << 40); return 8; }, "tensor count"},
    {"metadata count", [](auto& b) { poke<uint64_t>(b, 16, 1ull << 40); return 16; }, "metadata count"},
    {"key length", [](auto& b) { poke<uint64_t>(b, 24, 1ull << 40); return 24; }, "metadata key has length"},
    {"empty key", [&](auto& b) { poke<uint64_t>(b, flag, 0); return flag; }, "empty metadata key"},
    {"value type", [&](auto& b) { poke<uint32_t>(b, flag + 12, 99); return flag + 12; }, "metadata 'flag': unknown value type 99"},
    {"bool value", [&](auto& b) { b[flag + 16] = 2; return flag + 16; }, "metadata 'flag': bool value is 2"},
    {"string length", [&](auto& b) { poke<uint64_t>(b, text + 16, 1000000); return text + 16; }, "metadata 'text': string value of length 1000000 runs past the end"},
    {"array element type", [&](auto& b) { poke<uint32_t>(b, list + 16, 13); return list + 16; }, "metadata 'list': array has unknown element type 13"},
    {"array length", [&](auto& b) { poke<uint64_t>(b, list + 20, 1ull << 60); return list + 20; }, "claims"},
    {"duplicate key", [&](auto& b) { std::memcpy(&b[text + 8], "flag", 4); return text; }, "metadata 'flag': duplicate metadata key"},
    {"alignment type", [&](auto& b) { poke<uint32_t>(b, align + 25, 5); return align + 29; }, "metadata 'general.alignment': must be uint32, found int32"},
    {"alignment value", [&](auto& b) { poke<uint32_t>(b, align + 29, 48); return align + 29; }, "not a power of two"},
    {"empty tensor name", [&](auto& b) { poke<uint64_t>(b, w1, 0); return w1; }, "empty tensor name"},
    {"n_dims", [&](auto& b) { poke<uint32_t>(b, w1 + 10, 5); return w1 + 10; }, "tensor 'w1': n_dims is 5"},
    {"zero dimension", [&](auto& b) { poke<uint64_t>(b, w1_dims, 0); return w1_dims; }, "tensor 'w1': dimension 0 is 0"},
    {"element count overflow", [&](auto& b) {
       poke<uint64_t>(b, w2_dims, 1ull << 40); poke<uint64_t>(b, w2_dims + 8, 1ull << 40); return w2_dims + 8; },
     "element count overflows"},
    {"type id", [&](auto& b) { poke<uint32_t>(b, w1_type, 1000); return w1_type; }, "tensor 'w1': unknown type id 1000"},
    {"block multiple", [&](auto& b) { poke<uint64_t>(b, w2_dims, 33); return w2_type; }, "not a multiple of the block size 32"},
    {"misaligned offset", [&](auto& b) { poke<uint64_t>(b, w2_off, 72); return w2_off; }, "not a multiple of the alignment 32"},
    {"data past the end", [&](auto& b) { poke<uint64_t>(b, w2_off, 4096); return w2; }, "past the end of the file"},
    {"data cut short", [&](auto& b) { b.pop_back(); return w2; }, "past the end of the file"},
    {"overlap", [&](auto& b) { poke<uint64_t>(b, w2_off, 32); return w2; }, "tensor 'w2' overlaps tensor 'w1'"},
    {"duplicate tensor", [&](auto& b) { std::memcpy(&b[w2 + 8], "w1", 2); return w2; }, "tensor 'w1': duplicate tensor name"},
  };
  for (const Case& c : cases) {
    INFO("case: " << c.what);
    auto b = good;
    const size_t at = c.mutate(b);
    const std::string msg = error_of([&] { parse(b); });
    CHECK_THAT(msg, Contains(c.says) && Contains(fmt::format("byte offset {})", at)) && Contains("test.gguf"));
  }
}

TEST_CASE("gguf: a bool array element other than 0 or 1 is rejected at its byte", "[gguf]") {
  Writer w;
  w.set("flags", Value::of_array(ValueType::BOOL, {Value::of_bool(false), Value::of_bool(true), Value::of_bool(true)}));
  auto b = w.to_bytes();
  REQUIRE_NOTHROW(parse(b));
  const size_t third = string_at(b, "flags") + 8 + 5 + 4 + 4 + 8 + 2;  // key, types, count, 2 elements
  REQUIRE(b[third] == 1);
  b[third] = 7;
  CHECK_THAT(error_of([&] { parse(b); }),
             Contains("metadata 'flags': bool value is 7") && Contains(fmt::format("byte offset {})", third)));
}

TEST_CASE("gguf: a string list keeps empty, repeated and NUL-holding texts in order", "[gguf]") {
  const std::vector<std::string> texts = {"", "a", std::string("x\0y", 3), "a", "", std::string(300, 'z')};
  const StringList l(texts);
  REQUIRE(l.size() == texts.size());
  CHECK(l.bytes() == 1 + 3 + 1 + 300);
  for (size_t i = 0; i < texts.size(); ++i) CHECK(l[i] == texts[i]);
  CHECK(l.to_vector() == texts);
  StringList m;
  CHECK(m.empty());
  for (std::string_view s : l) m.push_back(s);
  CHECK(m == l);
  m.push_back("");
  CHECK_FALSE(m == l);  // one more (empty) text is a different list
  CHECK(StringList{"ab", "c"} != StringList{"a", "bc"});  // same bytes, other ends
}

TEST_CASE("gguf: arrays nested deeper than four levels are rejected", "[gguf]") {
  Value v = Value::of_array(ValueType::UINT8, {u8(1)});
  for (int depth = 1; depth <= 4; depth++) {
    Writer w;
    w.set("nested", v);
    auto ok = w.to_bytes();
    CHECK_NOTHROW(parse(ok));
    v = Value::of_array(ValueType::ARRAY, {v});
  }
  Writer w;
  w.set("nested", v);  // five levels
  auto bytes = w.to_bytes();
  CHECK_THAT(error_of([&] { parse(bytes); }), Contains("metadata 'nested': arrays nest deeper than 4"));
}

TEST_CASE("gguf: the number of metadata values is capped before memory is reserved", "[gguf]") {
  // One uint8 array of 2^24 + 1 elements: a valid layout, but past the 2^24-value limit that keeps
  // a hostile file from asking for ~100 bytes of memory per byte of file.
  Writer w;
  w.set("big", Value::of_array(ValueType::UINT8, {u8(0)}));
  std::vector<uint8_t> b = w.to_bytes();
  const size_t count_at = string_at(b, "big") + 8 + 3 + 4 + 4;  // key, value type, element type
  const uint64_t n = (1ull << 24) + 1;
  poke<uint64_t>(b, count_at, n);
  b.resize(count_at + 8 + n, 0);
  CHECK_THAT(error_of([&] { parse(b); }), Contains("metadata 'big': array of 16777217 elements passes the limit")
                                              && Contains(fmt::format("byte offset {})", count_at)));
  b.resize(b.size() - 2);  // one element short: the byte count is what fails first
  CHECK_THAT(error_of([&] { parse(b); }), Contains("claims 16777217 uint8 elements"));
}

TEST_CASE("gguf: parsing touches no tensor data", "[gguf]") {
  // The data section starts on a page boundary (general.alignment = page size), so the pages after
  // the header can be made inaccessible: any read of tensor data while parsing would fault.
  const long page = sysconf(_SC_PAGESIZE);
  REQUIRE(page > 0);
  Writer w;
  w.set("general.architecture", Value::of_str("llama"));
  w.set("general.alignment", Value::of_u32(uint32_t(page)));
  w.set("tokens", Value::of_strs({"a", "b", "c"}));
  std::vector<std::vector<uint8_t>> data;
  for (int k = 0; k < 3; k++) {
    data.push_back(random_bytes(size_t(page) * 2 + 100, uint32_t(k + 11)));
    w.add_tensor(fmt::format("t{}", k), GgmlType::I8, {int64_t(data[k].size())}, data[k].data(), data[k].size());
  }
  const std::vector<uint8_t> bytes = w.to_bytes();
  const size_t map_size = (bytes.size() + size_t(page) - 1) / size_t(page) * size_t(page);
  void* m = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  auto* base = static_cast<uint8_t*>(m);
  std::memcpy(base, bytes.data(), bytes.size());
  const size_t data_offset = parse(bytes)->data_offset();
  REQUIRE(data_offset % size_t(page) == 0);
  REQUIRE(data_offset < bytes.size());
  REQUIRE(mprotect(base, map_size, PROT_READ) == 0);
  REQUIRE(mprotect(base + data_offset, map_size - data_offset, PROT_NONE) == 0);

  auto f = File::parse(base, bytes.size(), "protected");  // would SIGSEGV on any read of the data
  REQUIRE(f->tensors().size() == 3);
  CHECK(f->get_strings("tokens").size() == 3);

  REQUIRE(mprotect(base + data_offset, map_size - data_offset, PROT_READ) == 0);
  for (int k = 0; k < 3; k++) {
    const TensorInfo& t = f->tensors()[size_t(k)];
    CHECK(t.data == base + data_offset + t.offset);
    CHECK(std::memcmp(t.data, data[size_t(k)].data(), data[size_t(k)].size()) == 0);
  }
  munmap(m, map_size);
}

namespace {

// The fuzz seeds (tests/fuzz/corpus/): tiny valid files covering each part of the format.
std::vector<std::pair<std::string, std::vector<uint8_t>>> fuzz_seeds() {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> seeds;
  seeds.emplace_back("empty", Writer().to_bytes());
  {
    Writer w;
    for (auto& [k, v] : all_value_kinds())
      if (k != "a.string") w.set(k, v);  // (its 300-byte string would only make the seed larger)
    seeds.emplace_back("kv-all-types", w.to_bytes());
  }
  {
    Writer w;
    w.set("general.architecture", Value::of_str("llama"));
    w.set("llama.block_count", Value::of_u32(1));
    const auto a = random_bytes(16, 1), b = random_bytes(18, 2), c = random_bytes(144, 3);
    w.add_tensor("a.weight", GgmlType::F32, {2, 2}, a.data(), a.size());
    w.add_tensor("b.weight", GgmlType::Q4_0, {32}, b.data(), b.size());
    w.add_tensor("c.weight", GgmlType::Q4_K, {256}, c.data(), c.size());
    seeds.emplace_back("three-tensors", w.to_bytes());
  }
  {
    Writer w(2);
    w.set("general.alignment", Value::of_u32(64));
    w.set("general.name", Value::of_str("v2"));
    const auto a = random_bytes(8, 4), b = random_bytes(34 * 2, 5);
    w.add_tensor("x", GgmlType::F16, {2, 1, 1, 2}, a.data(), a.size());
    w.add_tensor("y", GgmlType::Q8_0, {32, 2}, b.data(), b.size());
    seeds.emplace_back("v2-align64", w.to_bytes());
  }
  {
    Writer w;
    w.set("general.architecture", Value::of_str("gpt2"));
    w.set("tokenizer.ggml.model", Value::of_str("gpt2"));
    w.set("tokenizer.ggml.tokens", Value::of_strs({"a", "b", "ab", "<s>"}));
    w.set("tokenizer.ggml.scores", Value::of_f32s({0, -1, -2, 0}));
    w.set("tokenizer.ggml.token_type", Value::of_i32s({1, 1, 1, 3}));
    w.set("tokenizer.ggml.merges", Value::of_strs({"a b"}));
    w.set("tokenizer.ggml.bos_token_id", Value::of_u32(3));
    seeds.emplace_back("vocab", w.to_bytes());
  }
  return seeds;
}

}  // namespace

// BATON_WRITE_SEEDS=1 rewrites tests/fuzz/corpus/ from fuzz_seeds() (after a format change).
TEST_CASE("gguf: the fuzz seed corpus is what the writer produces, and it parses", "[gguf]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(BATON_SOURCE_DIR) / "tests/fuzz/corpus";
  const char* write = std::getenv("BATON_WRITE_SEEDS");
  for (const auto& [name, bytes] : fuzz_seeds()) {
    INFO("seed " << name);
    CHECK(bytes.size() <= 2048);  // seeds stay small
    CHECK_NOTHROW(parse(bytes));
    if (write && std::string(write) == "1") {
      fs::create_directories(dir);
      std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    }
    std::ifstream in(dir / name, std::ios::binary);
    REQUIRE(in.good());
    std::vector<uint8_t> disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(disk == bytes);
  }
}

TEST_CASE("gguf: a failed write leaves the old file or none, never a partial one", "[gguf]") {
  namespace fs = std::filesystem;
  const std::string dir = test::temp_dir(), path = dir + "/m.gguf";
  Writer good;
  good.set("k", Value::of_u32(7));
  std::vector<float> w(64, 0.5f);
  good.add_tensor("w", GgmlType::F32, {64}, w.data(), w.size() * 4);
  good.write(path);
  CHECK(fs::file_size(path) == good.file_size());
  // A writer whose second tensor fails half way (a fill that throws, as an interrupt or a full
  // disk ends it): the file already there stays as it was, and no temporary file is left.
  Writer bad;
  bad.set("k", Value::of_u32(8));
  bad.add_tensor_lazy("a", GgmlType::F32, {1024}, [](uint8_t* p, size_t n) { std::memset(p, 1, n); });
  bad.add_tensor_lazy("b", GgmlType::F32, {1024}, [](uint8_t*, size_t) { throw std::runtime_error("disk full"); });
  CHECK_THROWS_WITH(bad.write(path), "disk full");
  CHECK(File::open(path)->get<uint32_t>("k") == 7);
  CHECK_THROWS(bad.write(dir + "/new.gguf"));
  CHECK_FALSE(fs::exists(dir + "/new.gguf"));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 1);
  // Through a symbolic link the file it names is replaced, and the link stays a link.
  fs::create_symlink(path, dir + "/link.gguf");
  Writer again;
  again.set("k", Value::of_u32(9));
  again.write(dir + "/link.gguf");
  CHECK(fs::is_symlink(dir + "/link.gguf"));
  CHECK(File::open(path)->get<uint32_t>("k") == 9);
  // A shape no reader accepts is refused when the tensor is added, naming it.
  Writer huge;
  CHECK_THAT(test::usage_error([&] { huge.add_tensor_lazy("too.big", GgmlType::F32, {int64_t(1) << 30, int64_t(1) << 21}, {}); }),
             Contains("'too.big'") && Contains("2^50"));
}

namespace {

// Root passes every permission check (CAP_DAC_OVERRIDE). For a check of what a directory's mode
// forbids, this thread gives that up until the end of the scope (it stays in the permitted set,
// so it can be taken back); as any other user this does nothing.
struct ModesApply {
  __user_cap_header_struct head{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct saved[2]{};
  bool dropped = false;
  ModesApply() {
    if (::geteuid() != 0 || ::syscall(SYS_capget, &head, saved) != 0) return;
    __user_cap_data_struct less[2] = {saved[0], saved[1]};
    less[0].effective &= ~((1u << CAP_DAC_OVERRIDE) | (1u << CAP_DAC_READ_SEARCH));
    dropped = ::syscall(SYS_capset, &head, less) == 0;
  }
  ~ModesApply() {
    if (dropped) ::syscall(SYS_capset, &head, saved);
  }
  bool ok() const { return ::geteuid() != 0 || dropped; }
};

}  // namespace

TEST_CASE("gguf: in a directory where no file can be made, a writable file is written in place", "[gguf]") {
  namespace fs = std::filesystem;
  const std::string dir = test::temp_dir() + "/ro", path = dir + "/m.gguf", locked = dir + "/locked.gguf";
  fs::create_directory(dir);
  std::vector<float> w(64, 0.5f);
  auto model = [&](uint32_t k) {
    Writer m;
    m.set("k", Value::of_u32(k));
    m.add_tensor("w", GgmlType::F32, {64}, w.data(), w.size() * 4);
    return m;
  };
  model(7).write(path);
  model(7).write(locked);
  ::chmod(locked.c_str(), 0444);
  ::chmod(dir.c_str(), 0555);
  struct Restore {  // so that the directory can be removed, whatever the checks say
    std::string dir;
    ~Restore() { ::chmod(dir.c_str(), 0755); }
  } restore{dir};
  {
    ModesApply as_user;
    if (!as_user.ok()) {
      WARN("running as root and cannot drop CAP_DAC_OVERRIDE: the directory's mode would not apply");
      return;
    }
    model(8).write(path);  // the temporary file cannot be made: the file is written in place
    CHECK_THROWS_WITH(model(9).write(locked), Contains("cannot write '" + locked + "': Permission denied"));
    CHECK_THROWS_WITH(model(9).write(dir + "/new.gguf"), Contains("cannot create"));
  }
  CHECK(File::open(path)->get<uint32_t>("k") == 8);
  CHECK(fs::file_size(path) == model(8).file_size());
  CHECK(File::open(locked)->get<uint32_t>("k") == 7);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 2);
}
