// Our own GGUF v2/v3 reader and writer. The file is hostile input: every count, length, offset,
// type and dimension is checked, and each error names the field and the byte offset.
// Tensor data is memory-mapped read-only; a tensor is a view into the mapping, never a copy.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "gguf/error.h"
#include "gguf/string_list.h"
#include "quant/types.h"

namespace baton::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
// What the reader accepts (a hostile file asks for more; the writer refuses to write more).
constexpr int64_t kMaxTensorElements = int64_t(1) << 50;  // per tensor: byte sizes stay far from overflow
constexpr uint64_t kMaxMetadataValues = uint64_t(1) << 24;  // all metadata values, array elements included

const char* value_type_name(ValueType t);
size_t scalar_width(ValueType t);  // bytes of one stored scalar (1, 2, 4 or 8); 0 for STRING, ARRAY

// A metadata value. Scalars keep their exact stored value in the field matching their type class.
// An array keeps its elements compactly by kind (as Values they took ~100 bytes each: a
// 262,144-token vocabulary's tokens, scores and types were 75 MB): strings in `strs` (one block
// of text), scalars in `raw` (as the file stores them: little-endian, each at its own width),
// arrays in `arr`. size() and item() read any of them.
struct Value {
  ValueType type = ValueType::UINT32;
  uint64_t u = 0;           // UINT8/16/32/64 and BOOL
  int64_t i = 0;            // INT8/16/32/64
  double f = 0;             // FLOAT32/64 (FLOAT32 values are exact in a double)
  std::string str;          // STRING
  ValueType elem = ValueType::UINT8;  // ARRAY: element type
  StringList strs;                    // ARRAY of STRING
  std::vector<uint8_t> raw;           // ARRAY of a scalar type
  std::vector<Value> arr;             // ARRAY of ARRAY

  static Value of_u32(uint32_t v) { Value x; x.type = ValueType::UINT32; x.u = v; return x; }
  static Value of_u64(uint64_t v) { Value x; x.type = ValueType::UINT64; x.u = v; return x; }
  static Value of_i32(int32_t v) { Value x; x.type = ValueType::INT32; x.i = v; return x; }
  static Value of_f32(float v) { Value x; x.type = ValueType::FLOAT32; x.f = v; return x; }
  static Value of_bool(bool v) { Value x; x.type = ValueType::BOOL; x.u = v; return x; }
  static Value of_str(std::string v) { Value x; x.type = ValueType::STRING; x.str = std::move(v); return x; }
  static Value of_array(ValueType elem, const std::vector<Value>& items);  // every item of type elem
  static Value of_strs(StringList v);
  static Value of_f32s(const std::vector<float>& v);
  static Value of_i32s(const std::vector<int32_t>& v);

  size_t size() const;         // ARRAY: its element count (0 for a scalar)
  Value item(size_t k) const;  // ARRAY: element k, as a Value of type elem
  void push(Value x);          // ARRAY: appends x (of type elem)

  bool is_int() const;
  bool is_float() const { return type == ValueType::FLOAT32 || type == ValueType::FLOAT64; }
  bool operator==(const Value& o) const;
};

struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  uint32_t n_dims = 0;
  int64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the contiguous (row) dimension
  uint64_t offset = 0;           // relative to the start of the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr; // view into the mapping (nullptr for a parsed-only buffer)
  uint64_t info_offset = 0;      // byte offset of this tensor info in the file (for messages)

  int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t nrows() const { return ne[1] * ne[2] * ne[3]; }
  std::string shape_str() const;
};

class File {
 public:
  // Memory-map and parse a file. Throws baton::Error(Model) with the path, field and offset.
  static std::unique_ptr<File> open(const std::string& path);
  // Parse a buffer that the caller keeps alive (tests, fuzzing). Tensor views point into it.
  static std::unique_ptr<File> parse(const uint8_t* data, size_t size, std::string name = "<memory>");
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const uint8_t* base() const { return base_; }

  // Metadata in file order, and by key.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Typed getters: missing key or incompatible type -> Error naming the key and what was found.
  // Integers convert between widths when the value fits; floats accept FLOAT32/FLOAT64 (and ints).
  template <class T> T get(std::string_view key) const;
  template <class T> T get_or(std::string_view key, T fallback) const {
    return has(key) ? get<T>(key) : fallback;
  }
  const StringList& get_strings(std::string_view key) const;
  std::vector<float> get_floats(std::string_view key) const;
  std::vector<int64_t> get_ints(std::string_view key) const;

  // Architecture-prefixed keys resolved in one place: arch_key("block_count") -> "llama.block_count".
  std::string architecture() const;
  std::string arch_key(std::string_view suffix) const;

  // Gives back this process's mapping of the whole pages inside [data, data + n): bytes that were
  // copied elsewhere (packed for the CPU kernels, uploaded to a GPU) stop counting in its resident
  // memory. They stay in the page cache, and a later read maps them again, so this never changes
  // what a read sees. No-op outside the mapping (a parsed buffer).
  void release(const void* data, uint64_t n) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* tensor(std::string_view name) const;
  const TensorInfo& require_tensor(std::string_view name) const;  // Error if missing

 private:
  File() = default;
  void parse_all();

  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  void* map_ = nullptr;  // non-null when we own an mmap
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, Value>> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Writer with the same alignment rules. Used by tests and `baton synth`.
class Writer {
 public:
  explicit Writer(uint32_t version = 3) : version_(version) {}
  void set(const std::string& key, Value v);  // replaces an existing key, keeps order otherwise
  // Tensor bytes are copied in; dims are ggml order (ne[0] first).
  void add_tensor(const std::string& name, GgmlType type, std::vector<int64_t> dims,
                  const void* data, size_t nbytes);
  // Tensor whose bytes are produced later by a callback (large synthetic models streamed to disk).
  using Fill = std::function<void(uint8_t* dst, size_t nbytes)>;
  void add_tensor_lazy(const std::string& name, GgmlType type, std::vector<int64_t> dims, Fill fill);
  std::vector<uint8_t> to_bytes() const;
  uint64_t file_size() const;  // what write() writes
  // Writes to a temporary file beside `path` and renames it: a failed write leaves nothing behind
  // (a device or FIFO path is written in place, and so is a writable file in a directory where no
  // new file can be made).
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> dims;
    std::vector<uint8_t> bytes;
    Fill fill;
    uint64_t nbytes;
  };
  uint32_t alignment() const;
  std::vector<uint8_t> header_bytes(std::vector<uint64_t>& offsets) const;
  uint32_t version_;
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace baton::gguf
