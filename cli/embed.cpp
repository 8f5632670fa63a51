// `baton embed`: text embeddings from decoder models (Qwen3-Embedding, gte-Qwen2, e5-mistral, ...):
// each input's final hidden states after the output norm, pooled as the file's {arch}.pooling_type
// says (or --pooling), normalized as llama-embedding's --embd-normalize. One JSON line per input,
// written in input order as soon as it is computed; a bad input line gets an error record.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/config.h"
#include "runtime/embed.h"
#include "runtime/model_files.h"
#include "runtime/tokenizer.h"

namespace baton::cli {
namespace {

using nlohmann::json;

struct EmbedOpts {
  ModelFlags model;
  std::vector<std::string> prompts;
  std::string file, in, out = "-", pooling;
  int normalize = 2;
  int parallel = 4;
  bool json = false, plain = false;
};

// One input: its text and tokens, or why it cannot be embedded.
struct Input {
  json id;        // -i: the line's id (default: its line number); null for -p / -f
  int line = 0;   // -i: the line it came from
  std::string text, error;
  std::vector<int32_t> tokens;
};

std::string drop_newlines(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// -i: JSONL ({"id": ..., "input": "..."}) when the first non-blank line starts with '{', otherwise
// one input per non-blank line (its id the line number). Broken lines become inputs with an error.
std::vector<Input> read_input_file(const std::string& path) {
  const auto [lines, jsonl] = read_input_lines(path);
  std::vector<Input> out;
  std::map<std::string, int> first_line;  // id (as JSON text) -> the line that has it first
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.find_first_not_of(" \t") == std::string::npos) continue;
    Input x;
    x.line = int(i + 1);
    x.id = x.line;
    if (!jsonl) {
      x.text = l;
      out.push_back(std::move(x));
      continue;
    }
    const json v = json::parse(l, nullptr, /*allow_exceptions=*/false);
    if (v.is_discarded()) {
      x.id = nullptr;
      x.error = "invalid JSON";
    } else if (!v.is_object()) {
      x.id = nullptr;
      x.error = "expected a JSON object";
    } else if (v.contains("id") && !v["id"].is_string() && !v["id"].is_number_integer()) {
      x.id = nullptr;
      x.error = "field 'id' must be a string or an integer";
    } else {
      if (v.contains("id")) x.id = v["id"];
      if (!v.contains("input")) x.error = "missing 'input'";
      else if (!v["input"].is_string()) x.error = "field 'input' must be a string";
      else if ((x.text = v["input"].get<std::string>()).empty()) x.error = "field 'input' is empty";
      auto [it, fresh] = first_line.emplace(x.id.dump(), x.line);
      if (!fresh && x.error.empty()) x.error = fmt::format("duplicate id (first on line {})", it->second);
    }
    out.push_back(std::move(x));
  }
  return out;
}


// n floats as "a,b,c" (JSON) or "a b c" (plain), each the shortest text that reads back the same float.
// JSON has no NaN or infinity: there they are written as null (as perplexity --json does), so that
// the line still parses. Returns whether every value was finite.
bool append_floats(std::string& s, const float* v, size_t n, char sep, bool json) {
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    if (i) s += sep;
    if (!std::isfinite(v[i])) {
      finite = false;
      if (json) {
        s += "null";
        continue;
      }
    }
    fmt::format_to(std::back_inserter(s), "{}", v[i]);
  }
  return finite;
}

