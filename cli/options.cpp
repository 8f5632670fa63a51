#include "cli/options.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <fmt/format.h>

#include "cli/distributed.h"
#include "gguf/error.h"
#include <nlohmann/json.hpp>

#include "gguf/gguf.h"
#include "runtime/chat_template.h"
#include "runtime/draft_model.h"
#include "runtime/json_schema.h"
#include "runtime/model_files.h"
#include "runtime/shape.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

namespace baton::cli {

InputLines read_input_lines(const std::string& path) {
  const std::string text = read_text(path);
  InputLines r;
  for (size_t at = 0; at < text.size();) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    std::string s = text.substr(at, nl - at);
    if (!s.empty() && s.back() == '\r') s.pop_back();
    r.lines.push_back(std::move(s));
    at = nl + 1;
  }
  for (const auto& l : r.lines) {
    const size_t p = l.find_first_not_of(" \t");
    if (p == std::string::npos) continue;
    r.jsonl = l[p] == '{';
    break;
  }
  return r;
}

bool same_file(const std::string& a, const std::string& b) {
  if (a == "-" || b == "-") return false;
  struct stat x{}, y{};
  if (::stat(a.c_str(), &x) != 0 || ::stat(b.c_str(), &y) != 0) return false;
  return x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

std::string model_clash(const std::string& out, const std::string& model, const std::string& draft_model) {
  if (out.empty() || out == "-") return "";
  auto names = [&](const std::string& m) {
    if (m.empty()) return false;
    try {
      return same_file(out, resolve_model(m));
    } catch (const Error&) {
      return false;  // a model that does not resolve: loading says so
    }
  };
  if (names(model)) return "the model file";
  if (names(draft_model)) return "the draft model file";
  return "";
}

void refuse_model_output(const std::string& flag, const std::string& out, const std::string& model,
                         const std::string& draft_model) {
  if (const std::string what = model_clash(out, model, draft_model); !what.empty())
    fail(ErrorKind::Usage, "{} {} is {}: writing it would destroy the model", flag, out, what);
}

// ---- standard output ----

static int g_stdout_errno = 0;  // why a write to stdout failed, once one has

bool flush_stdout() {
  // stdout first: std::cout writes through it, and its flush would flush stdout and lose errno.
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  if (!flushed && g_stdout_errno == 0) g_stdout_errno = errno;
  errno = 0;
  std::cout.flush();
  if (!std::cout.good() && g_stdout_errno == 0) g_stdout_errno = errno;
  const bool ok = flushed && !std::ferror(stdout) && std::cout.good();
  // An earlier write failed inside printf, which keeps no reason; a closed stdout still tells.
  const int mode = ::fcntl(STDOUT_FILENO, F_GETFL);
  if (!ok && g_stdout_errno == 0 && (mode < 0 || (mode & O_ACCMODE) == O_RDONLY)) g_stdout_errno = EBADF;
  return ok;
}

bool write_stdout(std::string_view s) {
  errno = 0;
  if (std::fwrite(s.data(), 1, s.size(), stdout) == s.size()) return true;
  if (g_stdout_errno == 0) g_stdout_errno = errno;
  return false;
}

std::string stdout_failure() {
  if (g_stdout_errno == 0) return "writing to standard output failed";
  return fmt::format("writing to standard output failed: {}", std::strerror(g_stdout_errno));
}

void check_stdout() {
  if (!flush_stdout()) fail(ErrorKind::Model, "{}", stdout_failure());
}

// ---- option checks ----

// The integer s holds, or a message saying why it is not one in [min, max].
static std::string check_integer(const std::string& s, long long min, long long max, bool say_range) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end == s.c_str() || *end != '\0') return fmt::format("'{}' is not a whole number", s);
  const std::string rule = say_range ? fmt::format("must be {} to {}", min, max) : fmt::format("must be at least {}", min);
  if ((errno == ERANGE && v > 0) || v > max)
    return say_range ? fmt::format("{} is not allowed ({})", s, rule) : fmt::format("{} is too large (at most {})", s, max);
  if (errno == ERANGE || v < min) return fmt::format("{} is not allowed ({})", s, rule);
  return "";
}

// The same for a float option: a number (strtod's, as CLI11 reads it) that is finite as a float
// and that `allowed` takes, or a message naming the rule.
static std::string check_float(const std::string& s, bool (*allowed)(double), const char* rule) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end == s.c_str() || *end != '\0') return fmt::format("'{}' is not a number", s);
  if (std::isinf(float(v)) && v > 0) return fmt::format("{} is too large", s);
  if (!std::isfinite(float(v)) || !allowed(v)) return fmt::format("{} is not allowed ({})", s, rule);
  return "";
}

static CLI::Validator number(bool (*allowed)(double), const char* rule, const char* desc) {
  return CLI::Validator([=](std::string& s) { return check_float(s, allowed, rule); }, desc);
}

