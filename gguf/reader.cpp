// GGUF reader. Layout (all little-endian): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
// n_kv × (string key, u32 type, value), n_tensors × (string name, u32 n_dims, u64 ne[n_dims],
// u32 type, u64 offset), padding to general.alignment, tensor data.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "gguf/gguf.h"

namespace baton {

void panic(const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "baton: internal error at %s:%d: %s\n", file, line, msg.c_str());
  std::abort();
}

namespace gguf {
namespace {

constexpr uint32_t kMaxArrayDepth = 4;
constexpr uint64_t kMaxStringLen = 1ull << 30;
// An array element that is itself an array costs a Value (~150 bytes), so a hostile file of nested
// byte arrays could ask for ~100x its size (strings and scalars cost their bytes and at most 4
// more). Real models need ~1M values (262k-token vocabularies, merges); cap well above.
constexpr uint64_t kMaxValues = kMaxMetadataValues;
constexpr int64_t kMaxElements = kMaxTensorElements;

// Keys and names in messages: hostile files can make them very long.
std::string shown(const std::string& s) {
  if (s.size() <= 96) return s;
  std::string r = s.substr(0, 96);
  r.append("...");
  return r;
}

static_assert(std::endian::native == std::endian::little, "Baton reads GGUF on little-endian hosts");

// Reads little-endian fields with bounds checks. Errors name the file, what is being read (the
// context: a metadata key or a tensor), the problem and the byte offset where the field starts.
class Cursor {
 public:
  Cursor(const uint8_t* p, uint64_t n, const std::string& name) : p_(p), n_(n), name_(name) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return n_ - pos_; }
  void set_context(std::string ctx) { ctx_ = std::move(ctx); }

  [[noreturn]] void bad(uint64_t at, const std::string& what) const {
    if (ctx_.empty()) fail(ErrorKind::Model, "{}: invalid GGUF: {} (at byte offset {})", name_, what, at);
    fail(ErrorKind::Model, "{}: invalid GGUF: {}: {} (at byte offset {})", name_, ctx_, what, at);
  }
  void need(uint64_t at, uint64_t bytes, const char* field) const {
    if (bytes > n_ - at)
      bad(at, fmt::format("{} needs {} bytes but the file ends after {} more", field, bytes, n_ - at));
  }
  template <class T> T read(const char* field) {
    need(pos_, sizeof(T), field);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  // A view into the buffer: valid while it is.
  std::string_view read_string_view(const char* field) {
    const uint64_t at = pos_;
    uint64_t len = read<uint64_t>(field);
    if (len > kMaxStringLen) bad(at, fmt::format("{} has length {} (limit {})", field, len, kMaxStringLen));
    if (len > left())
      bad(at, fmt::format("{} of length {} runs past the end of the file ({} bytes left)", field, len, left()));
    std::string_view s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }
  std::string read_string(const char* field) { return std::string(read_string_view(field)); }
  const uint8_t* read_bytes(uint64_t n, const char* field) {
    need(pos_, n, field);
    const uint8_t* p = p_ + pos_;
    pos_ += n;
    return p;
  }
  // Counts metadata values against kMaxValues.
  uint64_t values_left() const { return kMaxValues - values_; }
  void count_value() { count_values(1); }
  void count_values(uint64_t n) {
    if (n > values_left()) bad(pos_, fmt::format("more than {} metadata values in the file", kMaxValues));
    values_ += n;
  }

 private:
  const uint8_t* p_;
  uint64_t n_;
  uint64_t pos_ = 0;
  uint64_t values_ = 0;
  const std::string& name_;
  std::string ctx_;
};

size_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: return 8;  // at least the length field
    case ValueType::ARRAY: return 12;  // at least type + count
  }
  return 0;
}

bool valid_value_type(uint32_t t) { return t <= uint32_t(ValueType::FLOAT64); }

