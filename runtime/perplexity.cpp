#include "runtime/perplexity.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/threadpool.h"
#include "quant/types.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

namespace baton {

namespace {

// Base files. Two formats are read, told apart by their first 8 bytes; both are little-endian with
// no padding, and both hold the same rows: a chunk's scored positions n_ctx/2 … n_ctx − 2, in order.
//
// Baton's own (--save-base writes it): the tag BATONKL1, int32 n_ctx, n_vocab and n_chunks, then
// per chunk its n_ctx tokens (int32, as tokenized: before BOS replaces the first) and its
// n_ctx − 1 − n_ctx/2 rows of n_vocab fp16 log-probabilities. n_chunks is written last, so a run
// stopped early (Ctrl-C) leaves a file of the chunks it finished.
//
// llama-perplexity's (--kl-divergence-base FILE without --kl-divergence writes it): the tag
// "_logits_", int32 n_ctx, n_vocab and n_chunks, then the tokens of all the chunks (n_chunks ×
// n_ctx int32, as tokenized), then per chunk its n_ctx − 1 − n_ctx/2 rows. A row is 4 + n_vocab
// uint16 rounded up to an even count: two floats, scale and floor, then one q per token with
// log p = floor + scale·q. It spans the row's top 16 nats (its whole range if narrower) in 65535
// steps; a token below them is stored as q = 0, at the floor. So a log p at or below −16 says
// little, and the KL sum leaves it out, as llama-perplexity's does. n_chunks is written first: a
// run stopped early leaves a file that ends early, refused unless --chunks keeps to what it holds.
constexpr char kBatonTag[8] = {'B', 'A', 'T', 'O', 'N', 'K', 'L', '1'};
constexpr char kLlamaTag[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};
constexpr uint64_t kHeadBytes = sizeof kBatonTag + 3 * sizeof(int32_t);

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

void read_exact(std::FILE* f, void* dst, size_t bytes, const std::string& path) {
  if (std::fread(dst, 1, bytes, f) != bytes) fail(ErrorKind::Usage, "{}: the base file ends early (truncated?)", path);
}

void seek_to(std::FILE* f, uint64_t at, const std::string& path) {
  if (at > uint64_t(std::numeric_limits<long>::max()) || std::fseek(f, long(at), SEEK_SET) != 0)
    fail(ErrorKind::Usage, "{}: the base file ends early (truncated?)", path);
}

void write_exact(std::FILE* f, const void* src, size_t bytes, const std::string& path) {
  if (std::fwrite(src, 1, bytes, f) != bytes) fail(ErrorKind::Model, "writing '{}' failed: {}", path, std::strerror(errno));
}

// The header's chunk count, written after the chunks it counts have reached the file: a run that
// is killed (not only one stopped by Ctrl-C) leaves a base of the chunks it finished.
void commit_chunks(std::FILE* f, int32_t done, const std::string& path) {
  if (std::fflush(f) != 0 ||
      ::pwrite(::fileno(f), &done, sizeof done, off_t(kHeadBytes - sizeof done)) != ssize_t(sizeof done))
    fail(ErrorKind::Model, "writing '{}' failed: {}", path, std::strerror(errno));
}

double mean_error(double sum, double sum2, int64_t n) {
  if (n < 2) return 0;
  const double m = sum / double(n);
  const double var = sum2 / double(n) - m * m;
  return var > 0 ? std::sqrt(var / double(n - 1)) : 0;
}

enum class BaseFormat { Baton, Llama };

// A base file checked against the run: where each chunk's tokens and rows are.
struct BaseFile {
  FilePtr f;
  BaseFormat format = BaseFormat::Baton;
  size_t row_values = 0;                     // uint16 values per stored row
  uint64_t tokens_at = 0, tokens_stride = 0;  // chunk c's tokens start at tokens_at + c·tokens_stride
  uint64_t rows_at = 0, rows_stride = 0;      // its first row at rows_at + c·rows_stride
};

// Opens a base file in either format and checks it before anything runs: -c, the vocabulary, the
// tokens of every chunk compared, and that their rows are all there (a file holding fewer chunks
// than the text compares those: n_chunks is lowered to them).
BaseFile open_base(const std::string& path, int n_ctx, int V, const std::vector<int32_t>& tokens,
                   int& n_chunks) {
  BaseFile b;
  b.f.reset(std::fopen(path.c_str(), "rb"));
  if (!b.f) fail(ErrorKind::Model, "cannot open the base file {}: {}", path, std::strerror(errno));
  std::FILE* f = b.f.get();
  struct stat st{};
  if (::fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) fail(ErrorKind::Model, "the base file {} is a directory", path);
  const long end = std::fseek(f, 0, SEEK_END) == 0 ? std::ftell(f) : -1;
  if (end < 0) fail(ErrorKind::Usage, "cannot read the base file {}", path);
  const uint64_t size = uint64_t(end);
  std::rewind(f);
  char tag[8];
  int32_t head[3];
  read_exact(f, tag, sizeof tag, path);
  if (std::memcmp(tag, kLlamaTag, sizeof tag) == 0) {
    b.format = BaseFormat::Llama;
  } else if (std::memcmp(tag, kBatonTag, sizeof tag) != 0) {
    fail(ErrorKind::Usage, "{} is not a base file written by `baton perplexity --save-base` or "
         "`llama-perplexity --kl-divergence-base`", path);
  }
  read_exact(f, head, sizeof head, path);
  if (head[0] != n_ctx) fail(ErrorKind::Usage, "{} was written with -c {}, this run has -c {}", path, head[0], n_ctx);
  if (head[1] != V)
    fail(ErrorKind::Usage, "{} has a vocabulary of {} tokens, this model {}: compare models that share a tokenizer",
         path, head[1], V);
  if (head[2] <= 0) fail(ErrorKind::Usage, "{} holds no chunks", path);

  const uint64_t n_rows = uint64_t(n_ctx - 1 - n_ctx / 2), ctx_bytes = uint64_t(n_ctx) * sizeof(int32_t);
  b.tokens_at = kHeadBytes;
  if (b.format == BaseFormat::Llama) {
    // All the tokens come first, so where the rows start depends on the chunk count written.
    if (uint64_t(head[2]) > (size - kHeadBytes) / ctx_bytes)
      fail(ErrorKind::Usage, "{}: the base file ends early (truncated?)", path);
    b.row_values = 4 + 2 * ((size_t(V) + 1) / 2);
    b.tokens_stride = ctx_bytes;
    b.rows_at = kHeadBytes + uint64_t(head[2]) * ctx_bytes;
    b.rows_stride = n_rows * b.row_values * sizeof(uint16_t);
  } else {
    b.row_values = size_t(V);
    b.tokens_stride = ctx_bytes + n_rows * b.row_values * sizeof(uint16_t);
    b.rows_at = kHeadBytes + ctx_bytes;
    b.rows_stride = b.tokens_stride;
  }
  n_chunks = std::min(n_chunks, head[2]);
  if (b.rows_at + uint64_t(n_chunks - 1) * b.rows_stride + n_rows * b.row_values * sizeof(uint16_t) > size)
    fail(ErrorKind::Usage, "{}: the base file ends early (truncated?)", path);
  std::vector<int32_t> chunk_tokens(static_cast<size_t>(n_ctx));
  for (int c = 0; c < n_chunks; ++c) {
    seek_to(f, b.tokens_at + uint64_t(c) * b.tokens_stride, path);
    read_exact(f, chunk_tokens.data(), chunk_tokens.size() * sizeof(int32_t), path);
    if (!std::equal(chunk_tokens.begin(), chunk_tokens.end(), tokens.begin() + ptrdiff_t(c) * n_ctx))
      fail(ErrorKind::Usage, "{} was computed on other tokens (chunk {} differs): give the same text (-f) to a model "
           "with the same tokenizer", path, c + 1);
  }
  return b;
}

// A stored row's log-probabilities as floats in lp[0, V), and `cut`: the KL sum leaves out the
// tokens at or below it. False when the row cannot be a distribution (a scale or floor not finite).
bool decode_row(const uint16_t* row, int V, BaseFormat format, float* lp, float& cut) {
  if (format == BaseFormat::Baton) {
    for (int v = 0; v < V; ++v) lp[v] = fp16_to_f32(row[v]);
    cut = -INFINITY;  // Baton's rows keep every token
    return true;
  }
  float scale, bottom;  // the row's scale and floor
  std::memcpy(&scale, row, sizeof scale);
  std::memcpy(&bottom, row + 2, sizeof bottom);
  if (!std::isfinite(scale) || !std::isfinite(bottom) || scale < 0) return false;
  const uint16_t* q = row + 4;
  for (int v = 0; v < V; ++v) lp[v] = bottom + scale * float(q[v]);
  cut = -16;
  return true;
}

// One scored row: what the totals need from it.
struct RowScore {
  double nll = 0, base_nll = 0, kld = 0;
  bool same_top = false;
  bool bad_base = false;  // the base's row is no distribution (a corrupt file)
};

// A base's rows as read from the file: row i at data[i·stride ...], stored in `format`.
struct BaseRows {
  const uint16_t* data = nullptr;
  size_t stride = 0;
  BaseFormat format = BaseFormat::Baton;
};

// Scores rows [0, n_rows) of one chunk; `targets[i]` is row i's next token. With `save`, writes row
// i's log-probabilities as fp16 to save[i·V ...]; with base.data, compares with the base's row i.
void score_rows(const float* logits, int n_rows, int V, const int32_t* targets, uint16_t* save, const BaseRows& base,
                RowScore* out, int n_threads) {
  auto work = [&](int r0, int r1) {
    std::vector<float> lp(base.data ? size_t(V) : 0);  // the base's row, decoded
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
      if (!base.data) continue;
      float cut;
      if (!decode_row(base.data + size_t(i) * base.stride, V, base.format, lp.data(), cut)) {
        s.bad_base = true;
        continue;
      }
      double kl = 0, bsum = 0;
      float bmax = -INFINITY;
      int btop = 0;
      for (int v = 0; v < V; ++v) {
        const double lb = lp[size_t(v)];
        if (lb > bmax) bmax = float(lb), btop = v;
        if (lb <= cut) continue;
        const double pb = std::exp(lb);
        bsum += pb;
        kl += pb * (lb - (double(x[v]) - lse));
      }
      // fp16 rounding leaves Baton's rows summing to 1 ± ~1e-3: renormalise them. llama.cpp's are
      // finer (steps of 16/65535 nats at most), and what the sum lacks there is the mass of the
      // tokens left out (~2e-4 with SmolLM2), which is theirs: taken as they are, as
      // llama-perplexity takes them.
      const double norm = base.format == BaseFormat::Baton ? bsum : 1.0;
      s.kld = std::max(0.0, kl / norm - std::log(norm));
      s.base_nll = -double(lp[size_t(targets[i])]) + std::log(norm);
      s.same_top = btop == top;
      s.bad_base = !(bsum > 0) || !std::isfinite(bsum);
    }
  };
  const int T = std::max(1, std::min(n_threads, n_rows));
  cpu::run_on_threads(T, [&](int t) { work(n_rows * t / T, n_rows * (t + 1) / T); });
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
  BaseFile base;
  if (!opt.kl_base.empty()) base = open_base(opt.kl_base, n_ctx, V, tokens, n_chunks);
  FilePtr save;
  if (!opt.save_base.empty()) {
    save.reset(std::fopen(opt.save_base.c_str(), "wb"));
    if (!save) fail(ErrorKind::Model, "cannot open '{}' for writing: {}", opt.save_base, std::strerror(errno));
    const int32_t head[3] = {n_ctx, V, 0};  // the chunk count goes in at the end
    write_exact(save.get(), kBatonTag, sizeof kBatonTag, opt.save_base);
    write_exact(save.get(), head, sizeof head, opt.save_base);
  }

