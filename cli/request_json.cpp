#include "cli/request_json.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "gguf/error.h"

namespace baton::cli {

using nlohmann::json;

RequestFields RequestFields::from(const SamplingFlags& f, std::shared_ptr<const Grammar> grammar) {
  RequestFields r;
  r.sampling = f.params;
  r.seed = f.seed;
  r.max_tokens = f.max_tokens;
  r.ignore_eos = f.ignore_eos;
  r.logprobs = f.logprobs;
  r.stop = f.stop;
  r.grammar = std::move(grammar);
  return r;
}

void RequestFields::apply(Request& r) const {
  r.sampling = sampling;
  r.sampling.seed = resolve_seed(seed);
  r.max_tokens = max_tokens;
  r.ignore_eos = ignore_eos;
  r.logprobs = logprobs;
  r.stop = stop;
  r.grammar = grammar;
}

namespace {

// "logit_bias": OpenAI's object of token ids (as strings) to biases, {"15043": -100}, or
// llama.cpp's array of [id, bias] pairs; a bias of false bans the token (-inf), as llama.cpp's
// server takes it. The ids' range is checked with the vocabulary (SamplingParams::validate).
std::string read_logit_bias(const json& v, std::vector<std::pair<int32_t, float>>& out) {
  const char* shape = "field 'logit_bias' must be an object of token ids to numbers ({\"15043\": -100}) or an array of "
                      "[id, number] pairs";
  auto add = [&](int64_t id, const json& b) -> std::string {
    if (id < 0 || id > INT32_MAX) return fmt::format("logit_bias: token {} is not a token id", id);
    if (b.is_boolean() && !b.get<bool>()) out.push_back({int32_t(id), -INFINITY});
    else if (b.is_number()) out.push_back({int32_t(id), b.get<float>()});
    else return fmt::format("logit_bias: the bias of token {} must be a number (or false: never)", id);
    return "";
  };
  if (v.is_object()) {
    for (const auto& [key, b] : v.items()) {
      char* end = nullptr;
      errno = 0;
      const long long id = std::strtoll(key.c_str(), &end, 10);
      if (key.empty() || *end != '\0' || errno == ERANGE) return fmt::format("logit_bias: '{}' is not a token id", key);
      if (std::string e = add(id, b); !e.empty()) return e;
    }
    return "";
  }
  if (!v.is_array()) return shape;
  for (const json& p : v) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer()) return shape;
    if (std::string e = add(p[0].get<int64_t>(), p[1]); !e.empty()) return e;
  }
  return "";
}

std::string read_strings(const json& v, const char* name, std::vector<std::string>& out, bool one_allowed) {
  out.clear();
  if (one_allowed && v.is_string()) {
    out.push_back(v.get<std::string>());
    return "";
  }
  const std::string shape = fmt::format("field '{}' must be {}an array of strings", name, one_allowed ? "a string or " : "");
  if (!v.is_array()) return shape;
  for (const json& x : v) {
    if (!x.is_string()) return shape;
    out.push_back(x.get<std::string>());
  }
  return "";
}

}  // namespace

std::string read_constraint(const std::string& kind, const nlohmann::ordered_json& value, const std::string& field,
                            RequestFields& out) {
  try {
    if (kind == "grammar") {
      if (!value.is_string()) return fmt::format("{} must be a string (GBNF)", field);
      out.grammar = compile_constraint("grammar", value.get<std::string>(), field);
    } else if (kind == "format" && value.is_string()) {
      if (value.get<std::string>() != "json") return fmt::format("{} must be \"json\" or a JSON Schema object", field);
      out.grammar = compile_constraint("format", "json", field);
    } else if (value.is_object() || value.is_boolean()) {
      out.grammar = compile_constraint("json_schema", value.dump(), field);
    } else {
      return fmt::format("{} must be a JSON Schema object", field);
    }
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string read_request_fields(const json& v, const std::string& text, RequestFields& out) {
  SamplingParams& s = out.sampling;
  uint64_t seed = 0;
  for (std::string e : {read_number(v, "max_tokens", out.max_tokens), read_number(v, "temperature", s.temperature),
                        read_number(v, "top_p", s.top_p), read_number(v, "top_k", s.top_k),
                        read_number(v, "min_p", s.min_p), read_number(v, "repeat_penalty", s.repeat_penalty),
                        read_number(v, "presence_penalty", s.presence_penalty),
                        read_number(v, "frequency_penalty", s.frequency_penalty),
                        read_number(v, "repeat_last_n", s.repeat_last_n), read_number(v, "typical_p", s.typical_p),
                        read_number(v, "top_n_sigma", s.top_n_sigma),
                        read_number(v, "xtc_probability", s.xtc_probability),
                        read_number(v, "xtc_threshold", s.xtc_threshold),
                        read_number(v, "dry_multiplier", s.dry_multiplier), read_number(v, "dry_base", s.dry_base),
                        read_number(v, "dry_allowed_length", s.dry_allowed_length),
                        read_number(v, "dry_penalty_last_n", s.dry_penalty_last_n),
                        read_number(v, "mirostat", s.mirostat), read_number(v, "mirostat_tau", s.mirostat_tau),
                        read_number(v, "mirostat_eta", s.mirostat_eta), read_number(v, "seed", seed)})
    if (!e.empty()) return e;
  if (v.contains("dry_sequence_breakers"))
    if (std::string e = read_strings(v["dry_sequence_breakers"], "dry_sequence_breakers", s.dry_sequence_breakers, false);
        !e.empty())
      return e;
  if (v.contains("logit_bias")) {
    s.logit_bias.clear();  // the request's replace the flags'
    if (std::string e = read_logit_bias(v["logit_bias"], s.logit_bias); !e.empty()) return e;
  }
  if (v.contains("seed")) out.seed = seed;
  if (v.contains("ignore_eos")) {
    if (!v["ignore_eos"].is_boolean()) return "field 'ignore_eos' must be true or false";
    out.ignore_eos = v["ignore_eos"].get<bool>();
  }
  // OpenAI's pair: "logprobs": true, and "top_logprobs": N alternatives (0..20) with it.
  if (v.contains("logprobs")) {
    if (!v["logprobs"].is_boolean()) return "field 'logprobs' must be true or false";
    out.logprobs = v["logprobs"].get<bool>() ? std::max(out.logprobs, 0) : -1;
  }
  if (v.contains("top_logprobs")) {
    int n = 0;
    if (std::string e = read_number(v, "top_logprobs", n); !e.empty()) return e;
    if (n < 0 || n > kMaxTopLogprobs) return fmt::format("field 'top_logprobs' must be 0 to {}", kMaxTopLogprobs);
    if (out.logprobs < 0) return "field 'top_logprobs' needs \"logprobs\": true";
    out.logprobs = n;
  }
  if (v.contains("stop"))
    if (std::string e = read_strings(v["stop"], "stop", out.stop, true); !e.empty()) return e;
  int given = 0;
  for (const char* k : {"grammar", "json_schema", "format"}) given += v.contains(k);
  if (given > 1) return "give at most one of 'grammar', 'json_schema' and 'format'";
  for (const char* k : {"grammar", "json_schema", "format"}) {
    if (!v.contains(k)) continue;
    // Schemas again from the text, in key order.
    const auto ordered = nlohmann::ordered_json::parse(text)[k];
    if (std::string e = read_constraint(k, ordered, fmt::format("field '{}'", k), out); !e.empty()) return e;
  }
  return s.validate();
}

}  // namespace baton::cli
