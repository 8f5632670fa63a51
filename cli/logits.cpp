// `baton logits`: evaluate a prompt in one batch and write every position's logits as float32
// [n_tokens × n_vocab], row-major, no header (the format of llama.cpp's reference dumps).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/distributed.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/model_files.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

namespace baton {
namespace {

struct Opts {
  cli::ModelFlags f;  // the model and device flags of run/bench (--devices, --tensor-split, --p2p, ...)
  std::string prompt, out, tokens_out, tokens;
  bool batch_given = false;  // --batch-size given: pieces of that size instead of the whole prompt
  int outputs = 0;           // --outputs: logit rows a forward holds at most (0: all of its tokens)
};

// "-" is stdout, the same bytes as a file (to pipe them into another program).
void write_file(const std::string& path, const void* data, size_t bytes) {
  if (path == "-") {
    cli::write_stdout({static_cast<const char*>(data), bytes});
    cli::check_stdout();
    return;
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail(ErrorKind::Model, "cannot open '{}' for writing: {}", path, std::strerror(errno));
  const size_t put = std::fwrite(data, 1, bytes, f);
  const int e = errno;
  if (std::fclose(f) != 0 || put != bytes) fail(ErrorKind::Model, "writing '{}' failed: {}", path, std::strerror(e ? e : errno));
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::istringstream in(s);
  std::string w;
  while (in >> w) {
    size_t used = 0;
    long v = -1;
    try { v = std::stol(w, &used); } catch (const std::exception&) { used = 0; }
    if (used != w.size() || v < 0 || v > INT32_MAX) fail(ErrorKind::Usage, "--tokens: '{}' is not a token id", w);
    ids.push_back(int32_t(v));
  }
  return ids;
}

int run(const Opts& o) {
  LoadOptions lo = cli::load_options(o.f, 1, o.outputs);
  const std::string path = resolve_model(o.f.model);
  std::vector<int32_t> ids;
  if (!o.tokens.empty()) {
    ids = parse_ids(o.tokens);
  } else {  // tokenize first: the batch size is the prompt length ("one batch")
    auto file = gguf::File::open(path);
    ids = Tokenizer::from_gguf(*file).encode(o.prompt, /*add_special=*/true, /*parse_special=*/true);
  }
  if (!o.batch_given) lo.n_batch = std::max<int>(1, int(ids.size()));
  std::unique_ptr<Pipeline> p = o.f.distributed ? load_distributed(path, lo) : Pipeline::load(path, lo);
  if (ids.empty()) fail(ErrorKind::Usage, "the prompt has no tokens");
  if (int(ids.size()) > p->n_ctx())
    fail(ErrorKind::Usage, "the prompt has {} tokens but the context is {} (--ctx)", ids.size(), p->n_ctx());

  Batch b;
  for (size_t i = 0; i < ids.size(); ++i) b.add(ids[i], int32_t(i), 0, true);
  std::vector<float> logits(ids.size() * size_t(p->n_vocab()));
  p->decode(b, logits.data());
  write_file(o.out, logits.data(), logits.size() * sizeof(float));
  if (!o.tokens_out.empty()) {
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += fmt::format("{}{}", i ? " " : "", ids[i]);
    line += "\n";
    write_file(o.tokens_out, line.data(), line.size());
  }
  std::fprintf(stderr, "%zu tokens x %d logits -> %s\n", ids.size(), p->n_vocab(),
               o.out == "-" ? "standard output" : o.out.c_str());
  return 0;
}

cli::Register reg{{"logits", "Evaluate a prompt in one batch and write float32 logits [n_tokens x n_vocab]",
  [](CLI::App& app) {
    auto o = std::make_shared<Opts>();
    cli::add_model_flags(app, o->f);
    CLI::Option* batch = app.get_option("--batch-size");
    batch->description("tokens per forward (default: the whole prompt in one)");
    CLI::Option* text = app.add_option("-p,--prompt", o->prompt, "Prompt text (BOS added as the model says)");
    CLI::Option* tokens = app.add_option("--tokens", o->tokens, "Token ids instead of a prompt, e.g. \"1 450 4996\"");
    text->excludes(tokens);
    tokens->excludes(text);
    app.add_option("--out", o->out, "Output file for the logits ('-': stdout, binary)")
        ->required()
        ->check(cli::not_empty("the path"));
    app.add_option("--tokens-out", o->tokens_out, "Also write the token ids (one line; '-': stdout)")
        ->check(cli::not_empty("the path"));
    app.add_option("--outputs", o->outputs,
                   "logit rows one forward computes and holds at most (default: all its tokens'); fewer means "
                   "smaller output buffers (n_vocab floats a row) and the prompt in more forwards, the same logits")
        ->check(cli::in_range(1, 1 << 20));
    CLI::Option* prompt = app.get_option("--prompt");
    return [o, batch, prompt] {
      if (o->prompt.empty() && o->tokens.empty())
        fail(ErrorKind::Usage, "{}", prompt->count() > 0 ? "the prompt is empty" : "give -p PROMPT or --tokens IDS");
      // The second file written would replace the first.
      if (!o->tokens_out.empty() && (o->out == o->tokens_out || cli::same_file(o->out, o->tokens_out)))
        fail(ErrorKind::Usage, "--out {} and --tokens-out {} are the same file", o->out, o->tokens_out);
      cli::refuse_model_output("--out", o->out, o->f.model);
      cli::refuse_model_output("--tokens-out", o->tokens_out, o->f.model);
      o->batch_given = batch->count() > 0;
      return run(*o);
    };
  }}};

}  // namespace
}  // namespace baton