// --seed S: 0 to 2^64-1, or -1 for a random one (llama.cpp's -1), which is also what leaving it out gives.
std::string check_seed(const std::string& s) {
  errno = 0;
  char* end = nullptr;
  const bool negative = s.find('-') != std::string::npos;
  const long long neg = negative ? std::strtoll(s.c_str(), &end, 10) : 0;
  if (!negative) std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || end == s.c_str() || *end != '\0') return fmt::format("'{}' is not a whole number", s);
  if ((negative && neg != -1) || errno == ERANGE)
    return fmt::format("{} is not allowed (must be 0 to {}, or -1: random)", s, UINT64_MAX);
  return "";
}

// --logit-bias TOKEN(+|-)BIAS, as llama.cpp spells it: 15043+1.5, 15043-inf.
std::string check_logit_bias(const std::string& s) {
  const size_t sign = s.find_first_of("+-", 1);
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0])) || sign == std::string::npos)
    return fmt::format("'{}' is not TOKEN+BIAS or TOKEN-BIAS (e.g. 15043+1.5, 15043-inf)", s);
  if (std::string e = check_integer(s.substr(0, sign), 0, INT32_MAX, false); !e.empty())
    return fmt::format("'{}': the token {}", s, e);
  const std::string bias = s.substr(sign);
  char* end = nullptr;
  const double b = std::strtod(bias.c_str(), &end);
  if (end == bias.c_str() || *end != '\0' || std::isnan(b)) return fmt::format("'{}': '{}' is not a number", s, bias);
  if (std::isinf(float(b)) && b > 0) return fmt::format("'{}': a bias must be finite or -inf", s);
  return "";
}

std::pair<int32_t, float> parse_logit_bias(const std::string& s) {
  const size_t sign = s.find_first_of("+-", 1);
  return {int32_t(std::strtol(s.c_str(), nullptr, 10)), float(std::strtod(s.c_str() + sign, nullptr))};
}

std::optional<uint64_t> parse_seed(const std::string& s) {
  if (s.find('-') != std::string::npos) return std::nullopt;  // -1 (check_seed refuses other negatives): random
  return std::strtoull(s.c_str(), nullptr, 10);
}

// A text option given as '' (an unset shell variable, "$SCHEMA") means no constraint at all: refused.
CLI::Validator not_empty(const char* what) {
  return CLI::Validator(
      [=](std::string& s) { return s.empty() ? fmt::format("{} is empty", what) : std::string(); }, "");
}

CLI::Validator at_least(long long min) {
  const long long max = INT_MAX;  // the options are ints: CLI11 would refuse more with a vaguer message
  return CLI::Validator([=](std::string& s) { return check_integer(s, min, max, false); }, fmt::format(">= {}", min));
}

CLI::Validator in_range(long long min, long long max) {
  return CLI::Validator([=](std::string& s) { return check_integer(s, min, max, true); },
                        fmt::format("{} to {}", min, max));
}

// Any int: -n, --n-gpu-layers, where every negative means "no limit".
static CLI::Validator whole_number() {
  return CLI::Validator([](std::string& s) { return check_integer(s, INT_MIN, INT_MAX, false); }, "");
}

RecordFile::RecordFile(const std::string& path, bool append) : path_(path), append_(append) {
  fd_ = path == "-" ? ::dup(STDOUT_FILENO) : ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(ErrorKind::Model, "cannot open '{}' for writing: {}", path, std::strerror(errno));
}
RecordFile::~RecordFile() { ::close(fd_); }
void RecordFile::begin() {
  struct stat st{};
  if (append_ || path_ == "-" || ::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) return;  // a device or pipe: nothing to empty
  if (::ftruncate(fd_, 0) != 0) fail(ErrorKind::Model, "cannot empty '{}': {}", path_, std::strerror(errno));
}
void RecordFile::write(const std::string& record) {
  const char* p = record.data();
  size_t left = record.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing was written";
      if (path_ == "-") fail(ErrorKind::Model, "writing to standard output failed: {}", why);
      fail(ErrorKind::Model, "writing to '{}' failed: {}", path_, why);
    }
    p += n;
    left -= size_t(n);
  }
}

