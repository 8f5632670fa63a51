// GGUF writer: same layout and alignment rules as the reader; writer -> reader round trip is exact.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/stat.h>
#include <unistd.h>

#include "gguf/gguf.h"

namespace baton::gguf {
namespace {

void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + n);
  std::memcpy(out.data() + at, p, n);
}
template <class T> void put(std::vector<uint8_t>& out, T v) { put_bytes(out, &v, sizeof v); }
void put_string(std::vector<uint8_t>& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

void put_value(std::vector<uint8_t>& out, const Value& v) {
  switch (v.type) {
    case ValueType::UINT8: put<uint8_t>(out, uint8_t(v.u)); break;
    case ValueType::INT8: put<int8_t>(out, int8_t(v.i)); break;
    case ValueType::UINT16: put<uint16_t>(out, uint16_t(v.u)); break;
    case ValueType::INT16: put<int16_t>(out, int16_t(v.i)); break;
    case ValueType::UINT32: put<uint32_t>(out, uint32_t(v.u)); break;
    case ValueType::INT32: put<int32_t>(out, int32_t(v.i)); break;
    case ValueType::FLOAT32: put<float>(out, float(v.f)); break;
    case ValueType::BOOL: put<uint8_t>(out, v.u ? 1 : 0); break;
    case ValueType::STRING: put_string(out, v.str); break;
    case ValueType::UINT64: put<uint64_t>(out, v.u); break;
    case ValueType::INT64: put<int64_t>(out, v.i); break;
    case ValueType::FLOAT64: put<double>(out, v.f); break;
    case ValueType::ARRAY:
      put<uint32_t>(out, uint32_t(v.elem));
      put<uint64_t>(out, v.size());
      if (v.elem == ValueType::STRING) {
        for (std::string_view s : v.strs) put_string(out, s);
      } else if (v.elem == ValueType::ARRAY) {
        for (const Value& x : v.arr) put_value(out, x);
      } else {
        put_bytes(out, v.raw.data(), v.raw.size());  // already as the file stores them
      }
      break;
  }
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

void Writer::set(const std::string& key, Value v) {
  for (auto& kv : kv_)
    if (kv.first == key) { kv.second = std::move(v); return; }
  kv_.emplace_back(key, std::move(v));
}

namespace {

// Elements of a tensor of these dims; a shape no reader accepts is the caller's input (a
// synthetic shape), so it is a usage error naming the tensor.
int64_t element_count(const std::string& name, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) {
    BATON_CHECK(d > 0);
    if (__builtin_mul_overflow(n, d, &n) || n > kMaxTensorElements)
      fail(ErrorKind::Usage, "tensor '{}' would have more than 2^50 elements, which no GGUF reader accepts", name);
  }
  return n;
}

}  // namespace

void Writer::add_tensor(const std::string& name, GgmlType type, std::vector<int64_t> dims,
                        const void* data, size_t nbytes) {
  const int64_t n = element_count(name, dims);
  const TypeTraits& tt = traits(type);
  // Writing a tensor whose bytes do not match its shape is a bug in the caller, not bad input.
  BATON_CHECK(!dims.empty() && dims.size() <= 4 && dims[0] % tt.block_elems == 0);
  BATON_CHECK(nbytes == uint64_t(n / tt.block_elems) * tt.block_bytes);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  Tensor t{name, type, std::move(dims), std::vector<uint8_t>(p, p + nbytes), nullptr, nbytes};
  tensors_.push_back(std::move(t));
}

void Writer::add_tensor_lazy(const std::string& name, GgmlType type, std::vector<int64_t> dims, Fill fill) {
  const int64_t n = element_count(name, dims);
  const TypeTraits& tt = traits(type);
  BATON_CHECK(!dims.empty() && dims.size() <= 4 && dims[0] % tt.block_elems == 0);
  Tensor t{name, type, std::move(dims), {}, std::move(fill), uint64_t(n / tt.block_elems) * tt.block_bytes};
  tensors_.push_back(std::move(t));
}

uint32_t Writer::alignment() const {
  for (const auto& kv : kv_) {
    if (kv.first != "general.alignment") continue;
    const uint64_t a = kv.second.u;
    BATON_CHECK(kv.second.type == ValueType::UINT32 && a != 0 && (a & (a - 1)) == 0);
    return uint32_t(a);
  }
  return 32;
}

std::vector<uint8_t> Writer::header_bytes(std::vector<uint64_t>& offsets) const {
  const uint64_t align = alignment();
  std::vector<uint8_t> out;
  put_bytes(out, "GGUF", 4);
  put<uint32_t>(out, version_);
  put<uint64_t>(out, tensors_.size());
  put<uint64_t>(out, kv_.size());
  for (const auto& [k, v] : kv_) {
    put_string(out, k);
    put<uint32_t>(out, uint32_t(v.type));
    put_value(out, v);
  }
  offsets.clear();
  uint64_t off = 0;
  for (const auto& t : tensors_) {
    put_string(out, t.name);
    put<uint32_t>(out, uint32_t(t.dims.size()));
    for (int64_t d : t.dims) put<uint64_t>(out, uint64_t(d));
    put<uint32_t>(out, uint32_t(t.type));
    put<uint64_t>(out, off);
    offsets.push_back(off);
    off = align_up(off + t.nbytes, align);
  }
  out.resize(align_up(out.size(), align), 0);
  return out;
}

std::vector<uint8_t> Writer::to_bytes() const {
  std::vector<uint64_t> offsets;
  std::vector<uint8_t> out = header_bytes(offsets);
  const size_t base = out.size();
  for (size_t k = 0; k < tensors_.size(); k++) {
    const Tensor& t = tensors_[k];
    out.resize(base + offsets[k], 0);
    const size_t at = out.size();
    out.resize(at + t.nbytes);
    if (t.fill) t.fill(out.data() + at, t.nbytes);
    else std::memcpy(out.data() + at, t.bytes.data(), t.nbytes);
  }
  return out;
}

uint64_t Writer::file_size() const {
  std::vector<uint64_t> offsets;
  const uint64_t header = header_bytes(offsets).size();
  return tensors_.empty() ? header : header + offsets.back() + tensors_.back().nbytes;
}

void Writer::write(const std::string& path) const {
  std::vector<uint64_t> offsets;
  const std::vector<uint8_t> header = header_bytes(offsets);
  // A regular file (or a new one) is written beside, then renamed over: an error, an interrupt or
  // a full disk leaves the old file or none, never a truncated model that looks like one.
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  bool in_place = exists && !S_ISREG(st.st_mode);
  // Through a symbolic link: the file it names is replaced, the link stays.
  std::string target = path;
  if (char* real = in_place ? nullptr : ::realpath(path.c_str(), nullptr)) {
    target = real;
    std::free(real);
  }
  const std::string tmp = in_place ? path : fmt::format("{}.partial.{}", target, ::getpid());
  struct Cleanup {  // removes the temporary file unless the rename happened
    const std::string* tmp = nullptr;
    ~Cleanup() { if (tmp) ::unlink(tmp->c_str()); }
  } cleanup;
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  // A directory where this user may make no new file can still hold a file they may write: that
  // file is then written in place, as before the rename. A failure then leaves a partial file,
  // which the reader refuses (tensor data past its end).
  if (!f && exists && !in_place && (errno == EACCES || errno == EPERM || errno == EROFS)) {
    f = std::fopen(target.c_str(), "wb");
    if (!f) fail(ErrorKind::Model, "cannot write '{}': {}", path, std::strerror(errno));
    in_place = true;
  }
  if (!f) fail(ErrorKind::Model, "cannot create '{}': {}", tmp, std::strerror(errno));
  if (!in_place) cleanup.tmp = &tmp;
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size();
  uint64_t pos = 0;
  std::vector<uint8_t> buf;
  try {
    for (size_t k = 0; k < tensors_.size() && ok; k++) {
      const Tensor& t = tensors_[k];
      static const uint8_t zeros[4096] = {};
      while (pos < offsets[k] && ok) {
        size_t n = size_t(std::min<uint64_t>(sizeof zeros, offsets[k] - pos));
        ok = std::fwrite(zeros, 1, n, f) == n;
        pos += n;
      }
      const uint8_t* src = t.bytes.data();
      if (t.fill) {
        try {
          buf.resize(t.nbytes);
        } catch (const std::bad_alloc&) {
          fail(ErrorKind::OutOfMemory, "writing '{}': tensor '{}' needs {} bytes of memory at once", path, t.name,
               t.nbytes);
        }
        t.fill(buf.data(), t.nbytes);
        src = buf.data();
      }
      ok = ok && std::fwrite(src, 1, t.nbytes, f) == t.nbytes;
      pos += t.nbytes;
    }
  } catch (...) {
    std::fclose(f);
    throw;
  }
  const int write_errno = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) fail(ErrorKind::Model, "failed writing '{}': {}", path, std::strerror(errno ? errno : write_errno));
  if (!in_place) {
    if (std::rename(tmp.c_str(), target.c_str()) != 0)
      fail(ErrorKind::Model, "cannot rename '{}' to '{}': {}", tmp, target, std::strerror(errno));
    cleanup.tmp = nullptr;
  }
}

}  // namespace baton::gguf
