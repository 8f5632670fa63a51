// libFuzzer target for the GGUF parser (built with -DBATON_FUZZ=ON and clang; scripts/test.sh runs
// it with tests/fuzz/corpus/ as seeds). Any input must either parse or throw baton::Error. A parsed
// file must satisfy the invariants the runtime relies on, and writing it back with the Writer must
// give a file that parses to the same metadata and tensor infos.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gguf/gguf.h"

using namespace baton;
using namespace baton::gguf;

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "fuzz_gguf: invariant broken: %s\n", what);
  std::abort();
}

void check_invariants(const File& f, const uint8_t* data, size_t size) {
  if (f.data_offset() % f.alignment() != 0) broken("data offset not aligned");
  uint8_t sink = 0;
  for (const TensorInfo& t : f.tensors()) {
    if (t.n_dims < 1 || t.n_dims > 4) broken("n_dims");
    if (t.nbytes != row_bytes(t.type, t.ne[0]) * uint64_t(t.nrows())) broken("tensor byte size");
    if (t.offset % f.alignment() != 0) broken("tensor offset alignment");
    if (t.data < data + f.data_offset() || t.data + t.nbytes > data + size) broken("tensor view out of bounds");
    sink ^= t.data[0] ^ t.data[t.nbytes - 1];  // ASan checks both ends of every view
  }
  for (const auto& [key, value] : f.metadata())
    if (f.find(key) != &value) broken("metadata index");
  // The typed getters on whatever is there: an answer or a baton::Error.
  for (const char* key : {"general.architecture", "general.alignment", "tokenizer.ggml.tokens"}) {
    try { (void)f.get<std::string>(key); } catch (const Error&) {}
    try { (void)f.get<uint32_t>(key); } catch (const Error&) {}
    try { (void)f.get<double>(key); } catch (const Error&) {}
    try { (void)f.get_strings(key); } catch (const Error&) {}
    try { (void)f.get_ints(key); } catch (const Error&) {}
    try { (void)f.get_floats(key); } catch (const Error&) {}
  }
  volatile uint8_t keep = sink;
  (void)keep;
}

// Writer -> reader on what was read: metadata identical, tensors identical up to their offsets
// (the writer lays them out contiguously in file order).
void check_rewrite(const File& f) {
  if (f.alignment() > 4096) return;  // keep each run fast: such files pad to large sizes
  Writer w(f.version());
  for (const auto& [key, value] : f.metadata()) w.set(key, value);
  for (const TensorInfo& t : f.tensors())
    w.add_tensor(t.name, t.type, std::vector<int64_t>(t.ne, t.ne + t.n_dims), t.data, t.nbytes);
  const std::vector<uint8_t> bytes = w.to_bytes();
  std::unique_ptr<File> g;
  try {
    g = File::parse(bytes.data(), bytes.size(), "rewrite");
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz_gguf: rewritten file rejected: %s\n", e.what());
    std::abort();
  }
  if (g->version() != f.version() || g->alignment() != f.alignment()) broken("rewrite header");
  if (!(g->metadata() == f.metadata())) broken("rewrite metadata");
  if (g->tensors().size() != f.tensors().size()) broken("rewrite tensor count");
  for (size_t k = 0; k < f.tensors().size(); k++) {
    const TensorInfo &a = f.tensors()[k], &b = g->tensors()[k];
    if (a.name != b.name || a.type != b.type || a.n_dims != b.n_dims || a.nbytes != b.nbytes ||
        std::memcmp(a.ne, b.ne, sizeof a.ne) != 0 || std::memcmp(a.data, b.data, a.nbytes) != 0)
      broken("rewrite tensor");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<File> f;
  try {
    f = File::parse(data, size, "fuzz");
  } catch (const Error&) {
    return 0;  // rejected with a message: the expected outcome for most inputs
  }
  check_invariants(*f, data, size);
  check_rewrite(*f);
  return 0;
}
