// The generation settings a JSON request may carry (a `baton batch` line, a `baton serve` body):
// sampling, seed, length, stop strings, logprobs and a grammar, over the defaults the flags give.
// One reader for both, so a field means the same in a JSONL file and in an HTTP request.
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/options.h"

namespace baton::cli {

struct RequestFields {
  SamplingParams sampling;
  std::optional<uint64_t> seed;  // unset: a fresh random seed
  int max_tokens = -1;
  bool ignore_eos = false;
  int logprobs = -1;             // Request::logprobs
  std::vector<std::string> stop;
  std::shared_ptr<const Grammar> grammar;  // the request's own, or the flags'

  // The flags' settings (and the grammar they compiled) as a request's defaults.
  static RequestFields from(const SamplingFlags& f, std::shared_ptr<const Grammar> grammar);
  // Into the engine's request; an unset seed is drawn now.
  void apply(Request& r) const;
};

// Reads the fields `v` sets over `out`: "" when all are good, else the first problem, naming the
// field ("field 'top_k' must be an integer"). `text` is v's source: a schema is read again from it
// in key order (properties are generated in the order the schema lists them). Fields: max_tokens,
// temperature, top_p, top_k, min_p, typical_p, top_n_sigma, the penalties, xtc_*, dry_*,
// mirostat*, seed, logit_bias, ignore_eos, logprobs + top_logprobs, stop, and one of grammar,
// json_schema and format. The sampling settings are validated together at the end.
std::string read_request_fields(const nlohmann::json& v, const std::string& text, RequestFields& out);

// A constraint from JSON: kind "grammar" (GBNF text), "json_schema" (a schema, in key order) or
// "format" ("json" or a schema, as Ollama takes it), compiled into out.grammar; "" or the error,
// naming `field`.
std::string read_constraint(const std::string& kind, const nlohmann::ordered_json& value, const std::string& field,
                            RequestFields& out);

// An optional number field into out (left alone when absent): "" or why not ("field 'x' must be an
// integer", "... must be >= 0", "... is out of range" for a value the type cannot hold).
template <class T>
std::string read_number(const nlohmann::json& j, const char* name, T& out) {
  if (!j.contains(name)) return "";
  const nlohmann::json& v = j[name];
  if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return fmt::format("field '{}' must be an integer", name);
    if (std::is_unsigned_v<T> && !v.is_number_unsigned() && v.template get<int64_t>() < 0)
      return fmt::format("field '{}' must be >= 0", name);
    // A value the field's type cannot hold is an error, not a wrapped number.
    const bool fits = v.is_number_unsigned()
                          ? v.template get<uint64_t>() <= uint64_t(std::numeric_limits<T>::max())
                          : v.template get<int64_t>() >= int64_t(std::numeric_limits<T>::min()) &&
                                (std::is_unsigned_v<T> || v.template get<int64_t>() <= int64_t(std::numeric_limits<T>::max()));
    if (!fits) return fmt::format("field '{}' is out of range", name);
    out = v.template get<T>();
  } else {
    if (!v.is_number()) return fmt::format("field '{}' must be a number", name);
    out = v.template get<T>();
  }
  return "";
}

}  // namespace baton::cli
