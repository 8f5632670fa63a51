// `baton batch`: many prompts from a file, up to --parallel of them decoding together (continuous
// batching). One JSON line per request is appended to OUT and flushed the moment it finishes, so a
// crash loses at most the requests in flight, and --resume picks up where a run stopped.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "cli/request_json.h"
#include "gguf/error.h"

namespace baton::cli {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BatchOpts {
  ModelFlags model;
  SamplingFlags sampling;
  std::string in, out;
  int parallel = 4;
  bool resume = false, raw = false;
};

// One input line, parsed: either a request to run or an error record to write.
struct Job : RequestFields {  // the flags' settings, or the line's own
  int line = 0;
  json id;                     // null: the line has no usable id (error records then carry "line")
  bool id_given = false;       // the line's own "id" (else the line number stands in)
  std::string error;
  std::string prompt;          // prompt text, or
  std::vector<Message> messages;
  bool duplicate = false;      // an id seen on an earlier line
};

// The key --resume and the duplicate check compare: the id as JSON text, or the line number.
std::string key_of(const json& id, int line) { return id.is_null() ? fmt::format("line:{}", line) : "id:" + id.dump(); }

// A repeated id is tracked by its line, so its error record never hides the first one's result.
std::string key_of(const Job& j) { return j.duplicate ? key_of(json(), j.line) : key_of(j.id, j.line); }

Job parse_json_line(const std::string& text, int line, const SamplingFlags& defaults,
                    const std::shared_ptr<const Grammar>& default_grammar) {
  Job j;
  static_cast<RequestFields&>(j) = RequestFields::from(defaults, default_grammar);
  j.line = line;
  json v = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) { j.error = "invalid JSON"; return j; }
  if (!v.is_object()) { j.error = "expected a JSON object"; return j; }
  if (v.contains("id")) {
    if (!v["id"].is_string() && !v["id"].is_number_integer()) { j.error = "field 'id' must be a string or an integer"; return j; }
    j.id = v["id"];
    j.id_given = true;
  } else {
    j.id = line;  // like plain text input: the line number
  }
  const bool has_prompt = v.contains("prompt"), has_messages = v.contains("messages");
  if (has_prompt == has_messages) {
    j.error = has_prompt ? "give either 'prompt' or 'messages', not both" : "missing 'prompt' (or 'messages')";
    return j;
  }
  if (has_prompt) {
    if (!v["prompt"].is_string()) { j.error = "field 'prompt' must be a string"; return j; }
    j.prompt = v["prompt"].get<std::string>();
    if (j.prompt.empty()) { j.error = "field 'prompt' is empty"; return j; }
  } else {
    const json& ms = v["messages"];
    if (!ms.is_array() || ms.empty()) { j.error = "field 'messages' must be a non-empty array"; return j; }
    for (const json& m : ms) {
      if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
          !m["content"].is_string()) {
        j.error = "each message needs string fields 'role' and 'content'";
        return j;
      }
      j.messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
  }
  if (std::string e = read_request_fields(v, text, j); !e.empty()) j.error = e;
  return j;
}

// Output file: only whole lines count. A run killed mid-write may leave a partial last line, which
// --resume cuts off before appending.
std::set<std::string> done_keys(const std::string& path) {
  std::set<std::string> keys;
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) fail(ErrorKind::Model, "-o {} is a directory", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return keys;
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t end = all.rfind('\n');
  size_t keep = end == std::string::npos ? 0 : end + 1;
  if (keep < all.size() && truncate(path.c_str(), off_t(keep)) != 0)
    fail(ErrorKind::Usage, "cannot repair the partial last line of {}", path);
  size_t at = 0;
  while (at < keep) {
    size_t nl = all.find('\n', at);
    json v = json::parse(all.substr(at, nl - at), nullptr, false);
    at = nl + 1;
    // Only records count: a request line (in OUT by mistake) has neither a text nor an error.
    if (!v.is_object() || !(v.contains("text") || v.contains("error"))) continue;
    if (v.contains("line") && v["line"].is_number_integer()) keys.insert(key_of(json(), v["line"].get<int>()));
    else if (v.contains("id")) keys.insert(key_of(v["id"], 0));
  }
  return keys;
}