int run(const EmbedOpts& o, const CLI::Option* prompt_opt) {
  const int sources = int(prompt_opt->count() > 0) + int(!o.file.empty()) + int(!o.in.empty());
  if (sources == 0) fail(ErrorKind::Usage, "give the input with -p TEXT (repeatable; -p - for stdin), -f FILE or -i FILE");
  if (sources > 1) fail(ErrorKind::Usage, "give the input with one of -p, -f and -i");
  if (o.json && o.plain) fail(ErrorKind::Usage, "give --json or --plain, not both");
  for (const std::string& in : {o.in, o.file})  // OUT is truncated: it must not be the input
    if (!in.empty() && ((in == o.out && in != "-") || same_file(in, o.out)))
      fail(ErrorKind::Usage, "the input {} and -o {} are the same file: the records would overwrite the input", in, o.out);
  refuse_model_output("-o", o.out, o.model.model);
  std::optional<Pooling> pooling;
  if (!o.pooling.empty()) pooling = parse_pooling(o.pooling);
  check_normalize(o.normalize);

  std::vector<Input> inputs;
  const bool from_file = !o.in.empty();
  if (from_file) {
    inputs = read_input_file(o.in);
    if (inputs.empty()) {
      std::fprintf(stderr, "nothing to do: %s has no inputs\n", o.in.c_str());
      return 0;
    }
  } else if (!o.file.empty()) {
    inputs.push_back({nullptr, 0, drop_newlines(read_text(o.file)), "", {}});
  } else {
    for (const std::string& p : o.prompts) inputs.push_back({nullptr, 0, p == "-" ? drop_newlines(read_text("-")) : p, "", {}});
  }
  if (!from_file)
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].text.empty())
        fail(ErrorKind::Usage, "{} is empty", inputs.size() == 1 ? std::string("the input") : fmt::format("input {}", i));

  // Tokenize before loading: the context is sized for the longest input.
  const std::string path = resolve_model(o.model.model);
  const auto file = gguf::File::open(path);
  const ModelConfig cfg = ModelConfig::from_gguf(*file);
  const Tokenizer tok = Tokenizer::from_gguf(*file);
  if (!pooling) {
    pooling = file_pooling(*file);
    if (!pooling) {
      std::fprintf(stderr, "note: %s has no %s: one vector per token (pooling none, as llama.cpp); --pooling "
                   "mean|cls|last pools them\n", path.c_str(), file->arch_key("pooling_type").c_str());
      pooling = Pooling::None;
    } else if (*pooling == Pooling::Rank) {
      fail(ErrorKind::Usage, "{} is a reranker ({} = 4, rank), which baton does not support; --pooling "
           "none|mean|cls|last overrides", path, file->arch_key("pooling_type"));
    }
  }
  const int max_ctx = o.model.ctx > 0 ? o.model.ctx : std::min(cfg.n_ctx_train, 4096);
  int longest = 0, n_ok = 0;
  bool eos_last = true;  // every input ends in EOS (what last-token pooling expects)
  for (size_t i = 0; i < inputs.size(); ++i) {
    Input& x = inputs[i];
    if (!x.error.empty()) continue;
    x.tokens = tok.encode(x.text, /*add_special=*/true, /*parse_special=*/true);
    if (x.tokens.empty()) x.error = "the input has no tokens";
    else if (int(x.tokens.size()) > max_ctx)
      x.error = fmt::format("the input has {} tokens but the context is {} (--ctx)", x.tokens.size(), max_ctx);
    if (!x.error.empty()) {
      if (!from_file) fail(ErrorKind::Usage, "{}{}", inputs.size() == 1 ? "" : fmt::format("input {}: ", i), x.error);
      continue;
    }
    longest = std::max(longest, int(x.tokens.size()));
    eos_last &= x.tokens.back() == tok.eos();
    ++n_ok;
  }
  if (*pooling == Pooling::Last && !eos_last && n_ok > 0)
    std::fprintf(stderr, "warning: not every input ends in the EOS token (the file does not set "
                 "tokenizer.ggml.add_eos_token): last-token pooling reads the last token of the text\n");

  // The context: --ctx, or just enough for the longest input (a multiple of 64, at most the
  // model's context capped at 4096). LongRoPE models keep the default: their RoPE depends on it.
  ModelFlags mf = o.model;
  if (mf.ctx <= 0 && cfg.rope_long_ctx == 0) mf.ctx = std::min(max_ctx, std::max(64, (longest + 63) / 64 * 64));
  const int n_seq = std::max(1, std::min(o.parallel, n_ok));

  RecordFile out(o.out, false);
  std::vector<size_t> ok_index;  // the inputs that run, by their place among the inputs
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].error.empty()) ok_index.push_back(i), seqs.push_back(inputs[i].tokens);
  size_t written = 0;  // inputs whose record is out
  int n_failed = 0;
  long n_tokens = 0;
  // Error records of the inputs before `upto` (they have no embedding to wait for).
  auto write_errors = [&](size_t upto) {
    for (; written < upto; ++written) {
      const Input& x = inputs[written];
      if (x.error.empty()) continue;
      ++n_failed;
      if (o.plain) {
        std::fprintf(stderr, "error: line %d: %s\n", x.line, x.error.c_str());
        continue;
      }
      json r;
      if (!x.id.is_null()) r["id"] = x.id;
      r["line"] = x.line;
      r["error"] = x.error;
      out.write(r.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
    }
  };

  Loaded m;
  if (!seqs.empty()) {
    m = load_model(mf, n_seq);
    install_interrupt_handler();
  }
  out.begin();
  const auto t0 = std::chrono::steady_clock::now();
  const size_t E = size_t(cfg.n_embd);
  EmbedOptions eo;
  eo.pooling = *pooling;
  eo.normalize = o.normalize;
  eo.batch_tokens = o.model.batch;
  bool non_finite = false;  // an embedding had NaN or infinity in it (told once)
  if (!seqs.empty())
    embed_sequences(*m.pipe, seqs, eo, [&](Embedding&& e) {
      const size_t i = ok_index[e.index];
      write_errors(i);
      const Input& x = inputs[i];
      std::string s;
      bool finite = true;
      if (o.plain) {
        for (size_t at = 0; at < e.values.size(); at += E) {
          finite &= append_floats(s, e.values.data() + at, E, ' ', false);
          s += '\n';
        }
      } else {
        s = "{";
        if (from_file) s += "\"id\":" + x.id.dump(-1, ' ', false, json::error_handler_t::replace) + ",";
        s += fmt::format("\"index\":{},\"n_tokens\":{},\"embedding\":", i, e.n_tokens);
        if (*pooling == Pooling::None) {
          s += '[';
          for (size_t at = 0; at < e.values.size(); at += E) {
            s += at ? ",[" : "[";
            finite &= append_floats(s, e.values.data() + at, E, ',', true);
            s += ']';
          }
          s += ']';
        } else {
          s += '[';
          finite &= append_floats(s, e.values.data(), e.values.size(), ',', true);
          s += ']';
        }
        s += "}\n";
      }
      if (!finite && !non_finite) {
        non_finite = true;
        const std::string which = from_file ? fmt::format("line {}", x.line) : fmt::format("input {}", i);
        std::fprintf(stderr, "warning: the embedding of %s has non-finite values (NaN or infinity)%s: the model's "
                     "weights or activations are broken\n", which.c_str(), o.plain ? "" : ", written as null");
      }
      out.write(s);
      written = i + 1;
      n_tokens += e.n_tokens;
    }, &interrupted());
  if (interrupted()) return 130;
  write_errors(inputs.size());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "%d embedded, %d failed | pooling %s, normalize %d | %ld token%s | %.2f s | %.1f tok/s\n",
               int(ok_index.size()), n_failed, to_string(*pooling), o.normalize, n_tokens, n_tokens == 1 ? "" : "s", secs,
               secs > 0 ? double(n_tokens) / secs : 0.0);
  return 0;
}