// The caller has set the cursor's context to the metadata key.
Value read_value(Cursor& c, ValueType type, uint32_t depth) {
  c.count_value();
  Value v;
  v.type = type;
  switch (type) {
    case ValueType::UINT8: v.u = c.read<uint8_t>("uint8 value"); break;
    case ValueType::INT8: v.i = c.read<int8_t>("int8 value"); break;
    case ValueType::UINT16: v.u = c.read<uint16_t>("uint16 value"); break;
    case ValueType::INT16: v.i = c.read<int16_t>("int16 value"); break;
    case ValueType::UINT32: v.u = c.read<uint32_t>("uint32 value"); break;
    case ValueType::INT32: v.i = c.read<int32_t>("int32 value"); break;
    case ValueType::FLOAT32: v.f = c.read<float>("float32 value"); break;
    case ValueType::UINT64: v.u = c.read<uint64_t>("uint64 value"); break;
    case ValueType::INT64: v.i = c.read<int64_t>("int64 value"); break;
    case ValueType::FLOAT64: v.f = c.read<double>("float64 value"); break;
    case ValueType::BOOL: {
      const uint64_t at = c.pos();
      uint8_t b = c.read<uint8_t>("bool value");
      if (b > 1) c.bad(at, fmt::format("bool value is {}, not 0 or 1", b));
      v.u = b;
      break;
    }
    case ValueType::STRING: v.str = c.read_string("string value"); break;
    case ValueType::ARRAY: {
      const uint64_t at = c.pos();
      if (depth >= kMaxArrayDepth) c.bad(at, fmt::format("arrays nest deeper than {}", kMaxArrayDepth));
      uint32_t et = c.read<uint32_t>("array element type");
      if (!valid_value_type(et)) c.bad(at, fmt::format("array has unknown element type {}", et));
      v.elem = ValueType(et);
      const uint64_t n_at = c.pos();
      uint64_t n = c.read<uint64_t>("array length");
      if (n > c.left() / scalar_size(v.elem))
        c.bad(n_at, fmt::format("array claims {} {} elements, more than the {} bytes left can hold", n,
                                value_type_name(v.elem), c.left()));
      if (n > c.values_left())  // checked before reserving memory for them
        c.bad(n_at, fmt::format("array of {} elements passes the limit of {} metadata values", n, kMaxValues));
      if (v.elem == ValueType::STRING) {  // straight into the list: no Value or std::string each
        v.strs.reserve(n);
        for (uint64_t k = 0; k < n; k++) {
          c.count_value();
          const uint64_t s_at = c.pos();
          const std::string_view s = c.read_string_view("string value");
          if (s.size() > StringList::kMaxBytes - v.strs.bytes())
            c.bad(s_at, fmt::format("the array's strings pass {} bytes together", StringList::kMaxBytes));
          v.strs.push_back(s);
        }
        v.strs.shrink_to_fit();  // the text grew by doubling
      } else if (v.elem == ValueType::ARRAY) {
        v.arr.reserve(n);
        for (uint64_t k = 0; k < n; k++) v.push(read_value(c, v.elem, depth + 1));
      } else {  // the stored bytes as they are (n fits: checked against the bytes left above)
        c.count_values(n);
        const size_t w = scalar_width(v.elem);
        const uint64_t at_bytes = c.pos();
        const uint8_t* p = c.read_bytes(n * w, "array elements");
        if (v.elem == ValueType::BOOL)
          for (uint64_t k = 0; k < n; k++)
            if (p[k] > 1) c.bad(at_bytes + k, fmt::format("bool value is {}, not 0 or 1", p[k]));
        v.raw.assign(p, p + n * w);
      }
      break;
    }
  }
  return v;
}

}  // namespace

const char* value_type_name(ValueType t) {
  static const char* names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                "bool", "string", "array", "uint64", "int64", "float64"};
  return uint32_t(t) <= 12 ? names[uint32_t(t)] : "?";
}

bool Value::is_int() const {
  switch (type) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::UINT16: case ValueType::INT16:
    case ValueType::UINT32: case ValueType::INT32: case ValueType::UINT64: case ValueType::INT64:
      return true;
    default: return false;
  }
}

bool Value::operator==(const Value& o) const {
  if (type != o.type) return false;
  switch (type) {
    case ValueType::STRING: return str == o.str;
    case ValueType::ARRAY: return elem == o.elem && strs == o.strs && raw == o.raw && arr == o.arr;
    case ValueType::FLOAT32: case ValueType::FLOAT64:
      return std::memcmp(&f, &o.f, sizeof f) == 0;
    default: return u == o.u && i == o.i;
  }
}