  const Tokenizer& tok = p.tokenizer();
  const bool add_bos = tok.add_bos() && tok.bos() >= 0;
  const int slots = std::max(1, std::min(p.n_seq(), p.max_in_flight()));
  // With chunks in flight the stages keep the cores busy while a chunk is scored: one thread then.
  const int score_threads = slots > 1 ? 1 : opt.n_threads;
  // A chunk goes in pieces of at most kPerplexityPieceRows scored rows (the first piece with the
  // unscored half before them), so the rows held are bounded whatever -c and the vocabulary; up to
  // `slots` pieces are in flight, each with its own buffer. A chunk's last token is never
  // evaluated: no row scores what follows it.
  const size_t piece_rows = std::min<size_t>(size_t(n_rows), size_t(kPerplexityPieceRows));
  const size_t piece_block = piece_rows * size_t(V);
  std::vector<std::vector<float>> logits(static_cast<size_t>(slots), std::vector<float>(piece_block));
  std::vector<uint16_t> save_rows(save ? piece_block : 0), base_rows(base.f ? piece_rows * base.row_values : 0);
  std::vector<RowScore> scores(piece_rows);
  struct InFlight {
    int chunk, r0, r1;  // its scored rows [r0, r1) of the chunk's n_rows
    size_t buf;
    uint64_t ticket;
  };
  std::deque<InFlight> flight;
  // Left by an error (a base file that turns out corrupt, an evaluation that failed) with pieces
  // still in flight: wait for them before their logits buffers go.
  struct Drain {
    Pipeline& p;
    std::deque<InFlight>& flight;
    ~Drain() {
      for (const InFlight& f : flight) {
        try {
          p.wait(f.ticket);
        } catch (...) {  // the error leaving is the one to report
        }
      }
    }
  } drain{p, flight};
  PerplexityStats st;