Register reg{{"embed", "Text embeddings: each input's pooled, normalized final hidden state (one JSON line each)",
  [](CLI::App& app) {
    auto o = std::make_shared<EmbedOpts>();
    add_model_flags(app, o->model);
    CLI::Option* prompt = app.add_option("-p,--prompt", o->prompts, "an input text (repeat for more; '-' reads one from stdin)")
                              ->expected(1)
                              ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    app.add_option("-f,--file", o->file, "one input: the whole file (a trailing newline dropped)");
    app.add_option("-i,--input", o->in,
                   "inputs: JSONL ({\"id\": ..., \"input\": \"...\"} per line) or plain text, one input per line ('-': stdin)");
    app.add_option("-o,--output", o->out, "where the records go ('-': stdout)")
        ->capture_default_str()
        ->check(not_empty("the path"));
    app.add_option("--pooling", o->pooling, "none, mean, cls or last (default: the file's pooling_type; none without one)");
    app.add_option("--normalize,--embd-normalize", o->normalize,
                   "-1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, p > 2 p-norm")
        ->capture_default_str();
    app.add_option("--parallel", o->parallel, "inputs evaluated together (sequence slots)")
        ->check(in_range(1, 256))
        ->capture_default_str();
    app.add_flag("--json", o->json, "one JSON object per input (the default)");
    app.add_flag("--plain", o->plain, "numbers only: one line per vector, separated by spaces");
    return [o, prompt] { return run(*o, prompt); };
  }}};

}  // namespace
}  // namespace baton::cli