void add_model_flags(CLI::App& app, ModelFlags& f) {
  app.add_option("-m,--model", f.model, "model: a GGUF path or a known name (e.g. smollm2-135m)")->required();
  app.add_option("-t,--threads", f.threads, "CPU threads (0: all cores)")->check(at_least(0));
  app.add_option("-c,--ctx,--ctx-size", f.ctx, "context length per sequence (0: the model's, capped at 4096)")->check(at_least(0));
  app.add_option("-b,--batch-size", f.batch, "most tokens evaluated in one forward")
      ->capture_default_str()
      ->check(at_least(1));
  app.add_option("--devices", f.devices,
                 "devices to place layers on: auto (GPUs by free memory, then the CPU), or a list such as cpu, "
                 "cuda:0,cpu, cuda:0=20GiB,cpu, GPU-8932f937,cpu (a GPU by its UUID, as baton devices prints it)")
      ->capture_default_str()
      ->check(not_empty("the device list"));
  app.add_option("--threads-per-stage", f.threads_per_stage,
                 "CPU stages: worker threads each (0: --threads divided by the number of stages)")->check(at_least(0));
  app.add_option("--kv-type", f.kv_type, "KV cache type: f16 or q8_0")
      ->capture_default_str()
      ->check(CLI::IsMember({"f16", "q8_0"}));
  app.add_option("--p2p", f.p2p,
                 "GPU stage to GPU stage: auto (peer-to-peer where possible), on (peer-to-peer or an error), "
                 "off (through host memory; also BATON_P2P=0)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_flag("--no-cuda-graphs", f.no_cuda_graphs,
               "GPU stages: launch every op every step instead of replaying decode steps captured in CUDA graphs");
  add_placement_flags(app, f.placement);
  add_lora_flags(app, f.lora, f.lora_scaled);
  app.add_option("--control-vector", f.control_vector,
                 "a control vector (GGUF, as llama.cpp's cvector-generator writes them) added to the layers' outputs, "
                 "scale 1; repeat for several")
      ->type_name("FILE")
      ->expected(1)
      ->take_all();
  app.add_option("--control-vector-scaled", f.control_vector_scaled,
                 "a control vector with a scale: --control-vector-scaled FILE SCALE; repeatable")
      ->type_name("FILE SCALE")
      ->expected(2)
      ->take_all();
  app.add_option("--control-vector-layer-range", f.control_range,
                 "steer only layers FIRST..LAST (inclusive; default: every layer the vectors have)")
      ->type_name("FIRST LAST")
      ->expected(2)
      ->check(at_least(0));
  app.add_flag("--verbose", f.verbose, "print loading and placement details");
  add_distributed_flag(app, f.distributed, [&f] { return WorkerArgs{f.model, f.devices, f.threads, f.threads_per_stage}; });
}

void add_lora_flags(CLI::App& app, std::vector<std::string>& lora, std::vector<std::string>& lora_scaled) {
  app.add_option("--lora", lora, "a LoRA adapter (GGUF) applied to the model, scale 1; repeat for several")
      ->type_name("FILE")
      ->expected(1)
      ->take_all();
  app.add_option("--lora-scaled", lora_scaled, "a LoRA adapter with a scale: --lora-scaled FILE SCALE; repeatable")
      ->type_name("FILE SCALE")
      ->expected(2)
      ->take_all();
}

namespace {

// The files of a --X FILE / --X-scaled FILE SCALE flag pair, with their scales (1 for --X).
template <class File>
std::vector<File> scaled_files(const char* flag, const std::vector<std::string>& plain, const std::vector<std::string>& scaled) {
  std::vector<File> files;
  for (const std::string& path : plain) files.push_back({path, 1.f});
  for (size_t i = 0; i + 1 < scaled.size(); i += 2) {
    const std::string &path = scaled[i], &text = scaled[i + 1];
    char* end = nullptr;
    const float scale = std::strtof(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !std::isfinite(scale))
      fail(ErrorKind::Usage, "{}-scaled {} {}: the scale must be a number", flag, path, text);
    files.push_back({path, scale});
  }
  return files;
}

}  // namespace

std::vector<LoraFile> lora_files(const std::vector<std::string>& lora, const std::vector<std::string>& lora_scaled) {
  return scaled_files<LoraFile>("--lora", lora, lora_scaled);
}

void add_logprobs_flag(CLI::App& app, SamplingFlags& f) {
  app.add_option("--logprobs", f.logprobs,
                 "with each generated token, its log-probability under the model and those of the N most likely "
                 "tokens (0 to 20; the raw logits' log-softmax, before penalties and temperature)")
      ->check(in_range(0, kMaxTopLogprobs));
}

nlohmann::json logprobs_json(const Result& r, const Tokenizer& tok) {
  auto entry = [&](int32_t id, float lp) {
    const std::string text = tok.decode_piece(id, /*show_special=*/true);
    std::string storage;
    nlohmann::json e = {{"id", id}, {"token", std::string(unicode::with_invalid_replaced(text, storage))}, {"logprob", lp}};
    if (!storage.empty()) {  // replaced: the bytes themselves too
      e["bytes"] = nlohmann::json::array();
      for (unsigned char c : text) e["bytes"].push_back(int(c));
    }
    return e;
  };
  nlohmann::json all = nlohmann::json::array();
  for (const TokenLogprob& t : r.logprobs) {
    nlohmann::json e = entry(t.id, t.logprob);
    e["top_logprobs"] = nlohmann::json::array();
    for (const auto& [id, lp] : t.top) e["top_logprobs"].push_back(entry(id, lp));
    all.push_back(std::move(e));
  }
  return all;
}

