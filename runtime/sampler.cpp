#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "runtime/batch.h"

namespace baton {

std::string SamplingParams::validate(int n_vocab) const {
  if (!std::isfinite(temperature) || temperature < 0) return fmt::format("temperature must be >= 0 (got {})", temperature);
  if (top_k < 0) return fmt::format("top_k must be >= 0 (got {})", top_k);
  if (!(top_p > 0 && top_p <= 1)) return fmt::format("top_p must be in (0, 1] (got {})", top_p);
  if (!(min_p >= 0 && min_p <= 1)) return fmt::format("min_p must be in [0, 1] (got {})", min_p);
  if (!(repeat_penalty > 0) || !std::isfinite(repeat_penalty))
    return fmt::format("repeat_penalty must be > 0 (got {})", repeat_penalty);
  if (repeat_last_n < 0) return fmt::format("repeat_last_n must be >= 0 (got {})", repeat_last_n);
  if (!(typical_p > 0 && typical_p <= 1)) return fmt::format("typical_p must be in (0, 1] (got {})", typical_p);
  if (!std::isfinite(top_n_sigma)) return fmt::format("top_n_sigma must be a finite number (got {})", top_n_sigma);
  if (!(xtc_probability >= 0 && xtc_probability <= 1))
    return fmt::format("xtc_probability must be 0 to 1 (got {})", xtc_probability);
  if (!(xtc_threshold >= 0 && xtc_threshold <= 1)) return fmt::format("xtc_threshold must be 0 to 1 (got {})", xtc_threshold);
  if (mirostat < 0 || mirostat > 2) return fmt::format("mirostat must be 0 (off), 1 or 2 (got {})", mirostat);
  if (!(mirostat_tau >= 0) || !std::isfinite(mirostat_tau))
    return fmt::format("mirostat_tau must be a finite number >= 0 (got {})", mirostat_tau);
  if (!(mirostat_eta >= 0) || !std::isfinite(mirostat_eta))
    return fmt::format("mirostat_eta must be a finite number >= 0 (got {})", mirostat_eta);
  if (!(dry_multiplier >= 0) || !std::isfinite(dry_multiplier))
    return fmt::format("dry_multiplier must be a finite number >= 0 (got {})", dry_multiplier);
  if (!(dry_base >= 1) || !std::isfinite(dry_base)) return fmt::format("dry_base must be a finite number >= 1 (got {})", dry_base);
  if (dry_allowed_length < 1) return fmt::format("dry_allowed_length must be >= 1 (got {})", dry_allowed_length);
  if (dry_penalty_last_n < -1) return fmt::format("dry_penalty_last_n must be >= -1 (got {})", dry_penalty_last_n);
  if (!std::isfinite(presence_penalty)) return fmt::format("presence_penalty must be a finite number (got {})", presence_penalty);
  if (!std::isfinite(frequency_penalty))
    return fmt::format("frequency_penalty must be a finite number (got {})", frequency_penalty);
  for (const auto& [t, b] : logit_bias) {
    if (t < 0 || (n_vocab > 0 && t >= n_vocab))
      return n_vocab > 0 ? fmt::format("logit_bias: token {} is not in the vocabulary (0..{})", t, n_vocab - 1)
                         : fmt::format("logit_bias: token {} is not a token id (they are >= 0)", t);
    if (std::isnan(b) || b == INFINITY)
      return fmt::format("logit_bias: the bias of token {} must be a finite number or -inf (got {})", t, b);
  }
  return "";
}

uint64_t random_seed() {
  std::random_device rd;
  uint64_t s = (uint64_t(rd()) << 32) ^ rd();
  return s & 0xffffffffull;  // short enough to retype from the stats line
}

static uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next() {
  auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  uint64_t result = rotl(s_[1] * 5, 7) * 9;
  uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return double(next() >> 11) * 0x1.0p-53; }

Sampler::Sampler(const SamplingParams& p)
    : p_(p), rng_(p.seed), mu_(2 * p.mirostat_tau), xtc_rng_(p.seed ^ 0x585443ull /* "XTC" */) {}

namespace {
// Top-n-sigma's floor: the best logit less n standard deviations of the finite logits added.
struct SigmaFloor {
  double sum = 0, sum2 = 0, n = 0;
  void add(float v) {
    if (std::isfinite(v)) sum += v, sum2 += double(v) * v, n++;
  }
  double floor(double best, float n_sigma) const {
    const double mean = sum / n;
    return best - double(n_sigma) * std::sqrt(std::max(0.0, sum2 / n - mean * mean));
  }
};
}  // namespace

size_t Sampler::xtc_drop(size_t n, const std::function<double(size_t)>& prob) {
  // Two tokens cannot both reach a threshold above 1/2 (llama.cpp's "off" too); the coin is tossed
  // on every step otherwise, so whether it fires does not depend on the row.
  if (p_.xtc_probability <= 0 || p_.xtc_threshold > 0.5f) return 0;
  if (xtc_rng_.uniform() >= p_.xtc_probability) return 0;
  size_t above = 0;
  while (above < n && prob(above) >= p_.xtc_threshold) above++;
  return above >= 2 ? above - 1 : 0;
}

// Logit biases, then llama.cpp's penalties over the window of the last repeat_last_n tokens: each
// distinct token once, its logit divided by repeat_penalty when positive and multiplied when not
// (pushed towards "less likely" whatever its sign), then c · frequency_penalty + presence_penalty
// taken off for a token seen c times. On a copy; with neither the logits are read as they are.
const float* Sampler::penalized(const float* logits, int n_vocab, std::span<const int32_t> history) {
  if (!penalizes()) return logits;
  const size_t n = std::min<size_t>(history.size(), size_t(p_.repeat_last_n));
  if (p_.logit_bias.empty() && n == 0 && !(dry() && history.size() >= 2)) return logits;
  work_.assign(logits, logits + n_vocab);
  for (const auto& [t, b] : p_.logit_bias)
    if (t >= 0 && t < n_vocab) work_[size_t(t)] += b;
  seen_.clear();  // the window's tokens, sorted: each distinct one with its count
  for (size_t i = history.size() - n; i < history.size(); i++)
    if (history[i] >= 0 && history[i] < n_vocab) seen_.push_back(history[i]);
  std::sort(seen_.begin(), seen_.end());
  for (size_t i = 0, j = 0; i < seen_.size(); i = j) {
    while (j < seen_.size() && seen_[j] == seen_[i]) ++j;
    float& l = work_[size_t(seen_[i])];
    l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
    l -= float(j - i) * p_.frequency_penalty + p_.presence_penalty;
  }
  if (dry()) dry_penalize(history, n_vocab);
  return work_.data();
}

// DRY over the window: for each earlier position i holding the last token, the repeat length n is
// how many tokens back from i match those back from the end (none a breaker); the token after i
// would make it n + 1, so it loses multiplier · base^(n - allowed_length) when n >= allowed_length,
// its longest n counting. Lengths are capped at 64 (base^62 already bans a token), which also
// bounds the work to 64 comparisons per occurrence of the last token.
void Sampler::dry_penalize(std::span<const int32_t> history, int n_vocab) {
  const size_t L = p_.dry_penalty_last_n < 0 ? history.size() : std::min(history.size(), size_t(p_.dry_penalty_last_n));
  if (L < 2) return;
  const int32_t* w = history.data() + (history.size() - L);
  const std::vector<bool>* breaker = p_.dry_breaker.get();
  auto breaks = [&](int32_t t) { return t < 0 || t >= n_vocab || (breaker && size_t(t) < breaker->size() && (*breaker)[size_t(t)]); };
  if (breaks(w[L - 1])) return;
  constexpr size_t kMaxLen = 64;
  dry_len_.clear();
  for (size_t i = 0; i + 1 < L; i++) {
    if (w[i] != w[L - 1]) continue;
    size_t len = 0;
    while (len < kMaxLen && len <= i && w[i - len] == w[L - 1 - len] && !breaks(w[i - len])) len++;
    const int32_t next = w[i + 1];
    if (int(len) < p_.dry_allowed_length || next < 0 || next >= n_vocab) continue;
    auto it = std::find_if(dry_len_.begin(), dry_len_.end(), [&](const auto& e) { return e.first == next; });
    if (it == dry_len_.end()) dry_len_.push_back({next, int(len)});
    else it->second = std::max(it->second, int(len));
  }
  for (const auto& [t, len] : dry_len_)
    work_[size_t(t)] -= float(double(p_.dry_multiplier) * std::pow(double(p_.dry_base), len - p_.dry_allowed_length));
}

int32_t Sampler::sample(const float* logits, int n_vocab, std::span<const int32_t> history) {
  BATON_CHECK(n_vocab > 0);
  // Greedy reads the logits as they are (ties go to the lowest id, so greedy output is fully
  // reproducible).
  const float* src = penalized(logits, n_vocab, history);
  if (p_.greedy()) return cpu::argmax(src, n_vocab);

  if (p_.mirostat || p_.top_k <= 0 || p_.top_k >= n_vocab) return full_row(src, n_vocab);
  // Candidates sorted by logit, highest first; equal logits by id so the order never depends on
  // how they were found: top-k in one pass over the row (cpu::top_k).
  top_idx_.resize(size_t(p_.top_k));
  top_val_.resize(size_t(p_.top_k));
  const size_t k = size_t(cpu::top_k(src, n_vocab, p_.top_k, top_idx_.data(), top_val_.data()));
  if (k == 0) return cpu::argmax(src, n_vocab);  // every logit NaN
  cand_.resize(k);
  for (size_t i = 0; i < k; i++) cand_[i] = {top_val_[i], top_idx_[i]};
  return draw(k);
}

int32_t Sampler::sample(const float* logits, int n_vocab, std::span<const int32_t> history, const TokenFilter& allow,
                        const AllowedSet& all) {
  BATON_CHECK(n_vocab > 0);
  const float* src = penalized(logits, n_vocab, history);
  if (!p_.greedy() && (p_.mirostat || p_.top_k <= 0 || p_.top_k >= n_vocab)) {
    // Top-k off (or Mirostat): the whole row's softmax needs every refused token out of it.
    bool any = false;
    if (all) {
      all(allowed_);
      masked_.assign(size_t(n_vocab), -INFINITY);
      for (int32_t t : allowed_) masked_[size_t(t)] = src[t];
      any = !allowed_.empty();
    } else {
      masked_.assign(src, src + n_vocab);
      for (int i = 0; i < n_vocab; i++) {
        if (allow(i)) any = true;
        else masked_[size_t(i)] = -INFINITY;
      }
    }
    return any ? full_row(masked_.data(), n_vocab) : -1;
  }
  if (!allowed_best(src, n_vocab, p_.greedy() ? 1 : size_t(p_.top_k), allow, all)) return -1;
  return p_.greedy() ? cand_[0].second : draw(cand_.size());
}

bool Sampler::allowed_best(const float* src, int n_vocab, size_t want, const TokenFilter& allow, const AllowedSet& all) {
  cand_.clear();
  // The best m by logit (cpu::top_k's total order, so the best m/2 are the ones found before),
  // asking only the new ones; m doubles until `want` are allowed. A filter that can list its
  // tokens gets one round: when the best 64 do not do, few tokens are allowed and the list is short.
  size_t asked = 0;
  for (int m = 64; m <= (all ? 64 : n_vocab / 4); m *= 2) {
    top_idx_.resize(size_t(m));
    top_val_.resize(size_t(m));
    const size_t found = size_t(cpu::top_k(src, n_vocab, m, top_idx_.data(), top_val_.data()));
    for (; asked < found && cand_.size() < want; asked++)
      if (allow(top_idx_[asked])) cand_.push_back({top_val_[asked], top_idx_[asked]});
    if (cand_.size() == want || found < size_t(m)) return !cand_.empty();
  }
  // Few allowed tokens: one pass over the row (or the filter's list) is cheaper than more rounds.
  cand_.clear();
  if (all) {
    all(allowed_);
    for (int32_t t : allowed_)
      if (!std::isnan(src[t])) cand_.push_back({src[t], t});
  } else {
    for (int i = 0; i < n_vocab; i++)
      if (!std::isnan(src[i]) && allow(i)) cand_.push_back({src[i], i});
  }
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const size_t keep = std::min(want, cand_.size());
  std::partial_sort(cand_.begin(), cand_.begin() + ptrdiff_t(keep), cand_.end(), better);
  cand_.resize(keep);
  return keep > 0;
}

int32_t Sampler::full_row(const float* src, int n_vocab) {
  if (p_.mirostat) return mirostat(src, n_vocab);
  if (p_.top_n_sigma >= 0) {
    // The tokens within n deviations of the best logit (the row's mean and deviation over its
    // finite logits): usually few, so only they are sorted.
    SigmaFloor sf;
    float best = -INFINITY;
    for (int i = 0; i < n_vocab; i++)
      if (sf.add(src[i]); std::isfinite(src[i])) best = std::max(best, src[i]);
    if (sf.n == 0) return cpu::argmax(src, n_vocab);
    const double floor = sf.floor(best, p_.top_n_sigma);
    cand_.clear();
    for (int i = 0; i < n_vocab; i++)
      if (std::isfinite(src[i]) && src[i] >= floor) cand_.push_back({src[i], i});
    std::sort(cand_.begin(), cand_.end(),
              [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    return draw(cand_.size(), /*sigma_done=*/true);
  }
  if (p_.typical_p >= 1.0f) return sample_row(src, n_vocab);
  // Typical sampling ranks tokens by how far their surprise is from the row's entropy, which is no
  // prefix of the logits' order: every (non-NaN, finite) token a candidate, in vocabulary order;
  // draw() puts the typical set it keeps in logit order (sorting the whole row cost 4x the step).
  cand_.clear();
  for (int i = 0; i < n_vocab; i++)
    if (std::isfinite(src[i])) cand_.push_back({src[i], i});
  if (cand_.empty()) return cpu::argmax(src, n_vocab);  // every logit NaN or -inf
  return draw(cand_.size(), /*sigma_done=*/true, /*sorted=*/false);
}

// Mirostat: the row's probabilities at the temperature, cut to the tokens whose surprise -log2 p the
// current cut-off mu allows, renormalized, drawn from; mu then moves by eta times how far the drawn
// token's surprise (under the cut distribution) was from tau. Version 1 (Basu et al., algorithm 1)
// cuts to the top k, k from a Zipf exponent estimated on the best 100 tokens; version 2 cuts at
// surprise mu directly.
int32_t Sampler::mirostat(const float* src, int n_vocab) {
  prob_.resize(size_t(n_vocab));
  const float inv_t = 1.0f / p_.temperature;
  for (int i = 0; i < n_vocab; i++) prob_[size_t(i)] = src[i] * inv_t;
  cpu::softmax(prob_.data(), n_vocab);
  int32_t x = -1;
  double total = 0;
  // A token of probability 0 (a refused one at -inf) is never kept, however low the cut falls.
  if (p_.mirostat == 2) {
    const double cut = std::exp2(-double(mu_));
    auto kept = [&](int i) { return prob_[size_t(i)] > 0 && prob_[size_t(i)] >= cut; };
    int last = -1;
    for (int i = 0; i < n_vocab; i++)
      if (kept(i)) total += prob_[size_t(i)], last = i;
    if (last < 0) {  // nothing as likely as the cut: the best token alone
      x = cpu::argmax(prob_.data(), n_vocab);
      total = prob_[size_t(x)];
    } else {
      double r = rng_.uniform() * total;
      for (int i = 0; i < n_vocab && x < 0; i++)
        if (kept(i) && (r -= prob_[size_t(i)]) < 0) x = i;
      if (x < 0) x = last;  // rounding left a sliver: the last token kept
    }
  } else {
    // s: the Zipf exponent that fits the best m probabilities (least squares through the origin of
    // log(p_i / p_i+1) against log((i + 2) / (i + 1))); then the k whose tail has surprise mu.
    const int m = std::min(n_vocab, 100);
    top_idx_.resize(size_t(m));
    top_val_.resize(size_t(m));
    const int found = cpu::top_k(src, n_vocab, m, top_idx_.data(), top_val_.data());
    double tb = 0, tt = 0;
    for (int i = 0; i + 1 < found; i++) {
      const double a = prob_[size_t(top_idx_[size_t(i)])], b = prob_[size_t(top_idx_[size_t(i + 1)])];
      if (!(b > 0)) break;
      const double t = std::log(double(i + 2) / double(i + 1));
      tb += t * std::log(a / b);
      tt += t * t;
    }
    const double s_hat = tt > 0 ? tb / tt : 1.0, eps = s_hat - 1;
    const double k = std::pow(eps * std::exp2(double(mu_)) / (1 - std::pow(double(n_vocab), -eps)), 1 / s_hat);
    const int kk = std::isnan(k) ? n_vocab : int(std::clamp(k, 1.0, double(n_vocab)));
    top_idx_.resize(size_t(kk));
    top_val_.resize(size_t(kk));
    int kept = std::max(1, cpu::top_k(src, n_vocab, kk, top_idx_.data(), top_val_.data()));
    while (kept > 1 && !(prob_[size_t(top_idx_[size_t(kept - 1)])] > 0)) --kept;  // the best first: zeros last
    for (int i = 0; i < kept; i++) total += prob_[size_t(top_idx_[size_t(i)])];
    double r = rng_.uniform() * total;
    for (int i = 0; i < kept && x < 0; i++)
      if ((r -= prob_[size_t(top_idx_[size_t(i)])]) < 0) x = top_idx_[size_t(i)];
    if (x < 0) x = top_idx_[size_t(kept - 1)];
  }
  const double surprise = -std::log2(double(prob_[size_t(x)]) / total);
  mu_ -= float(double(p_.mirostat_eta) * (surprise - double(p_.mirostat_tau)));
  return x;
}

int32_t Sampler::sample_row(const float* src, int n_vocab) {
  // The whole row's probabilities: softmax of logits / T (vectorized).
  prob_.resize(size_t(n_vocab));
  const float inv_t = 1.0f / p_.temperature;
  for (int i = 0; i < n_vocab; i++) prob_[size_t(i)] = src[i] * inv_t;
  cpu::softmax(prob_.data(), n_vocab);
  const bool top_p = p_.top_p < 1.0f, min_p = p_.min_p > 0.0f;
  if (!top_p && !min_p) {  // every token stays but XTC's: one draw in id order, nothing to sort
    // XTC drops best tokens: at most 1/threshold of them reach it, so only those are sorted.
    const int m = p_.xtc_threshold > 0 ? int(std::min<double>(n_vocab, std::floor(1.0 / p_.xtc_threshold) + 2)) : n_vocab;
    bool sorted = false;
    const size_t drop = xtc_drop(size_t(m), [&](size_t i) {
      if (!sorted) {
        top_idx_.resize(size_t(m));
        top_val_.resize(size_t(m));
        top_idx_.resize(size_t(cpu::top_k(src, n_vocab, m, top_idx_.data(), top_val_.data())));
        sorted = true;
      }
      return i < top_idx_.size() ? double(prob_[size_t(top_idx_[i])]) : -1.0;  // (past the NaNs: none)
    });
    for (size_t i = 0; i < drop; i++) prob_[size_t(top_idx_[i])] = 0;
    double total = 0;
    for (float q : prob_) total += q;
    double r = rng_.uniform() * total;
    int32_t last = 0;
    for (int i = 0; i < n_vocab; i++) {
      if (!(prob_[size_t(i)] > 0)) continue;
      last = i;
      r -= prob_[size_t(i)];
      if (r < 0) return i;
    }
    return last;  // rounding left a sliver (or every probability NaN)
  }
  // Top-p and min-p keep a prefix of the row sorted by logit (value, then id): the smallest one
  // whose mass reaches top_p, cut where a token falls below min_p × the best. Take the best m
  // (cpu::top_k), doubling m until the prefix ends among them, instead of sorting the row.
  for (int m = std::min(n_vocab, 64);; m = std::min(n_vocab, 2 * m)) {
    top_idx_.resize(size_t(m));
    top_val_.resize(size_t(m));
    const int found = cpu::top_k(src, n_vocab, m, top_idx_.data(), top_val_.data());
    if (found == 0) return cpu::argmax(src, n_vocab);  // every logit NaN
    const double floor = double(prob_[size_t(top_idx_[0])]) * p_.min_p;
    double acc = 0;
    int keep = 0;
    for (int i = 0; i < found && keep == 0; i++) {
      const double q = prob_[size_t(top_idx_[size_t(i)])];
      if (min_p && i > 0 && q < floor) keep = i;
      else if (acc += q; top_p && acc >= p_.top_p) keep = i + 1;
    }
    if (keep == 0 && (found < m || m == n_vocab)) keep = found;  // the prefix is all of them
    if (keep == 0) continue;
    const int first = int(xtc_drop(size_t(keep), [&](size_t i) { return double(prob_[size_t(top_idx_[i])]); }));
    double total = 0;
    for (int i = first; i < keep; i++) total += prob_[size_t(top_idx_[size_t(i)])];
    double r = rng_.uniform() * total;
    for (int i = first; i < keep; i++) {
      r -= prob_[size_t(top_idx_[size_t(i)])];
      if (r < 0) return top_idx_[size_t(i)];
    }
    return top_idx_[size_t(keep - 1)];  // rounding left a sliver: the last kept token
  }
}

int32_t Sampler::sample_top_k(const float* row, int K, const TokenFilter& allow) {
  BATON_CHECK(argmax_only() || top_k_suffices(K));
  // The row's first candidates are what cpu::top_k(logits, n_vocab, m) finds: the same total
  // order, so the same prefix; the allowed ones among them are what allowed_best() finds. NaN
  // values end the real candidates.
  const size_t want = p_.greedy() ? 1 : size_t(p_.top_k);
  cand_.clear();
  for (int i = 0; i < K && cand_.size() < want; ++i) {
    const float v = top_k_row_value(row, K, i);
    if (std::isnan(v)) break;
    const int32_t id = top_k_row_id(row, i);
    if (!allow || allow(id)) cand_.push_back({v, id});
  }
  if (cand_.empty()) return allow ? -1 : 0;  // every logit NaN: what argmax of the row gives
  return p_.greedy() ? cand_[0].second : draw(cand_.size());
}

int32_t Sampler::draw(size_t k, bool sigma_done, bool sorted) {
  BATON_CHECK(sorted || (sigma_done && p_.typical_p < 1.0f));
  // Top-n-sigma over the candidates: those within n deviations of the best (a prefix).
  if (p_.top_n_sigma >= 0 && !sigma_done && k > 1) {
    SigmaFloor sf;
    for (size_t i = 0; i < k; i++) sf.add(cand_[i].first);
    if (sf.n > 0) {
      const double floor = sf.floor(cand_[0].first, p_.top_n_sigma);
      size_t keep = 1;
      while (keep < k && cand_[keep].first >= floor) keep++;
      k = keep;
    }
  }
  // Softmax with temperature, in double for a stable sum.
  double mx = cand_[0].first;
  if (!sorted)
    for (size_t i = 1; i < k; i++) mx = std::max(mx, double(cand_[i].first));
  double sum = 0;
  std::vector<double>& prob = draw_prob_;
  prob.resize(k);
  for (size_t i = 0; i < k; i++) {
    prob[i] = std::exp((double(cand_[i].first) - mx) / double(p_.temperature));
    sum += prob[i];
  }
  for (auto& p : prob) p /= sum;

  // Typical sampling: the candidates by how far their surprise is from the distribution's entropy,
  // closest first, until their mass reaches typical_p; renormalized, in their logits' order again.
  if (p_.typical_p < 1.0f && k > 1) {
    double entropy = 0;
    for (size_t i = 0; i < k; i++)
      if (prob[i] > 0) entropy -= prob[i] * std::log(prob[i]);
    // Each distance once; ties keep the better logit first. The closest m are sorted, m growing
    // until their mass reaches typical_p: with top-k off that is a few hundred of a whole
    // vocabulary, not a sort of all of it.
    auto& key = typical_key_;
    key.resize(k);
    for (size_t i = 0; i < k; i++) key[i] = {prob[i] > 0 ? std::abs(-std::log(prob[i]) - entropy) : INFINITY, i};
    double mass = 0;
    size_t n = 0;
    for (size_t m = std::min(k, size_t(64));; m = std::min(k, 4 * m)) {
      std::partial_sort(key.begin(), key.begin() + ptrdiff_t(m), key.end());
      mass = 0;
      n = 0;
      while (n < m && mass < p_.typical_p) mass += prob[key[n++].second];
      if (mass >= p_.typical_p || m == k) break;
    }
    typical_.resize(n);
    for (size_t i = 0; i < n; i++) typical_[i] = key[i].second;
    if (sorted) {
      std::sort(typical_.begin(), typical_.end());
    } else {  // the logits' order: higher first, ties by token id
      std::sort(typical_.begin(), typical_.end(), [&](size_t a, size_t b) {
        return cand_[a].first > cand_[b].first || (cand_[a].first == cand_[b].first && cand_[a].second < cand_[b].second);
      });
    }
    if (sorted) {  // ascending positions: moving them down in place overwrites nothing still to read
      for (size_t i = 0; i < n; i++) {
        cand_[i] = cand_[typical_[i]];
        prob[i] = prob[typical_[i]] / mass;
      }
    } else {
      std::vector<std::pair<float, int32_t>> kept(n);
      std::vector<double> kept_prob(n);
      for (size_t i = 0; i < n; i++) kept[i] = cand_[typical_[i]], kept_prob[i] = prob[typical_[i]] / mass;
      std::copy(kept.begin(), kept.end(), cand_.begin());
      std::copy(kept_prob.begin(), kept_prob.end(), prob.begin());
    }
    k = n;
  }

  // Top-p: the smallest prefix whose mass reaches top_p. Min-p: drop tokens below min_p × the best.
  size_t keep = k;
  if (p_.top_p < 1.0f) {
    double acc = 0;
    for (size_t i = 0; i < k; i++) {
      acc += prob[i];
      if (acc >= p_.top_p) { keep = i + 1; break; }
    }
  }
  if (p_.min_p > 0.0f) {
    double floor = prob[0] * p_.min_p;
    size_t n = 1;
    while (n < keep && prob[n] >= floor) n++;
    keep = n;
  }

  const size_t first = xtc_drop(keep, [&](size_t i) { return prob[i]; });
  double total = 0;
  for (size_t i = first; i < keep; i++) total += prob[i];
  double r = rng_.uniform() * total;
  for (size_t i = first; i < keep; i++) {
    r -= prob[i];
    if (r < 0) return cand_[i].second;
  }
  return cand_[keep - 1].second;  // rounding left a sliver: the last kept token
}

}  // namespace baton