  auto finish_front = [&] {
    const InFlight f = flight.front();
    flight.pop_front();
    p.wait(f.ticket);
    const int n = f.r1 - f.r0;
    const int32_t* chunk = tokens.data() + size_t(f.chunk) * size_t(n_ctx);
    BaseRows rows;
    if (base.f) {
      const uint64_t row_bytes = base.row_values * sizeof(uint16_t);
      const uint64_t at = base.rows_at + uint64_t(f.chunk) * base.rows_stride + uint64_t(f.r0) * row_bytes;
      seek_to(base.f.get(), at, opt.kl_base);
      read_exact(base.f.get(), base_rows.data(), size_t(n) * row_bytes, opt.kl_base);
      rows = {base_rows.data(), base.row_values, base.format};
    }
    score_rows(logits[f.buf].data(), n, V, chunk + first + f.r0 + 1, save ? save_rows.data() : nullptr, rows,
               scores.data(), score_threads);
    if (save) {
      if (f.r0 == 0) write_exact(save.get(), chunk, size_t(n_ctx) * sizeof(int32_t), opt.save_base);
      write_exact(save.get(), save_rows.data(), size_t(n) * size_t(V) * sizeof(uint16_t), opt.save_base);
    }
    for (int i = 0; i < n; ++i) {
      const RowScore& s = scores[size_t(i)];
      if (s.bad_base)
        fail(ErrorKind::Usage, "{}: the base's row for position {} of chunk {} is no distribution (a corrupt file?)",
             opt.kl_base, first + f.r0 + i, f.chunk + 1);
      st.nll += s.nll;
      st.nll2 += s.nll * s.nll;
      if (base.f) {
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
      if (save) commit_chunks(save.get(), st.chunks, opt.save_base);
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
  if (save) commit_chunks(save.get(), st.chunks, opt.save_base);
  return st;
}

}  // namespace baton
