// Flags and plumbing shared by the generating subcommands (run, chat, batch, bench): model and
// device flags, sampling flags, loading with a progress bar, prompts through the chat template,
// and the Ctrl-C flag the engine polls.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json_fwd.hpp>

#include "runtime/devices.h"
#include "runtime/engine.h"
#include "runtime/grammar.h"
#include "runtime/pipeline.h"
#include "runtime/sampler.h"

namespace baton::cli {

// An output file of records (batch, embed): "-" is stdout; each record goes out in one write, so
// after a crash a line is either there or (at worst) cut short at the end.
class RecordFile {
 public:
  RecordFile(const std::string& path, bool append);
  ~RecordFile();
  RecordFile(const RecordFile&) = delete;
  RecordFile& operator=(const RecordFile&) = delete;
  // Empties the file unless appending: opening only checks that it can be written, so a run that
  // fails before begin() (a model that does not load or fit) leaves an earlier output as it was.
  void begin();
  void write(const std::string& record);

 private:
  std::string path_;
  bool append_ = false;
  int fd_ = -1;
};

// An input file of records (batch, embed; "-": stdin) as its lines, a trailing '\r' dropped, and
// whether it is JSONL (its first non-blank line starts with '{') or one plain input per line. Read
// as read_text does (a leading byte-order mark skipped, Error(Model) when it cannot be read).
struct InputLines {
  std::vector<std::string> lines;
  bool jsonl = false;
};
InputLines read_input_lines(const std::string& path);

// Whether two paths name one file (the same device and inode: through a symlink or a hard link
// too). "-" (stdin, stdout) and paths that do not exist name no file another path could share.
bool same_file(const std::string& a, const std::string& b);

// An output path that names a model file the command reads (-m, or the draft model: a path or a
// known name): "the model file", "the draft model file", or "" when it names neither. Writing it
// would destroy the model, and a model being read is mapped: its next page read is a SIGBUS.
std::string model_clash(const std::string& out, const std::string& model, const std::string& draft_model = "");
// Error(Usage) "FLAG OUT is the model file ..." when model_clash() finds one; before anything is opened.
void refuse_model_output(const std::string& flag, const std::string& out, const std::string& model,
                         const std::string& draft_model = "");

// Standard output's state. A write that failed (a full disk, a closed stdout) must not end in exit 0:
// main() checks after every command, and streaming commands check between tokens, so that a reply
// does not go on for minutes into an output nobody reads. A broken pipe is not seen here: SIGPIPE
// ends the process first, as `baton run ... | head` expects.
// Flushes std::cout and stdout; false when a write failed, now or earlier (the reason is kept).
bool flush_stdout();
// Writes s to stdout; false when that failed, keeping the reason. For text that may exceed stdout's
// buffer: fwrite then writes it at once, and a flush after a failure there no longer knows why.
bool write_stdout(std::string_view s);
// "writing to standard output failed: <reason>".
std::string stdout_failure();
// Error(Model) with stdout_failure() when flush_stdout() fails.
void check_stdout();

// CLI11 checks of integer options whose message states the rule, e.g. "--batch-size: 0 is not
// allowed (must be at least 1)" (CLI11's own number checks print a range up to DBL_MAX).
CLI::Validator at_least(long long min);
CLI::Validator in_range(long long min, long long max);
// A text option given as '' (an unset shell variable): "--FLAG: WHAT is empty", e.g. an output
// path (-o '') is refused before anything is loaded rather than failing to open ''.
CLI::Validator not_empty(const char* what);

// Where the layers go beyond --devices: the planner's overrides, the same flags for `baton plan`
// and for the commands that load a model, so a plan printed is the plan run.
struct PlacementFlags {
  std::string tensor_split;  // --tensor-split 3,1: layer proportions per device entry ("" = the default cut)
  std::string reserve;       // --reserve SIZE[,SIZE...]: extra margin per device entry
  int n_gpu_layers = -1;     // --n-gpu-layers N (also -ngl N): at most N layers on GPUs; -1: no cap
  bool no_cpu_spill = false;
  bool spread = false;
  bool cpu_moe = false;      // --cpu-moe: a mixture's experts in host memory, on the CPU
};

struct ModelFlags {
  std::string model;
  int threads = 0;
  int ctx = 0;
  int batch = 512;
  std::string devices = "auto";  // GPUs by free memory, then the CPU (runtime/devices.h)
  int threads_per_stage = 0;
  std::string kv_type = "f16";
  PlacementFlags placement;
  std::string p2p = "auto";  // --p2p: how consecutive GPU stages hand over (auto, on, off)
  bool no_cuda_graphs = false;
  bool verbose = false;
  bool distributed = false;  // --distributed: stages on the ranks of an MPI job (cli/distributed.h)
  std::vector<std::string> lora;                            // --lora FILE (repeatable): scale 1
  std::vector<std::string> lora_scaled;                     // --lora-scaled FILE SCALE (repeatable): pairs
  std::vector<std::string> control_vector;                  // --control-vector FILE (repeatable): scale 1
  std::vector<std::string> control_vector_scaled;           // --control-vector-scaled FILE SCALE: pairs
  std::vector<int> control_range;                           // --control-vector-layer-range FIRST LAST
};
void add_model_flags(CLI::App& app, ModelFlags& f);
// --lora FILE and --lora-scaled FILE SCALE (each repeatable; the model flags' and `baton plan`'s),
// and the adapters they name (Error(Usage) for a scale that is not a number).
void add_lora_flags(CLI::App& app, std::vector<std::string>& lora, std::vector<std::string>& lora_scaled);
std::vector<LoraFile> lora_files(const std::vector<std::string>& lora, const std::vector<std::string>& lora_scaled);
std::vector<std::string> split_commas(const std::string& s);
// "3,1" → {3, 1}; a part that is not a number → Error(Usage) naming it.
std::vector<double> parse_tensor_split(const std::string& s);
void add_placement_flags(CLI::App& app, PlacementFlags& f);
// The flags into the planner's options: a PlanOptions or a LoadOptions (the fields share names).
template <class Options>
void apply_placement(const PlacementFlags& f, Options& o) {
  o.tensor_split = parse_tensor_split(f.tensor_split);
  o.reserve.clear();
  if (!f.reserve.empty())
    for (const auto& x : split_commas(f.reserve)) o.reserve.push_back(parse_size(x, "--reserve"));
  o.n_gpu_layers = f.n_gpu_layers;
  o.no_cpu_spill = f.no_cpu_spill;
  o.spread = f.spread;
  o.cpu_moe = f.cpu_moe;
}

struct SamplingFlags {
  SamplingParams params;
  std::optional<uint64_t> seed;      // unset: a fresh random seed per request
  int max_tokens = -1;               // -n; < 0: until the model stops or the context is full
  bool ignore_eos = false;           // --ignore-eos: never end at an end-of-generation token
  std::vector<std::string> stop;
  std::string chat_template;         // --chat-template NAME ("" = from the model)
  std::string system;
  bool hide_thinking = false;        // --hide-thinking: a thinking model's reasoning is not shown
  // Constrained replies, at most one: a GBNF grammar (text or file), a JSON Schema (text or
  // file), or --format json (any JSON object).
  std::string grammar, grammar_file, json_schema, json_schema_file, format;
  int lookup = 0;                    // --lookup N: drafts per step by prompt lookup (0: off)
  std::string draft_model;           // --draft-model PATH|NAME: drafts from this model instead
  int draft_max = 8;                 // --draft-max N: most tokens it drafts a step
  std::string draft_devices;         // --draft-devices LIST: where the draft model runs (empty: --devices)
  int logprobs = -1;                 // --logprobs N (run --json, batch): each token's logprob and N alternatives
};
// with_prompt_flags: --system, --chat-template and --hide-thinking too (run, chat, batch).
void add_sampling_flags(CLI::App& app, SamplingFlags& f, bool with_prompt_flags = true);
// The grammar the constraint flags ask for, compiled once; nullptr when none is given. Error(Usage)
// names the flag and what is wrong with its grammar or schema. verbose: a schema's (or --format
// json's) GBNF goes to stderr.
std::shared_ptr<const Grammar> reply_grammar(const SamplingFlags& f, bool verbose = false);
// The same from text: kind is "grammar" (GBNF), "json_schema" (JSON Schema text) or "format"
// ("json", or a JSON Schema as Ollama's format takes it); `what` names the source in errors.
std::shared_ptr<const Grammar> compile_constraint(const std::string& kind, const std::string& text, const std::string& what,
                                                  bool verbose = false);
// The engine's options the flags ask for: prompt lookup, or a draft model loaded now (with the
// target's context, slots and model flags; Error(Usage) if its vocabulary is not the target's).
EngineOptions engine_options(const SamplingFlags& f, const ModelFlags& mf, const Pipeline& target);
// The seed a request runs with: given, or drawn now.
uint64_t resolve_seed(const std::optional<uint64_t>& s);
// --seed's rule (chat's /set seed too): "" for 0 to 2^64-1 or -1 (random), else why not.
std::string check_seed(const std::string& s);
// A seed check_seed accepts: the number, or nullopt for -1 (a random one each time).
std::optional<uint64_t> parse_seed(const std::string& s);
// --logit-bias's rule: "" for TOKEN+BIAS or TOKEN-BIAS (a token id >= 0, a finite bias or -inf), else
// why not; and the pair such a text gives.
std::string check_logit_bias(const std::string& s);
std::pair<int32_t, float> parse_logit_bias(const std::string& s);

// --logprobs N (run, batch): each generated token's logprob and its N most likely alternatives
// (0..kMaxTopLogprobs) in the JSON output.
void add_logprobs_flag(CLI::App& app, SamplingFlags& f);
// Result::logprobs as JSON, one object per generated token: {"id", "token", "logprob", "top_logprobs":
// [{"id", "token", "logprob"}, ...]}; a token whose text is not whole UTF-8 (part of a character)
// also gets "bytes", its bytes as numbers ("token" then shows U+FFFD for them).
nlohmann::json logprobs_json(const Result& r, const Tokenizer& tok);

struct Loaded {
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<Vocab> vocab;
  std::string path;
  double load_ms = 0;
};
// Resolves -m, loads with n_seq slots and output buffers for n_outputs rows a step (0: every token
// of a batch; LoadOptions::n_outputs). A progress bar goes to stderr only when it is a terminal.
Loaded load_model(const ModelFlags& f, int n_seq, int n_outputs = 0);
// The LoadOptions the model flags ask for (no progress bar), for commands that load on their own.
LoadOptions load_options(const ModelFlags& f, int n_seq, int n_outputs = 0);
// The output rows a generation step needs: one per sequence, and one per drafted token
// (--lookup N, or --draft-max N with --draft-model).
int generation_outputs(const SamplingFlags& f, int n_seq);

struct Message {
  std::string role, content;
};
// Turns prompts into tokens: through the model's chat template (or --chat-template), or raw.
class Prompter {
 public:
  Prompter(const Pipeline& pipe, const std::string& template_name);
  ~Prompter();
  // The conversation rendered with the assistant's turn opened.
  std::vector<int32_t> chat(const std::vector<Message>& messages) const;
  // Text as is (BOS when the model wants one; special-token text is parsed).
  std::vector<int32_t> raw(const std::string& text) const;
  const std::string& template_name() const { return name_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string name_;
};

// Ctrl-C: the first press sets the flag (the engine stops between tokens). A second press while the
// flag is still set exits. The handler is installed with SA_RESTART: a press never fails a write,
// and never ends a read either, so each press also writes a byte to a pipe: a wait for input polls
// interrupt_fd() as well, which also sees a press that came just before the wait began (a flag
// alone can miss it: see cli/chat.cpp).
void install_interrupt_handler();
std::atomic<bool>& interrupted();
int interrupt_fd();        // readable while a press is pending; -1 before install_interrupt_handler()
// After a press was dealt with: the pipe drained, then the flag lowered. A byte written by a press
// that lands during the clear, with the flag already down, is stale: readers drop it.
void clear_interrupt();

bool stderr_is_tty();
bool stdin_is_tty();
// Whole file (or stdin for "-") as text, without a leading UTF-8 byte-order mark (Notepad's files
// start with one; it is an encoding mark, not text). Pipes and process substitution read like files.
// Error(Model) naming the path when it does not exist, is a directory or cannot be read.
std::string read_text(const std::string& path);

// A reply as it streams. A thinking model's reasoning (gpt-oss: the harmony analysis channel, the
// engine's on_reasoning) comes first, between "Thinking..." and "...done thinking.": dim on stdout
// when stdout is a terminal, on stderr otherwise (stdout stays the answer alone, for scripts), and
// not at all when hidden. The answer goes to stdout. Models without reasoning print as before.
// When stdout cannot be written, the printer raises interrupted() so that the engine stops; the
// caller then checks stdout (check_stdout()) before treating the reply as interrupted.
class ReplyPrinter {
 public:
  ReplyPrinter(bool show_reasoning, bool stdout_tty) : show_(show_reasoning), tty_(stdout_tty) {}
  // Points the request's on_text and on_reasoning at this printer (which must outlive the request).
  void attach(Request& r);
  void reasoning(std::string_view s);
  void answer(std::string_view s);
  // The reply ended: a reasoning block still open (the reply cut by -n or Ctrl-C) is closed.
  void end();

 private:
  void close_reasoning(bool done);
  bool show_, tty_;
  bool thinking_ = false;  // inside a reasoning block
};

// "1 token" / "3 tokens".
std::string count_of(int n, const char* noun);
// The speed part of run's and chat's stats line: "prompt N tokens<note>, X tok/s | generated M tokens,
// Y tok/s | ttft Z ms" (a speed for 2 tokens or more: it counts the ones after the first), or
// "... | generated nothing" when no token was generated.
std::string speed_stats(const Result& r, const std::string& prompt_note = "");

}  // namespace baton::cli