void add_placement_flags(CLI::App& app, PlacementFlags& f) {
  app.add_option("--tensor-split", f.tensor_split,
                 "layer proportions per device entry, e.g. 3,1 (default: --devices auto fills in order; a list "
                 "gives equal work per stage to entries of one kind, or to the GPUs when the CPU is listed "
                 "too, filled in order when that does not fit)");
  app.add_option("--n-gpu-layers,--gpu-layers", f.n_gpu_layers,
                 "at most N layers on GPUs, the rest on the CPU (also -ngl N; default: as many as fit)")
      ->check(whole_number());
  app.add_flag("--no-cpu-spill", f.no_cpu_spill, "fail instead of putting layers on the CPU when GPUs are listed");
  app.add_flag("--spread", f.spread, "use every GPU listed, in proportion to its memory, even when one would do");
  app.add_flag("--cpu-moe", f.cpu_moe,
               "mixtures of experts: keep the experts in host memory and run them on the CPU, the rest of each "
               "layer where it is placed (big MoE models on small GPUs)");
  app.add_option("--reserve", f.reserve, "extra memory margin per device entry: one SIZE for all, or one per entry");
}

void add_sampling_flags(CLI::App& app, SamplingFlags& f, bool with_prompt_flags) {
  auto& p = f.params;
  // The rules of SamplingParams::validate(), checked here so that an error names the flag.
  app.add_option("-n,--max-tokens", f.max_tokens, "most tokens to generate (-1: until the model stops or the context is full)")
      ->capture_default_str()
      ->check(whole_number());
  app.add_option("--temp,--temperature", p.temperature, "sampling temperature (0: greedy)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0; }, "must be at least 0", ">= 0"));
  app.add_option("--top-k", p.top_k, "keep the K most likely tokens (0: off)")->capture_default_str()->check(at_least(0));
  app.add_option("--top-p", p.top_p, "keep the smallest set with this probability mass (1: off)")
      ->capture_default_str()
      ->check(number([](double v) { return v > 0 && v <= 1; }, "must be in (0, 1]", "(0, 1]"));
  app.add_option("--min-p", p.min_p, "drop tokens below this fraction of the best one (0: off)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0 && v <= 1; }, "must be 0 to 1", "0 to 1"));
  app.add_option("--top-n-sigma,--top-nsigma", p.top_n_sigma,
                 "keep the tokens whose logit is within N standard deviations of the best (-1: off)")
      ->capture_default_str()
      ->check(number([](double) { return true; }, "must be finite", ""));
  app.add_option("--xtc-probability", p.xtc_probability,
                 "XTC: how often a step drops every token at or above --xtc-threshold but the least likely (0: off)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0 && v <= 1; }, "must be 0 to 1", "0 to 1"));
  app.add_option("--xtc-threshold", p.xtc_threshold, "XTC: the probability a top choice has (above 0.5: off)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0 && v <= 1; }, "must be 0 to 1", "0 to 1"));
  app.add_option("--typical,--typical-p", p.typical_p,
                 "locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to this "
                 "probability mass (1: off)")
      ->capture_default_str()
      ->check(number([](double v) { return v > 0 && v <= 1; }, "must be in (0, 1]", "(0, 1]"));
  app.add_option("--mirostat", p.mirostat,
                 "Mirostat sampling, version 1 or 2, instead of top-k and the other truncations (0: off)")
      ->capture_default_str()
      ->check(in_range(0, 2));
  app.add_option("--mirostat-ent,--mirostat-tau", p.mirostat_tau, "Mirostat's target surprise (tau, in bits)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0; }, "must be at least 0", ">= 0"));
  app.add_option("--mirostat-lr,--mirostat-eta", p.mirostat_eta, "Mirostat's learning rate (eta)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0; }, "must be at least 0", ">= 0"));
  app.add_option("--repeat-penalty", p.repeat_penalty, "penalty for recently seen tokens (1: off)")
      ->capture_default_str()
      ->check(number([](double v) { return v > 0; }, "must be above 0", "> 0"));
  app.add_option("--presence-penalty", p.presence_penalty,
                 "subtract this from the logit of every token seen in the last --repeat-last-n (0: off)")
      ->capture_default_str()
      ->check(number([](double) { return true; }, "must be finite", ""));
  app.add_option("--frequency-penalty", p.frequency_penalty,
                 "subtract this times its count in the last --repeat-last-n from a token's logit (0: off)")
      ->capture_default_str()
      ->check(number([](double) { return true; }, "must be finite", ""));
  app.add_option("--repeat-last-n", p.repeat_last_n, "how many recent tokens the penalties look at")
      ->capture_default_str()
      ->check(at_least(0));
  app.add_option("--dry-multiplier", p.dry_multiplier,
                 "DRY: penalty for a token that would continue a sequence repeated from earlier (0: off; 0.8 is "
                 "typical)")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 0; }, "must be at least 0", ">= 0"));
  app.add_option("--dry-base", p.dry_base, "DRY: how fast the penalty grows with the repeat's length")
      ->capture_default_str()
      ->check(number([](double v) { return v >= 1; }, "must be at least 1", ">= 1"));
  app.add_option("--dry-allowed-length", p.dry_allowed_length, "DRY: repeats this long are not penalized")
      ->capture_default_str()
      ->check(at_least(1));
  app.add_option("--dry-penalty-last-n", p.dry_penalty_last_n, "DRY: how many recent tokens it looks at (-1: all)")
      ->capture_default_str()
      ->check(in_range(-1, INT_MAX));
  app.add_option_function<std::vector<std::string>>(
         "--dry-sequence-breaker",
         [&p](const std::vector<std::string>& v) {
           p.dry_sequence_breakers.clear();
           for (const std::string& b : v)
             if (b != "none") p.dry_sequence_breakers.push_back(b);
         },
         "DRY: a string no repeat is matched across (repeat the flag for more; replaces the default \\n : \" *; "
         "'none': no breakers)")
      ->type_name("STRING")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(not_empty("the breaker"));
  app.add_option_function<std::vector<std::string>>(
         "-l,--logit-bias",
         [&p](const std::vector<std::string>& v) {
           for (const std::string& s : v) p.logit_bias.push_back(parse_logit_bias(s));
         },
         "add BIAS to a token's logit, as TOKEN+BIAS or TOKEN-BIAS (e.g. 15043+1.5; 15043-inf: never "
         "that token); repeat the flag for more tokens (ids: baton tokenize)")
      ->type_name("TOKEN(+|-)BIAS")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(CLI::Validator(check_logit_bias, ""));
  app.add_flag("--ignore-eos", f.ignore_eos,
               "never sample an end-of-generation token: generate until -n, a stop string or the context's end "
               "(for measuring speed at a fixed length)");
  app.add_option_function<std::string>(
         "-s,--seed",
         [&f](const std::string& s) { f.seed = parse_seed(s); },
         "RNG seed (-1 or default: random, printed with the stats)")
      ->type_name("INT")
      ->check(CLI::Validator(check_seed, ""));
  app.add_option("--stop", f.stop, "stop string (repeat the flag for more); not part of the output")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--grammar", f.grammar, "constrain replies to a GBNF grammar (start rule: root)")
      ->check(not_empty("the grammar"));
  app.add_option("--grammar-file", f.grammar_file, "constrain replies to the GBNF grammar in a file")
      ->check(not_empty("the path"));
  app.add_option("--json-schema", f.json_schema,
                 "constrain replies to JSON that this JSON Schema accepts, e.g. '{\"type\": \"object\", "
                 "\"properties\": {\"name\": {\"type\": \"string\"}}, \"required\": [\"name\"]}'")
      ->check(not_empty("the schema"));
  app.add_option("--json-schema-file", f.json_schema_file, "the same with the schema in a file")
      ->check(not_empty("the path"));
  app.add_option("--format", f.format, "json: every reply is one JSON object")->check(CLI::IsMember({"json"}));
  app.add_option("--lookup", f.lookup,
                 "speculative decoding by prompt lookup: draft up to N tokens a step from where the last few "
                 "tokens occurred before in the prompt or reply; the reply does not change, only its speed "
                 "(0: off)")
      ->capture_default_str()
      ->check(in_range(0, 64));
  app.add_option("--draft-model,--model-draft", f.draft_model,
                 "speculative decoding with a draft model: a smaller model of the same tokenizer guesses the next "
                 "tokens, the model checks them in one step; the reply does not change, only its speed");
  app.add_option("--draft-max", f.draft_max, "most tokens the draft model guesses a step")
      ->capture_default_str()
      ->check(in_range(1, 64));
  app.add_option("--draft-devices,--device-draft", f.draft_devices,
                 "where the draft model runs, as --devices (default: --devices, placed after the model); "
                 "e.g. the model on cuda:0 and its draft on cuda:1 or the cpu")
      ->check(not_empty("the device list"));
  if (with_prompt_flags) {
    app.add_option("--system", f.system, "system prompt");
    app.add_option("--chat-template", f.chat_template, "chat template family instead of the model's (e.g. chatml, llama3)");
    app.add_flag("--hide-thinking", f.hide_thinking,
                 "thinking models (gpt-oss): do not show the reasoning before the answer (batch, run --json: no "
                 "\"reasoning\" field)");
  }
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

std::vector<double> parse_tensor_split(const std::string& s) {
  std::vector<double> out;
  if (s.empty()) return out;
  for (const auto& x : split_commas(s)) {
    char* end = nullptr;
    const double v = std::strtod(x.c_str(), &end);
    if (x.empty() || *end != '\0' || !(v >= 0) || !std::isfinite(v))
      fail(ErrorKind::Usage, "--tensor-split '{}': '{}' is not a proportion (a number >= 0)", s, x);
    out.push_back(v);
  }
  return out;
}

std::shared_ptr<const Grammar> compile_constraint(const std::string& kind, const std::string& text, const std::string& what,
                                                  bool verbose) {
  try {
    std::string gbnf = text;
    if (kind == "format" && text == "json") {
      gbnf = json_object_gbnf();
    } else if (kind != "grammar") {
      auto schema = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) fail(ErrorKind::Usage, "not valid JSON");
      gbnf = json_schema_to_gbnf(schema);
    }
    if (verbose && kind != "grammar") std::fprintf(stderr, "%s as GBNF:\n%s", what.c_str(), gbnf.c_str());
    auto grammar = Grammar::parse(gbnf);
    GrammarState start(grammar);  // its first expansion: a grammar too ambiguous to begin fails now, before the load
    return grammar;
  } catch (const Error& e) {
    fail(ErrorKind::Usage, "{}: {}", what, e.what());
  }
}

std::shared_ptr<const Grammar> reply_grammar(const SamplingFlags& f, bool verbose) {
  const int given = !f.grammar.empty() + !f.grammar_file.empty() + !f.json_schema.empty() + !f.json_schema_file.empty() +
                    !f.format.empty();
  if (given > 1)
    fail(ErrorKind::Usage, "give at most one of --grammar, --grammar-file, --json-schema, --json-schema-file, --format");
  // A file that cannot be read keeps its kind of error (a file problem), named by its flag.
  auto read_flag_file = [](const char* flag, const std::string& path) {
    try {
      return read_text(path);
    } catch (const Error& e) {
      fail(e.kind(), "{}: {}", flag, e.what());
    }
  };
  if (!f.grammar.empty()) return compile_constraint("grammar", f.grammar, "--grammar");
  if (!f.grammar_file.empty())
    return compile_constraint("grammar", read_flag_file("--grammar-file", f.grammar_file), "--grammar-file " + f.grammar_file);
  if (!f.json_schema.empty()) return compile_constraint("json_schema", f.json_schema, "--json-schema", verbose);
  if (!f.json_schema_file.empty())
    return compile_constraint("json_schema", read_flag_file("--json-schema-file", f.json_schema_file),
                              "--json-schema-file " + f.json_schema_file, verbose);
  if (!f.format.empty()) return compile_constraint("format", f.format, "--format", verbose);
  return nullptr;
}

uint64_t resolve_seed(const std::optional<uint64_t>& s) { return s ? *s : random_seed(); }

bool stderr_is_tty() { return isatty(STDERR_FILENO) == 1; }
bool stdin_is_tty() { return isatty(STDIN_FILENO) == 1; }

LoadOptions load_options(const ModelFlags& f, int n_seq, int n_outputs) {
  LoadOptions lo;
  lo.n_ctx = f.ctx;
  lo.n_seq = n_seq;
  lo.n_batch = f.batch;
  lo.n_outputs = n_outputs;
  lo.kv_type = f.kv_type == "q8_0" ? GgmlType::Q8_0 : GgmlType::F16;
  lo.n_threads = f.threads;
  lo.devices = f.devices;
  lo.threads_per_stage = f.threads_per_stage;
  apply_placement(f.placement, lo);
  lo.p2p = f.p2p;
  lo.cuda_graphs = !f.no_cuda_graphs;
  lo.verbose = f.verbose;
  lo.lora = lora_files(f.lora, f.lora_scaled);
  lo.control_vectors = scaled_files<ControlVectorFile>("--control-vector", f.control_vector, f.control_vector_scaled);
  if (!f.control_range.empty() && f.control_range.size() != 2)
    fail(ErrorKind::Usage, "--control-vector-layer-range takes two layers, FIRST LAST (inclusive)");
  if (f.control_range.size() == 2) {
    lo.control_first = f.control_range[0];
    lo.control_last = f.control_range[1];
  }
  return lo;
}

int generation_outputs(const SamplingFlags& f, int n_seq) {
  const int drafts = f.draft_model.empty() ? f.lookup : f.draft_max;
  return n_seq * (1 + std::max(0, drafts));
}

Loaded load_model(const ModelFlags& f, int n_seq, int n_outputs) {
  Loaded out;
  out.path = resolve_model(f.model);
  LoadOptions lo = load_options(f, n_seq, n_outputs);
  const bool bar = stderr_is_tty();
  if (bar) {
    lo.progress = [](uint64_t done, uint64_t total) {
      const int width = 30;
      double frac = total ? double(done) / double(total) : 1.0;
      int fill = int(frac * width + 0.5);
      std::fprintf(stderr, "\rloading [%s%s] %3d%%  %.0f/%.0f MiB", std::string(size_t(fill), '#').c_str(),
                   std::string(size_t(width - fill), ' ').c_str(), int(frac * 100 + 0.5), double(done) / 1048576.0,
                   double(total) / 1048576.0);
      std::fflush(stderr);
    };
  }
  auto t0 = std::chrono::steady_clock::now();
  out.pipe = f.distributed ? load_distributed(out.path, lo) : Pipeline::load(out.path, lo);
  out.load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (bar) std::fprintf(stderr, "\r\033[K");  // the bar is gone once loading is done
  out.vocab = tokenizer_vocab(out.pipe->tokenizer());
  return out;
}

// ---- prompts ----

struct Prompter::Impl {
  const Tokenizer* tok = nullptr;
  std::optional<ChatTemplate> tmpl;
  std::string warning;  // about the template: said when it is first used (never for raw prompts)
};

Prompter::Prompter(const Pipeline& pipe, const std::string& template_name) : impl_(std::make_unique<Impl>()) {
  impl_->tok = &pipe.tokenizer();
  impl_->tmpl.emplace(ChatTemplate::for_model(pipe.file(), pipe.tokenizer(), template_name, &impl_->warning));
  name_ = impl_->tmpl->name();
}
Prompter::~Prompter() = default;

// Special-token text in the prompt becomes those tokens; BOS goes in front when the model wants
// one and the text does not already start with it (templates often write it out).
static std::vector<int32_t> encode_prompt(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
  if (tok.add_bos() && tok.bos() >= 0 && (ids.empty() || ids[0] != tok.bos())) ids.insert(ids.begin(), tok.bos());
  return ids;
}

std::vector<int32_t> Prompter::chat(const std::vector<Message>& messages) const {
  if (!impl_->warning.empty()) {
    std::fprintf(stderr, "warning: %s\n", impl_->warning.c_str());
    impl_->warning.clear();
  }
  std::vector<ChatMessage> msgs;
  for (const auto& m : messages) msgs.push_back({m.role, m.content});
  return encode_prompt(*impl_->tok, impl_->tmpl->render(msgs, /*add_generation_prompt=*/true));
}

std::vector<int32_t> Prompter::raw(const std::string& text) const { return encode_prompt(*impl_->tok, text); }

// ---- Ctrl-C ----

static std::atomic<bool> g_interrupted{false};
static int g_pipe[2] = {-1, -1};  // the handler writes a byte per press; non-blocking both ends
std::atomic<bool>& interrupted() { return g_interrupted; }
int interrupt_fd() { return g_pipe[0]; }

static void on_sigint(int) {
  if (g_interrupted.load()) {  // pressed again before the engine noticed: leave now
    signal(SIGINT, SIG_DFL);
    raise(SIGINT);
    return;
  }
  g_interrupted.store(true);
  if (g_pipe[1] >= 0) {
    int saved = errno;  // the interrupted code may be about to look at errno
    [[maybe_unused]] ssize_t n = write(g_pipe[1], "c", 1);
    errno = saved;
  }
}

void clear_interrupt() {
  char buf[64];
  if (g_pipe[0] >= 0)
    while (read(g_pipe[0], buf, sizeof buf) > 0) {}
  g_interrupted.store(false);
}

void install_interrupt_handler() {
  if (g_pipe[0] < 0 && pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) g_pipe[0] = g_pipe[1] = -1;
  struct sigaction sa = {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  // SA_RESTART: a write that waits for the terminal or a pipe's reader goes on after a press
  // (without it, stdio would take the EINTR for a failed stdout). Waits for input poll
  // interrupt_fd() as well, which no restart hides.
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
}

// ---- replies ----

void ReplyPrinter::attach(Request& r) {
  r.on_text = [this](std::string_view s) { answer(s); };
  r.on_reasoning = [this](std::string_view s) { reasoning(s); };
}

void ReplyPrinter::reasoning(std::string_view s) {
  if (!show_ || s.empty()) return;
  std::FILE* f = tty_ ? stdout : stderr;
  if (!thinking_) std::fputs(tty_ ? "\033[2mThinking...\n" : "Thinking...\n", f);  // dim until the block closes
  thinking_ = true;
  std::fwrite(s.data(), 1, s.size(), f);
  std::fflush(f);
}

void ReplyPrinter::close_reasoning(bool done) {
  if (!thinking_) return;
  thinking_ = false;
  std::FILE* f = tty_ ? stdout : stderr;
  // Done: a blank line before the answer. Cut short: the line ends (on stdout the caller ends it).
  if (done) std::fputs("\n...done thinking.\n\n", f);
  else if (!tty_) std::fputs("\n", f);
  if (tty_) std::fputs("\033[0m", f);
  std::fflush(f);
}

void ReplyPrinter::answer(std::string_view s) {
  if (s.empty()) return;
  close_reasoning(/*done=*/true);
  std::fwrite(s.data(), 1, s.size(), stdout);
  // Nobody can read the rest of a reply whose output failed: stop generating it, as Ctrl-C does
  // (the command then reports the failure, check_stdout()).
  if (!flush_stdout()) interrupted().store(true);
}

void ReplyPrinter::end() { close_reasoning(/*done=*/false); }

EngineOptions engine_options(const SamplingFlags& f, const ModelFlags& mf, const Pipeline& target) {
  EngineOptions o;
  o.lookup = f.lookup;
  if (!f.draft_devices.empty() && f.draft_model.empty())
    fail(ErrorKind::Usage, "--draft-devices {} needs --draft-model", f.draft_devices);
  if (!f.draft_model.empty()) {
    if (f.lookup > 0) fail(ErrorKind::Usage, "give --lookup or --draft-model, not both");
    ModelFlags df = mf;
    df.model = f.draft_model;
    df.lora.clear();  // (the adapters and control vectors are the model's)
    df.lora_scaled.clear();
    df.control_vector.clear();
    df.control_vector_scaled.clear();
    df.control_range.clear();
    if (!f.draft_devices.empty()) {
      // Other devices: the model's placement flags (a --tensor-split per device, say) are not the draft's.
      df.devices = f.draft_devices;
      df.placement = PlacementFlags{};
    }
    df.ctx = target.n_ctx();
    df.verbose = false;
    const std::string path = resolve_model(df.model);
    {
      const auto file = gguf::File::open(path);
      check_draft_vocab(target.tokenizer(), Tokenizer::from_gguf(*file));
      // --cpu-moe is the model's: a dense draft is not warned that it has no experts.
      if (df.placement.cpu_moe && shape_from_gguf(*file).n_expert == 0) df.placement.cpu_moe = false;
    }
    const auto t0 = std::chrono::steady_clock::now();
    // A draft step asks one argmax row of each sequence it guesses for.
    std::unique_ptr<Pipeline> dp;
    try {
      dp = Pipeline::load(path, load_options(df, target.n_seq(), target.n_seq()));
    } catch (const Error& e) {
      if (f.draft_devices.empty()) throw;
      fail(e.kind(), "--draft-devices {}: {}", f.draft_devices, e.what());
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (mf.verbose) {
      std::string where;
      for (const StageInfo& st : dp->stages()) where += (where.empty() ? "" : ", ") + st.device;
      std::fprintf(stderr, "draft model %s on %s, loaded in %.0f ms\n", path.c_str(), where.c_str(), ms);
    }
    o.drafter = std::make_shared<ModelDrafter>(std::move(dp), target.n_vocab());
    o.lookup = f.draft_max;
  }
  const char* share = std::getenv("BATON_SHARE_PREFIXES");  // 0: every slot evaluates its whole prompt
  o.share_prefixes = !(share && std::string_view(share) == "0");
  return o;
}

std::string count_of(int n, const char* noun) { return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s"); }

std::string speed_stats(const Result& r, const std::string& prompt_note) {
  const std::string prompt =
      fmt::format("prompt {}{}, {:.1f} tok/s", count_of(r.prompt_tokens, "token"), prompt_note, r.prompt_tps());
  if (r.completion_tokens() == 0) return prompt + " | generated nothing";
  const std::string speed = r.completion_tokens() > 1 ? fmt::format(", {:.1f} tok/s", r.gen_tps()) : "";
  const std::string drafts =
      r.drafted > 0 ? fmt::format(" | {}/{} drafts kept", r.draft_accepted, r.drafted) : "";
  return prompt + fmt::format(" | generated {}{}{} | ttft {:.0f} ms", count_of(r.completion_tokens(), "token"), speed,
                              drafts, r.ttft_ms);
}

std::string read_text(const std::string& path) {
  const bool std_in = path == "-";
  const std::string name = std_in ? "standard input" : "'" + path + "'";
  const int fd = std_in ? STDIN_FILENO : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(ErrorKind::Model, "cannot read {}: {}", name, std::strerror(errno));
  auto done = [&] {
    if (!std_in) ::close(fd);
  };
  // A directory opens like a file and reads as an error (or, through some calls, as nothing).
  struct stat st{};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    done();
    fail(ErrorKind::Model, "{} is a directory", name);
  }
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      text.append(buf, size_t(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      const int e = errno;
      done();
      fail(ErrorKind::Model, "cannot read {}: {}", name, std::strerror(e));
    }
  }
  done();
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);
  return text;
}

}  // namespace baton::cli