size_t Value::size() const {
  if (type != ValueType::ARRAY) return 0;
  if (elem == ValueType::STRING) return strs.size();
  if (elem == ValueType::ARRAY) return arr.size();
  return raw.size() / scalar_width(elem);
}

size_t scalar_width(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: case ValueType::ARRAY: return 0;
  }
  return 0;
}

namespace {

template <class T> T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T> void store(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof v);
}

}  // namespace

Value Value::item(size_t k) const {
  BATON_CHECK(k < size());
  if (elem == ValueType::STRING) return of_str(std::string(strs[k]));
  if (elem == ValueType::ARRAY) return arr[k];
  Value x;
  x.type = elem;
  const uint8_t* p = raw.data() + k * scalar_width(elem);
  switch (elem) {
    case ValueType::UINT8: case ValueType::BOOL: x.u = *p; break;
    case ValueType::INT8: x.i = int8_t(*p); break;
    case ValueType::UINT16: x.u = load<uint16_t>(p); break;
    case ValueType::INT16: x.i = load<int16_t>(p); break;
    case ValueType::UINT32: x.u = load<uint32_t>(p); break;
    case ValueType::INT32: x.i = load<int32_t>(p); break;
    case ValueType::FLOAT32: x.f = load<float>(p); break;
    case ValueType::UINT64: x.u = load<uint64_t>(p); break;
    case ValueType::INT64: x.i = load<int64_t>(p); break;
    case ValueType::FLOAT64: x.f = load<double>(p); break;
    case ValueType::STRING: case ValueType::ARRAY: break;
  }
  return x;
}

// Stores x as the file would (a narrower width keeps the low bits, as the writer does).
void Value::push(Value x) {
  BATON_CHECK(type == ValueType::ARRAY && x.type == elem);
  switch (elem) {
    case ValueType::STRING: return strs.push_back(x.str);
    case ValueType::ARRAY: return arr.push_back(std::move(x));
    case ValueType::UINT8: return store<uint8_t>(raw, uint8_t(x.u));
    case ValueType::BOOL: return store<uint8_t>(raw, x.u ? 1 : 0);
    case ValueType::INT8: return store<int8_t>(raw, int8_t(x.i));
    case ValueType::UINT16: return store<uint16_t>(raw, uint16_t(x.u));
    case ValueType::INT16: return store<int16_t>(raw, int16_t(x.i));
    case ValueType::UINT32: return store<uint32_t>(raw, uint32_t(x.u));
    case ValueType::INT32: return store<int32_t>(raw, int32_t(x.i));
    case ValueType::FLOAT32: return store<float>(raw, float(x.f));
    case ValueType::UINT64: return store<uint64_t>(raw, x.u);
    case ValueType::INT64: return store<int64_t>(raw, x.i);
    case ValueType::FLOAT64: return store<double>(raw, x.f);
  }
}

Value Value::of_array(ValueType elem, const std::vector<Value>& items) {
  Value x;
  x.type = ValueType::ARRAY;
  x.elem = elem;
  for (const Value& v : items) x.push(v);
  return x;
}
Value Value::of_strs(StringList v) {
  Value x;
  x.type = ValueType::ARRAY;
  x.elem = ValueType::STRING;
  x.strs = std::move(v);
  return x;
}
namespace {

// An array of scalars from plain numbers, each made a Value by `one`, stored compactly by push().
template <class T>
Value scalar_array(ValueType elem, const std::vector<T>& v, Value (*one)(T)) {
  Value x;
  x.type = ValueType::ARRAY;
  x.elem = elem;
  x.raw.reserve(v.size() * sizeof(T));
  for (T e : v) x.push(one(e));
  return x;
}

}  // namespace

Value Value::of_f32s(const std::vector<float>& v) { return scalar_array(ValueType::FLOAT32, v, &of_f32); }
Value Value::of_i32s(const std::vector<int32_t>& v) { return scalar_array(ValueType::INT32, v, &of_i32); }

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (uint32_t d = 0; d < n_dims; d++) s += (d ? ", " : "") + std::to_string(ne[d]);
  return s + "]";
}

