// `baton run`: one prompt, one answer streamed to stdout; load time, speeds and the seed to stderr.
// Never interactive. Exit codes: 0 ok, 1 usage, 2 model/file, 3 out of memory, 130 interrupted.
#include <unistd.h>

#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"

namespace baton::cli {
namespace {

struct RunOpts {
  ModelFlags model;
  SamplingFlags sampling;
  std::string prompt, file;
  bool raw = false, json = false;
  const CLI::Option *prompt_opt = nullptr, *file_opt = nullptr;  // given at all (-p '' is an empty prompt)
};

int run(const RunOpts& o) {
  const bool has_p = o.prompt_opt->count() > 0, has_f = o.file_opt->count() > 0;
  if (has_p && has_f) fail(ErrorKind::Usage, "give the prompt with -p or with -f, not both");
  if (!has_p && !has_f) fail(ErrorKind::Usage, "give the prompt with -p TEXT (or -p - for stdin) or -f FILE");
  std::string prompt = !o.file.empty() ? read_text(o.file) : o.prompt == "-" ? read_text("-") : o.prompt;
  if (!o.file.empty() || o.prompt == "-")
    while (!prompt.empty() && (prompt.back() == '\n' || prompt.back() == '\r')) prompt.pop_back();
  if (prompt.empty()) fail(ErrorKind::Usage, "the prompt is empty");
  if (std::string e = o.sampling.params.validate(); !e.empty()) fail(ErrorKind::Usage, "{}", e);
  if (o.sampling.logprobs >= 0 && !o.json) fail(ErrorKind::Usage, "--logprobs needs --json (they are part of its object)");
  std::shared_ptr<const Grammar> grammar = reply_grammar(o.sampling, o.model.verbose);  // a bad one fails before loading

  Loaded m = load_model(o.model, 1, generation_outputs(o.sampling, 1));
  Prompter prompter(*m.pipe, o.sampling.chat_template);
  Request req;
  if (o.raw) {
    req.prompt = prompter.raw(prompt);
  } else {
    std::vector<Message> msgs;
    if (!o.sampling.system.empty()) msgs.push_back({"system", o.sampling.system});
    msgs.push_back({"user", prompt});
    req.prompt = prompter.chat(msgs);
  }
  req.sampling = o.sampling.params;
  req.sampling.seed = resolve_seed(o.sampling.seed);
  req.max_tokens = o.sampling.max_tokens;
  req.ignore_eos = o.sampling.ignore_eos;
  req.stop = o.sampling.stop;
  req.grammar = grammar;
  req.logprobs = o.sampling.logprobs;
  ReplyPrinter printer(!o.sampling.hide_thinking, isatty(STDOUT_FILENO) == 1);
  if (!o.json) printer.attach(req);

  install_interrupt_handler();
  Engine engine(*m.pipe, *m.vocab, engine_options(o.sampling, o.model, *m.pipe));
  Result r = engine.generate(std::move(req), &interrupted());
  printer.end();
  check_stdout();  // a reply stopped because stdout failed is that failure, not a Ctrl-C
  if (!r.error.empty()) fail(ErrorKind::Usage, "{}", r.error);

  if (o.json) {
    nlohmann::json j = {
        {"text", r.text},
        {"tokens", r.completion_tokens()},
        {"prompt_tokens", r.prompt_tokens},
        {"finish_reason", to_string(r.finish)},
        {"seed", r.seed},
        {"timings",
         {{"load_ms", m.load_ms}, {"prompt_ms", r.prompt_ms}, {"prompt_tokens_per_s", r.prompt_tps()},
          {"ttft_ms", r.ttft_ms}, {"gen_ms", r.gen_ms}, {"gen_tokens_per_s", r.gen_tps()}, {"total_ms", r.total_ms}}},
    };
    if (m.vocab->harmony() && !o.sampling.hide_thinking) j["reasoning"] = r.reasoning;  // gpt-oss: the analysis
    if (o.sampling.logprobs >= 0) j["logprobs"] = logprobs_json(r, m.pipe->tokenizer());
    if (o.sampling.lookup > 0 || !o.sampling.draft_model.empty())
      j[o.sampling.draft_model.empty() ? "lookup" : "draft"] = {{"drafted", r.drafted}, {"accepted", r.draft_accepted}};
    // A reply cut by -n inside a character ends in part of its UTF-8 bytes: those become U+FFFD
    // rather than an exception that would lose the reply.
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("\n");
  }
  check_stdout();
  if (r.finish == FinishReason::Context)
    std::fprintf(stderr, "[stopped: the context is full (%d tokens); use a larger --ctx]\n", r.n_ctx);
  std::fprintf(stderr, "load %.0f ms | %s | seed %llu\n", m.load_ms, speed_stats(r).c_str(),
               static_cast<unsigned long long>(r.seed));
  if (r.finish == FinishReason::Cancelled) {
    std::fprintf(stderr, "[interrupted]\n");
    return 130;
  }
  return 0;
}

Register reg{{"run", "Answer one prompt (streams to stdout; never interactive)", [](CLI::App& app) {
  auto o = std::make_shared<RunOpts>();
  add_model_flags(app, o->model);
  add_sampling_flags(app, o->sampling);
  add_logprobs_flag(app, o->sampling);
  o->prompt_opt = app.add_option("-p,--prompt", o->prompt, "the prompt ('-' reads it from stdin)");
  o->file_opt = app.add_option("-f,--file", o->file, "read the prompt from a file");
  app.add_flag("--raw", o->raw, "send the prompt as is, without the chat template");
  app.add_flag("--json", o->json,
               "print one JSON object (text, tokens, finish_reason, timings; reasoning for thinking models; logprobs "
               "with --logprobs) instead of streaming");
  return [o] { return run(*o); };
}}};

}  // namespace
}  // namespace baton::cli
