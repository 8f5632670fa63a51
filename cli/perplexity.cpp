// `baton perplexity`: how well a model predicts a text, as llama-perplexity measures it (chunks of
// -c tokens, each chunk's second half scored), and, against a base run's saved log-probabilities,
// the KL divergence a quantization costs. The computation is runtime/perplexity.h.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/model_files.h"
#include "runtime/perplexity.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

namespace baton::cli {
namespace {

struct PplOpts {
  ModelFlags model;
  std::string file;
  int chunks = -1;
  int parallel = 4;
  std::string save_base, kl_base;
  bool json = false;
};

// The q-quantile of sorted values (linear between neighbours).
double quantile(const std::vector<float>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double at = q * double(sorted.size() - 1);
  const size_t lo = size_t(at);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return double(sorted[lo]) + (at - double(lo)) * double(sorted[hi] - sorted[lo]);
}

int run(const PplOpts& o) {
  if (!o.save_base.empty() && (o.save_base == o.kl_base || same_file(o.save_base, o.kl_base)))
    fail(ErrorKind::Usage, "--save-base and --kl-base name the same file");
  if (!o.save_base.empty() && ((o.save_base == o.file && o.file != "-") || same_file(o.save_base, o.file)))
    fail(ErrorKind::Usage, "--save-base {} and -f {} are the same file: the base would overwrite the text", o.save_base,
         o.file);
  refuse_model_output("--save-base", o.save_base, o.model.model);
  const std::string text = read_text(o.file);
  if (text.empty()) fail(ErrorKind::Usage, "{} is empty", o.file == "-" ? std::string("stdin") : o.file);
  ModelFlags mf = o.model;
  PerplexityOptions po;
  po.n_ctx = mf.ctx > 0 ? mf.ctx : 512;
  mf.ctx = po.n_ctx;
  po.max_chunks = o.chunks;
  po.save_base = o.save_base;
  po.kl_base = o.kl_base;

  // Tokenized before loading (as llama-perplexity: the model's BOS when it adds one, special-token
  // text left as text), so that a text too short for one chunk is refused before the KV cache
  // of -c tokens per slot is allocated.
  std::vector<int32_t> tokens;
  {
    const auto file = gguf::File::open(resolve_model(mf.model));
    tokens = Tokenizer::from_gguf(*file).encode(text, /*add_special=*/true, /*parse_special=*/false);
  }
  if (tokens.size() < size_t(po.n_ctx))
    fail(ErrorKind::Usage, "the text has {} tokens, fewer than one chunk of {} (-c): give a longer text or a smaller -c",
         tokens.size(), po.n_ctx);
  const int n_chunks = perplexity_chunks(tokens.size(), po);
  if (n_chunks == 0) fail(ErrorKind::Usage, "--chunks 0: nothing to score");
  Loaded m = load_model(mf, std::min(o.parallel, n_chunks), kPerplexityPieceRows);
  Pipeline& p = *m.pipe;
  po.n_threads = std::max(1, o.model.threads > 0 ? o.model.threads : int(std::thread::hardware_concurrency()));
  std::fprintf(stderr, "%zu tokens: %d chunk%s of %d, the last %d tokens of each scored%s\n", tokens.size(), n_chunks,
               n_chunks == 1 ? "" : "s", po.n_ctx, po.n_ctx - 1 - po.n_ctx / 2,
               o.kl_base.empty() ? "" : fmt::format(", compared with {}", o.kl_base).c_str());
  install_interrupt_handler();
  const auto t0 = std::chrono::steady_clock::now();
  const PerplexityStats st = perplexity(p, tokens, po, [&](const PerplexityStats& s) {
    if (o.json) return;
    std::printf("[%d]%.4f,", s.chunks, s.ppl());
    if (!flush_stdout()) interrupted().store(true);  // nobody reads the rest: stop, and say why below
  }, &interrupted());
  check_stdout();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!o.json) std::printf("\n");
  flush_stdout();
  if (st.chunks == 0) {
    std::fprintf(stderr, "interrupted before the first chunk finished\n");
    return 130;
  }
  const bool cmp = !o.kl_base.empty();
  std::vector<float> kld = st.kld_values;
  std::sort(kld.begin(), kld.end());
  if (o.json) {
    nlohmann::json r = {{"chunks", st.chunks}, {"n_ctx", po.n_ctx}, {"tokens_scored", st.count},
                        {"ppl", st.ppl()}, {"ppl_error", st.ppl_error()}, {"seconds", secs}};
    if (cmp)
      r["kl"] = {{"base_ppl", st.base_ppl()}, {"ppl_ratio", st.ppl() / st.base_ppl()},
                 {"nll_correlation", st.nll_correlation()}, {"kld_mean", st.kld_mean()},
                 {"kld_error", st.kld_error()}, {"kld_median", quantile(kld, 0.5)}, {"kld_p99", quantile(kld, 0.99)},
                 {"kld_max", kld.back()}, {"same_top", st.same_top_fraction()}};
    std::printf("%s\n", r.dump().c_str());
  } else {
    std::printf("Final estimate: PPL = %.4f +/- %.5f\n", st.ppl(), st.ppl_error());
    if (cmp) {
      std::printf("Base PPL        %.4f (this / base = %.4f)\n", st.base_ppl(), st.ppl() / st.base_ppl());
      std::printf("Cor(NLL, base)  %.2f %%\n", 100 * st.nll_correlation());
      std::printf("Mean KLD        %.6f +/- %.6f\n", st.kld_mean(), st.kld_error());
      std::printf("KLD median      %.6f, 99th percentile %.6f, max %.6f\n", quantile(kld, 0.5), quantile(kld, 0.99),
                  double(kld.back()));
      std::printf("Same top token  %.3f %%\n", 100 * st.same_top_fraction());
    }
  }
  flush_stdout();
  std::fprintf(stderr, "%d chunk%s, %lld token%s scored | %.2f s | %.1f tok/s evaluated%s\n", st.chunks,
               st.chunks == 1 ? "" : "s", (long long)st.count, st.count == 1 ? "" : "s", secs, secs > 0 ? double(st.chunks) * po.n_ctx / secs : 0.0,
               o.save_base.empty() ? "" : fmt::format(" | base written to {}", o.save_base).c_str());
  return interrupted() ? 130 : 0;
}

Register reg{{"perplexity", "Perplexity of a text file (as llama-perplexity), and KL divergence from a saved base run",
  [](CLI::App& app) {
    auto o = std::make_shared<PplOpts>();
    add_model_flags(app, o->model);
    app.get_option("--ctx")->description("tokens per chunk (default 512); each chunk's second half is scored");
    app.add_option("-f,--file", o->file, "the text ('-': stdin)")->required();
    app.add_option("--chunks", o->chunks, "score at most this many chunks (default: all the text makes)")
        ->check(at_least(0));
    app.add_option("--parallel", o->parallel, "chunks in flight at once (sequence slots; stages overlap on them)")
        ->check(in_range(1, 64))
        ->capture_default_str();
    app.add_option("--save-base", o->save_base,
                   "write each scored token's log-probabilities (fp16, vocabulary × 2 bytes per token) for --kl-base")
        ->check(not_empty("the path"));
    app.add_option("--kl-base", o->kl_base,
                   "compare with a base of the same text (--save-base, or llama-perplexity's --kl-divergence-base): "
                   "KL divergence, same top token, PPL ratio")
        ->check(not_empty("the path"));
    app.add_flag("--json", o->json, "one JSON object at the end instead of the text report");
    return [o] { return run(*o); };
  }}};

}  // namespace
}  // namespace baton::cli