File::~File() {
  if (map_) munmap(map_, size_);
}

void File::release(const void* data, uint64_t n) const {
  const auto* p = static_cast<const uint8_t*>(data);
  if (!map_ || !p || p < base_ || n > size_ || p - base_ > std::ptrdiff_t(size_ - n)) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (uintptr_t(p) + page - 1) / page * page, hi = (uintptr_t(p) + n) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // a hint: failure is harmless
}

std::unique_ptr<File> File::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, and the check below
  // refuses it anyway. It changes nothing for a regular file, which is read through mmap.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(ErrorKind::Model, "cannot open model file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(ErrorKind::Model, "'{}' is not a regular file", path);
  }
  std::unique_ptr<File> f(new File());
  f->path_ = path;
  f->size_ = uint64_t(st.st_size);
  if (f->size_ > 0) {
    void* m = mmap(nullptr, f->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      ::close(fd);
      fail(ErrorKind::Model, "cannot map '{}': {}", path, std::strerror(errno));
    }
    f->map_ = m;
    f->base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  f->parse_all();
  return f;
}

std::unique_ptr<File> File::parse(const uint8_t* data, size_t size, std::string name) {
  std::unique_ptr<File> f(new File());
  f->path_ = std::move(name);
  f->base_ = data;
  f->size_ = size;
  f->parse_all();
  return f;
}

