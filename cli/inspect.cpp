// `baton inspect FILE|NAME`: what a GGUF file holds. Version, the model's key facts, metadata (long
// arrays summarised, the chat template only with --template), the tensor table, totals per type,
// parameter count and bits per weight; --json prints the same as one JSON object. Only the header
// is read: tensor data stays unmapped-in.
#include <cstdio>
#include <map>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/model_files.h"

namespace baton {
namespace {

using gguf::Value;
using gguf::ValueType;
using Json = nlohmann::ordered_json;

constexpr size_t kFirstItems = 8;        // array items shown before "..."
constexpr size_t kLongString = 160;      // strings longer than this are cut in text output

struct Opts {
  std::string file, model;
  bool json = false, full_template = false;
};

bool is_chat_template(const std::string& key) { return key.rfind("tokenizer.chat_template", 0) == 0; }

// 1234567 -> "1,234,567"
std::string grouped(uint64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); i++) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string human_bytes(uint64_t n) {
  if (n < 1024) return fmt::format("{} B", n);
  if (n < (1u << 20)) return fmt::format("{:.1f} KiB", n / 1024.0);
  if (n < (1u << 30)) return fmt::format("{:.1f} MiB", n / 1048576.0);
  return fmt::format("{:.2f} GiB", n / 1073741824.0);
}

// A string as one quoted line: control characters escaped, long strings cut at a UTF-8 boundary.
std::string quoted(const std::string& s, size_t limit = kLongString) {
  size_t cut = s.size();
  if (cut > limit) {
    cut = limit * 3 / 4;
    while (cut > 0 && (uint8_t(s[cut]) & 0xC0) == 0x80) cut--;
  }
  std::string out = "\"";
  for (size_t i = 0; i < cut; i++) {
    const auto c = uint8_t(s[i]);
    switch (c) {
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      default:
        if (c < 0x20 || c == 0x7F) out += fmt::format("\\x{:02X}", c);
        else out += char(c);
    }
  }
  out += '"';
  if (cut < s.size()) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

std::string scalar_text(const Value& v) {
  switch (v.type) {
    case ValueType::UINT8: case ValueType::UINT16: case ValueType::UINT32: case ValueType::UINT64:
      return std::to_string(v.u);
    case ValueType::INT8: case ValueType::INT16: case ValueType::INT32: case ValueType::INT64:
      return std::to_string(v.i);
    case ValueType::FLOAT32: return fmt::format("{}", float(v.f));
    case ValueType::FLOAT64: return fmt::format("{}", v.f);
    case ValueType::BOOL: return v.u ? "true" : "false";
    case ValueType::STRING: return quoted(v.str);
    case ValueType::ARRAY: break;
  }
  return "?";
}

std::string value_text(const Value& v) {
  if (v.type != ValueType::ARRAY) return scalar_text(v);
  std::string out = fmt::format("[{}; {}]", gguf::value_type_name(v.elem), v.size());
  if (v.size() == 0) return out;
  out += " [";
  const size_t n = std::min(v.size(), kFirstItems);
  for (size_t i = 0; i < n; i++) out += (i ? ", " : "") + value_text(v.item(i));
  return out + (n < v.size() ? ", ...]" : "]");
}

Json scalar_json(const Value& v) {
  switch (v.type) {
    case ValueType::UINT8: case ValueType::UINT16: case ValueType::UINT32: case ValueType::UINT64: return v.u;
    case ValueType::INT8: case ValueType::INT16: case ValueType::INT32: case ValueType::INT64: return v.i;
    case ValueType::FLOAT32: return float(v.f);
    case ValueType::FLOAT64: return v.f;
    case ValueType::BOOL: return v.u != 0;
    case ValueType::STRING: return v.str;
    case ValueType::ARRAY: break;
  }
  return nullptr;
}

// {"type", "value"} for scalars and short arrays; long arrays give "length" and the "first" items.
Json value_json(const Value& v) {
  Json j;
  j["type"] = gguf::value_type_name(v.type);
  if (v.type != ValueType::ARRAY) {
    j["value"] = scalar_json(v);
    return j;
  }
  j["element_type"] = gguf::value_type_name(v.elem);
  j["length"] = v.size();
  Json items = Json::array();
  const size_t n = std::min(v.size(), kFirstItems);
  for (size_t i = 0; i < n; i++) {
    const gguf::Value item = v.item(i);
    Json x = value_json(item);
    items.push_back(item.type == ValueType::ARRAY ? x : x["value"]);
  }
  j[n < v.size() ? "first" : "value"] = std::move(items);
  return j;
}

std::string template_summary(const std::string& t) {
  const size_t lines = size_t(std::count(t.begin(), t.end(), '\n')) + (t.empty() || t.back() == '\n' ? 0 : 1);
  return fmt::format("{} bytes, {} lines (--template prints it)", t.size(), lines);
}

std::optional<uint64_t> meta_uint(const gguf::File& f, const std::string& key) {
  const Value* v = f.find(key);
  if (!v || !v->is_int()) return std::nullopt;
  try {
    return f.get<uint64_t>(key);
  } catch (const Error&) {
    return std::nullopt;  // negative: shown in the metadata, not as a model fact
  }
}

// The facts people look for first, resolved through the architecture prefix.
struct Facts {
  std::string arch, name;
  std::optional<uint64_t> blocks, embedding, context, vocab;
};
Facts facts(const gguf::File& f) {
  Facts x;
  if (const Value* a = f.find("general.architecture"); a && a->type == ValueType::STRING) x.arch = a->str;
  if (const Value* n = f.find("general.name"); n && n->type == ValueType::STRING) x.name = n->str;
  if (x.arch.empty()) return x;
  x.blocks = meta_uint(f, x.arch + ".block_count");
  x.embedding = meta_uint(f, x.arch + ".embedding_length");
  x.context = meta_uint(f, x.arch + ".context_length");
  x.vocab = meta_uint(f, x.arch + ".vocab_size");
  if (!x.vocab) {  // most files give the vocabulary only as the token list
    const Value* t = f.find("tokenizer.ggml.tokens");
    if (t && t->type == ValueType::ARRAY) x.vocab = t->size();
  }
  return x;
}

struct TypeTotal {
  uint64_t tensors = 0, params = 0, bytes = 0;
};

double bits_per_weight(uint64_t bytes, uint64_t params) { return params ? 8.0 * double(bytes) / double(params) : 0; }

int print_json(const gguf::File& f, const Opts& o) {
  const Facts x = facts(f);
  Json j;
  j["path"] = f.path();
  j["version"] = f.version();
  j["file_size"] = f.file_size();
  j["alignment"] = f.alignment();
  j["data_offset"] = f.data_offset();
  auto opt = [](const std::optional<uint64_t>& v) { return v ? Json(*v) : Json(nullptr); };
  j["model"] = {{"architecture", x.arch.empty() ? Json(nullptr) : Json(x.arch)},
                {"name", x.name.empty() ? Json(nullptr) : Json(x.name)},
                {"block_count", opt(x.blocks)},
                {"embedding_length", opt(x.embedding)},
                {"context_length", opt(x.context)},
                {"vocab_size", opt(x.vocab)},
                {"tensor_count", f.tensors().size()}};
  Json meta = Json::object();
  for (const auto& [key, v] : f.metadata()) {
    if (is_chat_template(key) && v.type == ValueType::STRING && !o.full_template)
      meta[key] = {{"type", "string"}, {"length", v.str.size()}, {"summary", template_summary(v.str)}};
    else
      meta[key] = value_json(v);
  }
  j["metadata"] = std::move(meta);

  std::map<std::string, TypeTotal> totals;
  uint64_t params = 0, bytes = 0;
  Json tensors = Json::array();
  for (const auto& t : f.tensors()) {
    Json shape = Json::array();
    for (uint32_t d = 0; d < t.n_dims; d++) shape.push_back(t.ne[d]);
    tensors.push_back({{"name", t.name}, {"type", type_name(t.type)}, {"shape", shape},
                       {"elements", t.nelements()}, {"bytes", t.nbytes}, {"offset", f.data_offset() + t.offset}});
    auto& tt = totals[type_name(t.type)];
    tt.tensors++;
    tt.params += uint64_t(t.nelements());
    tt.bytes += t.nbytes;
    params += uint64_t(t.nelements());
    bytes += t.nbytes;
  }
  j["tensors"] = std::move(tensors);
  Json types = Json::array();
  for (const auto& [name, tt] : totals)
    types.push_back({{"type", name}, {"tensors", tt.tensors}, {"parameters", tt.params}, {"bytes", tt.bytes},
                     {"bits_per_weight", bits_per_weight(tt.bytes, tt.params)}});
  j["types"] = std::move(types);
  j["parameters"] = params;
  j["tensor_bytes"] = bytes;
  j["bits_per_weight"] = params ? Json(bits_per_weight(bytes, params)) : Json(nullptr);
  // Token strings need not be valid UTF-8: replace bad bytes rather than fail.
  cli::write_stdout(j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n");
  return 0;
}

int print_text(const gguf::File& f, const Opts& o) {
  const Facts x = facts(f);
  auto opt = [](const std::optional<uint64_t>& v) { return v ? std::to_string(*v) : std::string("?"); };
  fmt::print("file      {}\n", f.path());
  fmt::print("format    GGUF v{}, {} bytes ({}), alignment {}, tensor data at offset {}\n", f.version(),
             grouped(f.file_size()), human_bytes(f.file_size()), f.alignment(), f.data_offset());
  if (f.get_or<std::string>("general.type", "") == "adapter")  // (run/chat/... take it with --lora)
    fmt::print("adapter   {} for {}: {} tensors (baton run -m MODEL --lora FILE)\n",
               f.get_or<std::string>("adapter.type", "?"), x.arch.empty() ? "?" : x.arch, f.tensors().size());
  else if (!x.arch.empty())
    fmt::print("model     {}{}: {} blocks, embedding {}, context {}, vocab {}, {} tensors\n", x.arch,
               x.name.empty() ? "" : " (" + quoted(x.name) + ")", opt(x.blocks), opt(x.embedding),
               opt(x.context), opt(x.vocab), f.tensors().size());

  size_t key_w = 20;
  for (const auto& [key, v] : f.metadata()) key_w = std::max(key_w, std::min<size_t>(key.size(), 48));
  fmt::print("\nmetadata ({} keys)\n", f.metadata().size());
  const std::string* full_template = nullptr;
  for (const auto& [key, v] : f.metadata()) {
    std::string shown = value_text(v);
    if (is_chat_template(key) && v.type == ValueType::STRING) {
      shown = template_summary(v.str);
      if (o.full_template) {
        shown = fmt::format("{} bytes, printed below", v.str.size());
        full_template = &v.str;
      }
    }
    fmt::print("  {:<{}} {:<8} {}\n", key, key_w, gguf::value_type_name(v.type), shown);
  }

  std::map<std::string, TypeTotal> totals;
  uint64_t params = 0, bytes = 0;
  size_t name_w = 4;
  for (const auto& t : f.tensors()) name_w = std::max(name_w, std::min<size_t>(t.name.size(), 48));
  fmt::print("\ntensors ({})\n", f.tensors().size());
  if (!f.tensors().empty())
    fmt::print("  {:<{}} {:<7} {:<22} {:>14} {:>14}\n", "name", name_w, "type", "shape", "bytes", "offset");
  for (const auto& t : f.tensors()) {
    fmt::print("  {:<{}} {:<7} {:<22} {:>14} {:>14}\n", t.name, name_w, type_name(t.type), t.shape_str(),
               grouped(t.nbytes), f.data_offset() + t.offset);
    auto& tt = totals[type_name(t.type)];
    tt.tensors++;
    tt.params += uint64_t(t.nelements());
    tt.bytes += t.nbytes;
    params += uint64_t(t.nelements());
    bytes += t.nbytes;
  }
  if (!f.tensors().empty()) {
    fmt::print("\ntotals per type\n  {:<7} {:>8} {:>16} {:>16} {:>12}\n", "type", "tensors", "parameters", "bytes",
               "bits/weight");
    for (const auto& [name, tt] : totals)
      fmt::print("  {:<7} {:>8} {:>16} {:>16} {:>12.2f}\n", name, tt.tensors, grouped(tt.params), grouped(tt.bytes),
                 bits_per_weight(tt.bytes, tt.params));
    fmt::print("  {:<7} {:>8} {:>16} {:>16} {:>12.2f}\n", "all", f.tensors().size(), grouped(params), grouped(bytes),
               bits_per_weight(bytes, params));
    fmt::print("\nparameters {} ({:.1f} M), {} of tensor data ({}), {:.2f} bits per weight\n", grouped(params),
               double(params) / 1e6, grouped(bytes), human_bytes(bytes), bits_per_weight(bytes, params));
  }
  if (full_template) fmt::print("\nchat template\n{}{}", *full_template,
                                full_template->empty() || full_template->back() == '\n' ? "" : "\n");
  cli::flush_stdout();
  return 0;
}

cli::Register reg{{"inspect", "Show what a GGUF file holds: metadata, tensors, types, size", [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  auto* pos = app.add_option("file", o->file, "GGUF file or known model name (e.g. smollm2-135m)");
  auto* m = app.add_option("-m,--model", o->model, "same as the positional FILE|NAME");
  pos->excludes(m);
  m->excludes(pos);
  app.add_flag("--json", o->json, "print everything as one JSON object");
  app.add_flag("--template", o->full_template, "print the chat template in full");
  return [o] {
    const std::string& name = o->file.empty() ? o->model : o->file;
    if (name.empty()) fail(ErrorKind::Usage, "inspect: give a GGUF file or a model name (baton inspect FILE|NAME)");
    auto f = gguf::File::open(resolve_model(name));
    return o->json ? print_json(*f, *o) : print_text(*f, *o);
  };
}}};

}  // namespace
}  // namespace baton
