#include "runtime/perplexity.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "quant/types.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

namespace baton {

namespace {

// Base files: an 8-byte tag, int32 n_ctx, n_vocab and n_chunks, then per chunk its n_ctx tokens
// (int32, as tokenized: before BOS replaces the first) and its scored rows (n_ctx − 1 − n_ctx/2 of
// them) of n_vocab fp16 log-probabilities. Little-endian, no padding. n_chunks is written last, so
// a run stopped early (Ctrl-C) leaves a file of the chunks it finished.
constexpr char kBaseTag[8] = {'B', 'A', 'T', 'O', 'N', 'K', 'L', '1'};
constexpr size_t kPieceRows = 128;  // scored rows evaluated (and held as floats) at a time

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

void read_exact(std::FILE* f, void* dst, size_t bytes, const std::string& path) {
  if (std::fread(dst, 1, bytes, f) != bytes)
    fail(ErrorKind::Usage, "{}: the base file ends early (truncated, or not written by --save-base)", path);
}

void write_exact(std::FILE* f, const void* src, size_t bytes, const std::string& path) {
  if (std::fwrite(src, 1, bytes, f) != bytes) fail(ErrorKind::Usage, "writing {} failed (disk full?)", path);
}

double mean_error(double sum, double sum2, int64_t n) {
  if (n < 2) return 0;
  const double m = sum / double(n);
  const double var = sum2 / double(n) - m * m;
  return var > 0 ? std::sqrt(var / double(n - 1)) : 0;
}

// One scored row: what the totals need from it.
struct RowScore {
  double nll = 0, base_nll = 0, kld = 0;
  bool same_top = false;
};

// Scores rows [0, n_rows) of one chunk; `targets[i]` is row i's next token. With `save`, writes row
// i's log-probabilities as fp16 to save[i·V ...]; with `base`, compares with base[i·V ...].
void score_rows(const float* logits, int n_rows, int V, const int32_t* targets, uint16_t* save, const uint16_t* base,
                RowScore* out, int n_threads) {
  auto work = [&](int r0, int r1) {
    for (int i = r0; i < r1; ++i) {
      const float* x = logits + size_t(i) * V;
      const int top = cpu::argmax(x, V);
      const double lse = cpu::log_sum_exp(x, V);  // log Σ e^x
      RowScore& s = out[i];
      s.nll = lse - double(x[targets[i]]);
      if (save) {
        uint16_t* d = save + size_t(i) * V;
        for (int v = 0; v < V; ++v) d[v] = f32_to_fp16(float(double(x[v]) - lse));
      }
      if (base) {
        const uint16_t* b = base + size_t(i) * V;
        double kl = 0, bsum = 0;
        float bmax = -INFINITY;
        int btop = 0;
        for (int v = 0; v < V; ++v) {
          const double lb = fp16_to_f32(b[v]);
          if (lb > bmax) bmax = float(lb), btop = v;
          const double pb = std::exp(lb);
          bsum += pb;
          kl += pb * (lb - (double(x[v]) - lse));
        }
        // fp16 rounding leaves the base's probabilities summing to 1 ± ~1e-3: renormalise them.
        s.kld = std::max(0.0, kl / bsum - std::log(bsum));
        s.base_nll = -double(fp16_to_f32(b[targets[i]])) + std::log(bsum);
        s.same_top = btop == top;
      }
    }
  };
  const int T = std::max(1, std::min(n_threads, n_rows));
  std::vector<std::thread> pool;
  for (int t = 1; t < T; ++t) pool.emplace_back(work, n_rows * t / T, n_rows * (t + 1) / T);
  work(0, n_rows / T);
  for (auto& th : pool) th.join();
}

}  // namespace

double PerplexityStats::ppl() const { return count ? std::exp(nll / double(count)) : 0; }
double PerplexityStats::ppl_error() const { return ppl() * mean_error(nll, nll2, count); }
double PerplexityStats::base_ppl() const { return count ? std::exp(base_nll / double(count)) : 0; }
double PerplexityStats::kld_mean() const { return count ? kld / double(count) : 0; }
double PerplexityStats::kld_error() const { return mean_error(kld, kld2, count); }
double PerplexityStats::same_top_fraction() const { return count ? double(same_top) / double(count) : 0; }
double PerplexityStats::nll_correlation() const {
  if (count < 2) return 0;
  const double n = double(count), ma = nll / n, mb = base_nll / n;
  const double va = nll2 / n - ma * ma, vb = base_nll2 / n - mb * mb;
  return va > 0 && vb > 0 ? (cross / n - ma * mb) / std::sqrt(va * vb) : 0;
}

double token_nll(const float* logits, int n_vocab, int32_t token) {
  float mx = logits[0];
  for (int v = 1; v < n_vocab; ++v) mx = std::max(mx, logits[v]);
  double sum = 0;
  for (int v = 0; v < n_vocab; ++v) sum += std::exp(double(logits[v] - mx));
  return double(mx) + std::log(sum) - double(logits[token]);
}

int perplexity_chunks(size_t n_tokens, const PerplexityOptions& opt) {
  const int all = opt.n_ctx > 0 ? int(n_tokens / size_t(opt.n_ctx)) : 0;
  return opt.max_chunks >= 0 ? std::min(all, opt.max_chunks) : all;
}

PerplexityStats perplexity(Pipeline& p, const std::vector<int32_t>& tokens, const PerplexityOptions& opt,
                           const std::function<void(const PerplexityStats&)>& on_chunk,
                           const std::atomic<bool>* cancel) {
  const int n_ctx = opt.n_ctx, V = p.n_vocab();
  if (n_ctx < 4) fail(ErrorKind::Usage, "a chunk of {} tokens is too short to score (-c: at least 4)", n_ctx);
  if (n_ctx > p.n_ctx()) fail(ErrorKind::Usage, "chunks of {} tokens do not fit the context of {}", n_ctx, p.n_ctx());
  if (tokens.size() < size_t(n_ctx))
    fail(ErrorKind::Usage, "the text has {} tokens, fewer than one chunk of {} (-c): give a longer text or a smaller -c",
         tokens.size(), n_ctx);
  int n_chunks = perplexity_chunks(tokens.size(), opt);
  if (n_chunks == 0) fail(ErrorKind::Usage, "--chunks 0: nothing to score");
  const int first = n_ctx / 2, n_rows = n_ctx - 1 - first;
  const size_t row_block = size_t(n_rows) * size_t(V);  // values per chunk in a base file

  const size_t chunk_bytes = size_t(n_ctx) * sizeof(int32_t) + row_block * sizeof(uint16_t);
  constexpr long kHeadBytes = long(sizeof kBaseTag) + 3 * long(sizeof(int32_t));
  FilePtr base;
  if (!opt.kl_base.empty()) {  // checked whole before anything runs
    base.reset(std::fopen(opt.kl_base.c_str(), "rb"));
    if (!base) fail(ErrorKind::Usage, "cannot open the base file {}", opt.kl_base);
    char tag[8];
    int32_t head[3];
    read_exact(base.get(), tag, sizeof tag, opt.kl_base);
    if (std::memcmp(tag, kBaseTag, sizeof tag) != 0)
      fail(ErrorKind::Usage, "{} is not a base file written by `baton perplexity --save-base`", opt.kl_base);
    read_exact(base.get(), head, sizeof head, opt.kl_base);
    if (head[0] != n_ctx)
      fail(ErrorKind::Usage, "{} was written with -c {}, this run has -c {}", opt.kl_base, head[0], n_ctx);
    if (head[1] != V)
      fail(ErrorKind::Usage, "{} has a vocabulary of {} tokens, this model {}: compare models that share a tokenizer",
           opt.kl_base, head[1], V);
    if (head[2] <= 0) fail(ErrorKind::Usage, "{} holds no chunks", opt.kl_base);
    n_chunks = std::min(n_chunks, head[2]);
    std::vector<int32_t> chunk_tokens(static_cast<size_t>(n_ctx));
    for (int c = 0; c < n_chunks; ++c) {
      if (std::fseek(base.get(), kHeadBytes + long(size_t(c) * chunk_bytes), SEEK_SET) != 0)
        fail(ErrorKind::Usage, "{}: the base file ends early", opt.kl_base);
      read_exact(base.get(), chunk_tokens.data(), chunk_tokens.size() * sizeof(int32_t), opt.kl_base);
      if (!std::equal(chunk_tokens.begin(), chunk_tokens.end(), tokens.begin() + ptrdiff_t(c) * n_ctx))
        fail(ErrorKind::Usage, "{} was computed on other tokens (chunk {} differs): give the same text (-f) to a model "
             "with the same tokenizer", opt.kl_base, c + 1);
    }
    if (std::fseek(base.get(), kHeadBytes + long(size_t(n_chunks - 1) * chunk_bytes + chunk_bytes) - 1, SEEK_SET) != 0 ||
        std::fgetc(base.get()) == EOF)
      fail(ErrorKind::Usage, "{}: the base file ends early (truncated?)", opt.kl_base);
    std::fseek(base.get(), kHeadBytes, SEEK_SET);
  }
  FilePtr save;
  if (!opt.save_base.empty()) {
    save.reset(std::fopen(opt.save_base.c_str(), "wb"));
    if (!save) fail(ErrorKind::Usage, "cannot open {} for writing", opt.save_base);
    const int32_t head[3] = {n_ctx, V, 0};  // the chunk count goes in at the end
    write_exact(save.get(), kBaseTag, sizeof kBaseTag, opt.save_base);
    write_exact(save.get(), head, sizeof head, opt.save_base);
  }

  const Tokenizer& tok = p.tokenizer();
  const bool add_bos = tok.add_bos() && tok.bos() >= 0;
  const int slots = std::max(1, std::min(p.n_seq(), p.max_in_flight()));
  // With chunks in flight the stages keep the cores busy while a chunk is scored: one thread then.
  const int score_threads = slots > 1 ? 1 : opt.n_threads;
  // A chunk goes in pieces of at most kPieceRows scored rows (the first piece with the unscored
  // half before them), so the rows held are bounded whatever -c and the vocabulary; up to `slots`
  // pieces are in flight, each with its own buffer. A chunk's last token is never evaluated: no
  // row scores what follows it.
  const size_t piece_rows = std::min<size_t>(size_t(n_rows), kPieceRows);
  const size_t piece_block = piece_rows * size_t(V);
  std::vector<std::vector<float>> logits(static_cast<size_t>(slots), std::vector<float>(piece_block));
  std::vector<uint16_t> save_rows(save ? piece_block : 0), base_rows(base ? piece_block : 0);
  std::vector<RowScore> scores(piece_rows);
  struct InFlight {
    int chunk, r0, r1;  // its scored rows [r0, r1) of the chunk's n_rows
    size_t buf;
    uint64_t ticket;
  };
  std::deque<InFlight> flight;
  PerplexityStats st;

  auto finish_front = [&] {
    const InFlight f = flight.front();
    flight.pop_front();
    p.wait(f.ticket);
    const int n = f.r1 - f.r0;
    const int32_t* chunk = tokens.data() + size_t(f.chunk) * size_t(n_ctx);
    if (base) {
      if (f.r0 == 0) std::fseek(base.get(), long(size_t(n_ctx) * sizeof(int32_t)), SEEK_CUR);  // its tokens: checked above
      read_exact(base.get(), base_rows.data(), size_t(n) * size_t(V) * sizeof(uint16_t), opt.kl_base);
    }
    score_rows(logits[f.buf].data(), n, V, chunk + first + f.r0 + 1, save ? save_rows.data() : nullptr,
               base ? base_rows.data() : nullptr, scores.data(), score_threads);
    if (save) {
      if (f.r0 == 0) write_exact(save.get(), chunk, size_t(n_ctx) * sizeof(int32_t), opt.save_base);
      write_exact(save.get(), save_rows.data(), size_t(n) * size_t(V) * sizeof(uint16_t), opt.save_base);
    }
    for (int i = 0; i < n; ++i) {
      const RowScore& s = scores[size_t(i)];
      st.nll += s.nll;
      st.nll2 += s.nll * s.nll;
      if (base) {
        st.base_nll += s.base_nll;
        st.base_nll2 += s.base_nll * s.base_nll;
        st.cross += s.nll * s.base_nll;
        st.kld += s.kld;
        st.kld2 += s.kld * s.kld;
        st.same_top += s.same_top;
        st.kld_values.push_back(float(s.kld));
      }
    }
    st.count += n;
    if (f.r1 == n_rows) {
      ++st.chunks;
      if (on_chunk) on_chunk(st);
    }
  };

  Batch b;
  size_t submitted = 0;
  for (int c = 0; c < n_chunks; ++c) {
    // The slot this chunk takes was the chunk `slots` before's: that one must be finished.
    while (!flight.empty() && flight.front().chunk <= c - slots) finish_front();
    if (cancel && cancel->load()) break;
    const int slot = c % slots;
    p.truncate_seq(slot, 0);
    const int32_t* t = tokens.data() + size_t(c) * size_t(n_ctx);
    for (int r0 = 0; r0 < n_rows; r0 += int(piece_rows)) {
      const int r1 = std::min(n_rows, r0 + int(piece_rows));
      if (int(flight.size()) == slots) finish_front();
      b.clear();
      for (int k = r0 == 0 ? 0 : first + r0; k < first + r1; ++k)
        b.add(k == 0 && add_bos ? tok.bos() : t[k], int32_t(k), int32_t(slot), k >= first + r0);
      const size_t buf = submitted++ % size_t(slots);
      flight.push_back({c, r0, r1, buf, p.submit(b, logits[buf].data())});
    }
  }
  while (!flight.empty()) finish_front();
  if (save) {
    const int32_t done = st.chunks;
    if (std::fseek(save.get(), kHeadBytes - long(sizeof done), SEEK_SET) != 0) fail(ErrorKind::Usage, "writing {} failed", opt.save_base);
    write_exact(save.get(), &done, sizeof done, opt.save_base);
    if (std::fflush(save.get()) != 0) fail(ErrorKind::Usage, "writing {} failed (disk full?)", opt.save_base);
  }
  return st;
}

}  // namespace baton