void File::parse_all() {
  static const uint8_t kEmpty[1] = {0};
  Cursor c(base_ ? base_ : kEmpty, size_, path_);
  if (size_ < 4) c.bad(0, fmt::format("file is {} bytes, too short for the GGUF magic", size_));
  if (std::memcmp(base_, "GGUF", 4) != 0) {
    if (std::memcmp(base_, "FUGG", 4) == 0) c.bad(0, "big-endian GGUF files are not supported");
    c.bad(0, "not a GGUF file (magic is not 'GGUF')");
  }
  c.read<uint32_t>("magic");
  const uint64_t ver_at = c.pos();
  version_ = c.read<uint32_t>("version");
  if (version_ == 1) c.bad(ver_at, "GGUF version 1 is not supported (re-convert the model: v2 and v3 are)");
  if (version_ != 2 && version_ != 3) {
    if ((version_ & 0xffff) == 0 && version_ != 0)
      c.bad(ver_at, fmt::format("version {:#x} looks byte-swapped: big-endian GGUF files are not supported", version_));
    c.bad(ver_at, fmt::format("unsupported GGUF version {} (supported: 2, 3)", version_));
  }
  const uint64_t nt_at = c.pos();
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t nkv_at = c.pos();
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each tensor info takes >= 8+4+8+4+8 bytes, each kv >= 8+4+1.
  if (n_tensors > c.left() / 32) c.bad(nt_at, fmt::format("tensor count {} cannot fit in the file", n_tensors));
  if (n_kv > c.left() / 13) c.bad(nkv_at, fmt::format("metadata count {} cannot fit in the file", n_kv));

  kv_.reserve(n_kv);
  uint64_t alignment_at = 0;  // where general.alignment's value starts, for messages
  for (uint64_t k = 0; k < n_kv; k++) {
    const uint64_t at = c.pos();
    c.set_context(fmt::format("metadata entry #{}", k));
    std::string key = c.read_string("metadata key");
    if (key.empty()) c.bad(at, "empty metadata key");
    c.set_context(fmt::format("metadata '{}'", shown(key)));
    const uint64_t t_at = c.pos();
    uint32_t t = c.read<uint32_t>("metadata value type");
    if (!valid_value_type(t)) c.bad(t_at, fmt::format("unknown value type {}", t));
    if (key == "general.alignment") alignment_at = c.pos();
    Value v = read_value(c, ValueType(t), 0);
    if (kv_index_.count(key)) c.bad(at, "duplicate metadata key");
    kv_index_.emplace(key, kv_.size());
    kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const Value* a = find("general.alignment")) {
    c.set_context("metadata 'general.alignment'");
    if (a->type != ValueType::UINT32) c.bad(alignment_at, fmt::format("must be uint32, found {}", value_type_name(a->type)));
    if (a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > (1u << 20))
      c.bad(alignment_at, fmt::format("{} is not a power of two <= 1 MiB", a->u));
    alignment_ = uint32_t(a->u);
  }

  tensors_.reserve(n_tensors);
  for (uint64_t k = 0; k < n_tensors; k++) {
    TensorInfo ti;
    ti.info_offset = c.pos();
    c.set_context(fmt::format("tensor info #{}", k));
    ti.name = c.read_string("tensor name");
    if (ti.name.empty()) c.bad(ti.info_offset, "empty tensor name");
    c.set_context(fmt::format("tensor '{}'", shown(ti.name)));
    const uint64_t nd_at = c.pos();
    ti.n_dims = c.read<uint32_t>("n_dims");
    if (ti.n_dims == 0 || ti.n_dims > 4) c.bad(nd_at, fmt::format("n_dims is {} (must be 1..4)", ti.n_dims));
    int64_t count = 1;
    for (uint32_t d = 0; d < ti.n_dims; d++) {
      const uint64_t d_at = c.pos();
      uint64_t n = c.read<uint64_t>("dimension");
      if (n == 0 || n > uint64_t(std::numeric_limits<int64_t>::max()))
        c.bad(d_at, fmt::format("dimension {} is {}", d, n));
      if (__builtin_mul_overflow(count, int64_t(n), &count) || count > kMaxElements)
        c.bad(d_at, fmt::format("element count overflows (more than 2^50 at dimension {})", d));
      ti.ne[d] = int64_t(n);
    }
    const uint64_t ty_at = c.pos();
    uint32_t ty = c.read<uint32_t>("type");
    const TypeTraits* tt = type_traits(ty);
    if (!tt) c.bad(ty_at, fmt::format("unknown type id {}", ty));
    ti.type = tt->type;
    if (ti.ne[0] % tt->block_elems != 0)
      c.bad(ty_at, fmt::format("type {} with rows of {} elements, not a multiple of the block size {}",
                               tt->name, ti.ne[0], tt->block_elems));
    ti.nbytes = uint64_t(count / tt->block_elems) * tt->block_bytes;
    const uint64_t off_at = c.pos();
    ti.offset = c.read<uint64_t>("offset");
    if (ti.offset % alignment_ != 0)
      c.bad(off_at, fmt::format("offset {} is not a multiple of the alignment {}", ti.offset, alignment_));
    if (tensor_index_.count(ti.name)) c.bad(ti.info_offset, "duplicate tensor name");
    tensor_index_.emplace(ti.name, tensors_.size());
    tensors_.push_back(std::move(ti));
  }
  c.set_context("");

  data_offset_ = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_offset_ > size_)
    c.bad(c.pos(), fmt::format("data section would start at {} past the end of the file ({} bytes)", data_offset_, size_));

  // Bounds and overlap: sort by offset and check neighbours.
  std::vector<const TensorInfo*> by_off;
  by_off.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    const uint64_t avail = size_ - data_offset_;
    if (t.offset > avail || t.nbytes > avail - t.offset)
      c.bad(t.info_offset, fmt::format("tensor '{}' data [{}, {}) lies past the end of the file ({} bytes of data)",
                                       shown(t.name), t.offset, t.offset + t.nbytes, avail));
    by_off.push_back(&t);
  }
  std::sort(by_off.begin(), by_off.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < by_off.size(); k++) {
    const TensorInfo* prev = by_off[k - 1];
    if (by_off[k]->offset < prev->offset + prev->nbytes)
      c.bad(by_off[k]->info_offset, fmt::format("tensor '{}' overlaps tensor '{}'", shown(by_off[k]->name), shown(prev->name)));
  }
  for (auto& t : tensors_) t.data = base_ ? base_ + data_offset_ + t.offset : nullptr;
}