std::string record_line(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"; }

json error_record(const Job& j, const std::string& msg) {
  json r;
  if (!j.id.is_null()) r["id"] = j.id;
  if (j.id.is_null() || j.duplicate) r["line"] = j.line;
  r["error"] = msg;
  return r;
}

void draw_progress(int done, int total, double tps, double eta_s) {
  const int width = 24;
  int fill = total ? done * width / total : width;
  std::fprintf(stderr, "\r[%s%s] %d/%d  %.1f tok/s  ETA %d:%02d \033[K", std::string(size_t(fill), '#').c_str(),
               std::string(size_t(width - fill), ' ').c_str(), done, total, tps, int(eta_s) / 60, int(eta_s) % 60);
  std::fflush(stderr);
}

int run(const BatchOpts& o) {
  if (std::string e = o.sampling.params.validate(); !e.empty()) fail(ErrorKind::Usage, "{}", e);
  if (o.resume && o.out == "-") fail(ErrorKind::Usage, "--resume needs an output file, not stdout (-o -)");
  // OUT is truncated (or appended to) before IN is read to its end: the same file would lose its requests.
  if ((o.in == o.out && o.in != "-") || same_file(o.in, o.out))
    fail(ErrorKind::Usage, "-i {} and -o {} are the same file: the records would overwrite the requests", o.in, o.out);
  refuse_model_output("-o", o.out, o.model.model, o.sampling.draft_model);
  const std::shared_ptr<const Grammar> grammar = reply_grammar(o.sampling, o.model.verbose);
  const auto [lines, jsonl] = read_input_lines(o.in);  // JSONL, or one plain prompt per line

  std::vector<Job> jobs;
  for (size_t i = 0; i < lines.size(); i++) {
    const std::string& l = lines[i];
    if (l.find_first_not_of(" \t") == std::string::npos) continue;
    int line = int(i + 1);
    if (jsonl) {
      jobs.push_back(parse_json_line(l, line, o.sampling, grammar));
    } else {
      Job j;
      static_cast<RequestFields&>(j) = RequestFields::from(o.sampling, grammar);
      j.line = line;
      j.id = line;
      j.prompt = l;
      jobs.push_back(std::move(j));
    }
  }
  // Repeated ids: the first one runs, the repeats get error records.
  std::map<std::string, int> first_line;
  for (auto& j : jobs) {
    if (j.id.is_null()) continue;
    auto [it, fresh] = first_line.emplace(key_of(j.id, 0), j.line);
    if (fresh) continue;
    j.duplicate = true;
    j.error = j.id_given ? fmt::format("duplicate id (first on line {})", it->second)
                         : fmt::format("this line has no id and its line number {} is line {}'s id: give it an \"id\"",
                                       j.line, it->second);
  }
  std::set<std::string> skip;
  if (o.resume) skip = done_keys(o.out);

  std::vector<const Job*> todo;
  for (const auto& j : jobs)
    if (!skip.count(key_of(j))) todo.push_back(&j);
  RecordFile out(o.out, o.resume);  // "-": stdout (records only; the progress and the summary go to stderr)
  if (jobs.empty()) {
    out.begin();
    std::fprintf(stderr, "nothing to do: %s has no requests\n", o.in.c_str());
    return 0;
  }
  if (todo.empty()) {
    std::fprintf(stderr, "nothing to do: all %zu requests are already in %s\n", jobs.size(), o.out.c_str());
    return 0;
  }

  Loaded m = load_model(o.model, o.parallel, generation_outputs(o.sampling, o.parallel));
  out.begin();
  Prompter prompter(*m.pipe, o.sampling.chat_template);
  Engine engine(*m.pipe, *m.vocab, engine_options(o.sampling, o.model, *m.pipe));
  const bool harmony = m.vocab->harmony();  // replies carry reasoning apart from the text
  install_interrupt_handler();

  const bool tty = stderr_is_tty();
  const int total = int(todo.size());
  int n_done = 0, n_ok = 0, n_failed = 0;
  long gen_tokens = 0, prompt_tokens = 0, prompt_evaluated = 0, drafted = 0, drafts_kept = 0;
  auto t0 = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  auto progress = [&] {
    if (!tty) return;
    double s = elapsed();
    double eta = n_done ? s / n_done * (total - n_done) : 0;
    draw_progress(n_done, total, s > 0 ? gen_tokens / s : 0, eta);
  };
  auto record_error = [&](const Job& j, const std::string& msg) {
    out.write(record_line(error_record(j, msg)));
    n_done++;
    n_failed++;
    progress();
  };

  size_t next = 0;
  Engine::Source source = [&]() -> std::optional<Request> {
    while (next < todo.size()) {
      const Job& j = *todo[next];
      uint64_t tag = next++;
      if (!j.error.empty()) { record_error(j, j.error); continue; }
      Request r;
      try {
        if (o.raw && !j.prompt.empty()) {
          r.prompt = prompter.raw(j.prompt);
        } else {
          std::vector<Message> msgs;
          if (!o.sampling.system.empty() && (j.messages.empty() || j.messages[0].role != "system"))
            msgs.push_back({"system", o.sampling.system});
          if (!j.prompt.empty()) msgs.push_back({"user", j.prompt});
          msgs.insert(msgs.end(), j.messages.begin(), j.messages.end());
          r.prompt = prompter.chat(msgs);
        }
      } catch (const Error& e) {
        record_error(j, e.what());
        continue;
      }
      j.apply(r);
      r.tag = tag;
      return r;
    }
    return std::nullopt;
  };
  Engine::Sink sink = [&](Result&& r) {
    const Job& j = *todo[r.tag];
    if (!r.error.empty()) return record_error(j, r.error);
    if (r.finish == FinishReason::Cancelled) return;  // in flight at Ctrl-C: left for --resume
    json rec{{"id", j.id}, {"text", r.text}, {"prompt_tokens", r.prompt_tokens},
             {"completion_tokens", r.completion_tokens()}, {"finish_reason", to_string(r.finish)},
             {"ms", int64_t(r.total_ms + 0.5)}, {"seed", r.seed}};
    if (harmony && !o.sampling.hide_thinking) rec["reasoning"] = r.reasoning;  // gpt-oss: the analysis
    if (j.logprobs >= 0) rec["logprobs"] = logprobs_json(r, m.pipe->tokenizer());
    out.write(record_line(rec));
    n_done++;
    n_ok++;
    gen_tokens += r.completion_tokens();
    prompt_tokens += r.prompt_tokens;
    prompt_evaluated += r.prompt_evaluated;
    drafted += r.drafted;
    drafts_kept += r.draft_accepted;
    progress();
  };
  progress();
  engine.run(source, sink, o.parallel, &interrupted());
  if (tty) std::fprintf(stderr, "\r\033[K");
  double s = elapsed();
  const std::string lookup = drafted > 0 ? fmt::format(" | {}/{} drafts kept", drafts_kept, drafted) : "";
  // Prompt tokens a slot had cached, or copied from another slot's shared start, were not evaluated.
  const std::string reused =
      prompt_evaluated < prompt_tokens ? fmt::format(" ({} evaluated)", prompt_evaluated) : "";
  std::fprintf(stderr, "%d ok, %d failed%s | %ld prompt%s + %ld generated tokens | %.1f s | %.1f generated tok/s%s\n",
               n_ok, n_failed, interrupted() ? fmt::format(", {} not done (interrupted)", total - n_done).c_str() : "",
               prompt_tokens, reused.c_str(), gen_tokens, s, s > 0 ? gen_tokens / s : 0.0, lookup.c_str());
  return interrupted() ? 130 : 0;
}

Register reg{{"batch", "Generate for many prompts (JSONL or text, one per line) with continuous batching", [](CLI::App& app) {
  auto o = std::make_shared<BatchOpts>();
  add_model_flags(app, o->model);
  add_sampling_flags(app, o->sampling);
  add_logprobs_flag(app, o->sampling);
  app.add_option("-i,--input", o->in, "input: JSONL ({\"id\", \"prompt\"|\"messages\", ...}) or plain text, one prompt per line ('-': stdin)")->required();
  app.add_option("-o,--output", o->out, "output JSONL: one line per request, appended as each finishes ('-': stdout)")
      ->required()
      ->check(not_empty("the path"));
  app.add_option("--parallel", o->parallel, "requests decoding together")->check(in_range(1, 256))->capture_default_str();
  app.add_flag("--resume", o->resume, "keep OUT and skip the ids already in it (otherwise OUT is overwritten)");
  app.add_flag("--raw", o->raw, "send prompts as is, without the chat template");
  return [o] { return run(*o); };
}}};

}  // namespace
}  // namespace baton::cli