const Value* File::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {
[[noreturn]] void wrong_type(const std::string& path, std::string_view key, const Value& v, const char* want) {
  fail(ErrorKind::Model, "{}: metadata '{}' is {}, expected {}", path, key, value_type_name(v.type), want);
}
template <class T> T to_int(const std::string& path, std::string_view key, const Value& v) {
  bool neg = false;
  uint64_t mag = 0;
  if (v.type == ValueType::BOOL || !v.is_int()) wrong_type(path, key, v, "an integer");
  if (v.type == ValueType::INT8 || v.type == ValueType::INT16 || v.type == ValueType::INT32 || v.type == ValueType::INT64) {
    neg = v.i < 0;
    mag = neg ? uint64_t(-(v.i + 1)) + 1 : uint64_t(v.i);
  } else {
    mag = v.u;
  }
  if (neg) {
    if constexpr (std::is_unsigned_v<T>) fail(ErrorKind::Model, "{}: metadata '{}' is negative ({})", path, key, v.i);
    else if (mag > uint64_t(std::numeric_limits<T>::max()) + 1) fail(ErrorKind::Model, "{}: metadata '{}' = {} is out of range", path, key, v.i);
    return T(v.i);
  }
  if (mag > uint64_t(std::numeric_limits<T>::max())) fail(ErrorKind::Model, "{}: metadata '{}' = {} is out of range", path, key, mag);
  return T(mag);
}
}  // namespace

template <class T> T File::get(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(ErrorKind::Model, "{}: missing metadata key '{}'", path_, key);
  if constexpr (std::is_same_v<T, std::string>) {
    if (v->type != ValueType::STRING) wrong_type(path_, key, *v, "a string");
    return v->str;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (v->type != ValueType::BOOL) wrong_type(path_, key, *v, "a bool");
    return v->u != 0;
  } else if constexpr (std::is_floating_point_v<T>) {
    if (v->is_float()) return T(v->f);
    if (v->is_int()) return T(to_int<int64_t>(path_, key, *v));
    wrong_type(path_, key, *v, "a number");
  } else {
    return to_int<T>(path_, key, *v);
  }
}
template std::string File::get<std::string>(std::string_view) const;
template bool File::get<bool>(std::string_view) const;
template float File::get<float>(std::string_view) const;
template double File::get<double>(std::string_view) const;
template uint32_t File::get<uint32_t>(std::string_view) const;
template int32_t File::get<int32_t>(std::string_view) const;
template uint64_t File::get<uint64_t>(std::string_view) const;
template int64_t File::get<int64_t>(std::string_view) const;

const StringList& File::get_strings(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(ErrorKind::Model, "{}: missing metadata key '{}'", path_, key);
  if (v->type != ValueType::ARRAY || v->elem != ValueType::STRING) wrong_type(path_, key, *v, "an array of strings");
  return v->strs;
}

std::vector<float> File::get_floats(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(ErrorKind::Model, "{}: missing metadata key '{}'", path_, key);
  if (v->type != ValueType::ARRAY || (v->elem != ValueType::FLOAT32 && v->elem != ValueType::FLOAT64))
    wrong_type(path_, key, *v, "an array of floats");
  std::vector<float> out;
  out.reserve(v->size());
  for (size_t k = 0; k < v->size(); ++k) out.push_back(float(v->item(k).f));
  return out;
}

std::vector<int64_t> File::get_ints(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(ErrorKind::Model, "{}: missing metadata key '{}'", path_, key);
  if (v->type != ValueType::ARRAY) wrong_type(path_, key, *v, "an array of integers");
  std::vector<int64_t> out;
  out.reserve(v->size());
  for (size_t k = 0; k < v->size(); ++k) {
    const Value x = v->item(k);
    if (!x.is_int() && x.type != ValueType::BOOL) wrong_type(path_, key, *v, "an array of integers");
    out.push_back(x.is_int() ? to_int<int64_t>(path_, key, x) : int64_t(x.u));
  }
  return out;
}

std::string File::architecture() const { return get<std::string>("general.architecture"); }

std::string File::arch_key(std::string_view suffix) const {
  return architecture() + "." + std::string(suffix);
}

const TensorInfo* File::tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::require_tensor(std::string_view name) const {
  const TensorInfo* t = tensor(name);
  if (!t) fail(ErrorKind::Model, "{}: missing tensor '{}'", path_, name);
  return *t;
}

}  // namespace gguf
}  // namespace baton
