// Sampler and stop-string matcher: behaviour of each filter, reproducibility from the seed.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"
#include "runtime/batch.h"
#include "runtime/sampler.h"
#include "runtime/stop.h"

using namespace baton;

static std::vector<float> ramp(int n) {  // logit i = i / 4: token n-1 is the most likely
  std::vector<float> l(n);
  for (int i = 0; i < n; i++) l[i] = float(i) / 4.0f;
  return l;
}

static std::map<int, int> histogram(SamplingParams p, const std::vector<float>& logits, int draws) {
  Sampler s(p);
  std::map<int, int> h;
  for (int i = 0; i < draws; i++) h[s.sample(logits.data(), int(logits.size()), {})]++;
  return h;
}

TEST_CASE("greedy picks the argmax, ties to the lowest id") {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p);
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
  CHECK(s.sample(l.data(), 5, {}) == 1);
  l[4] = 3.0f;
  CHECK(s.sample(l.data(), 5, {}) == 4);
}

TEST_CASE("same seed, same settings: same draws; other seed: other draws") {
  auto l = ramp(50);
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0;
  p.seed = 1234;
  Sampler a(p), b(p);
  std::vector<int> da, db;
  for (int i = 0; i < 200; i++) {
    da.push_back(a.sample(l.data(), 50, {}));
    db.push_back(b.sample(l.data(), 50, {}));
  }
  CHECK(da == db);
  p.seed = 1235;
  Sampler c(p);
  std::vector<int> dc;
  for (int i = 0; i < 200; i++) dc.push_back(c.sample(l.data(), 50, {}));
  CHECK(dc != da);
}

TEST_CASE("top-k keeps only the k most likely") {
  SamplingParams p;
  p.temperature = 5.0f;  // flat enough that every token would show up without the filter
  p.top_k = 3;
  p.top_p = 1.0f;
  p.min_p = 0;
  p.seed = 7;
  auto h = histogram(p, ramp(20), 2000);
  REQUIRE(h.size() == 3);
  CHECK(h.count(19) == 1);
  CHECK(h.count(18) == 1);
  CHECK(h.count(17) == 1);
}

TEST_CASE("a kTopK row of candidates draws what the full row draws, for any settings that allow it") {
  // Rows with ties (logits on a coarse grid) and NaNs; the row's K candidates come from the CPU
  // reduction every pipeline mirrors (runtime/batch.h), and one seed drives both samplers.
  std::mt19937 g(11);
  int compared = 0, drawn_below_top = 0;
  for (int n : {2, 7, 64, 600, 4096}) {
    const int K = top_k_candidates(n);
    REQUIRE(K == std::min(256, n / 2));
    for (int trial = 0; trial < 12; trial++) {
      std::vector<float> row(static_cast<size_t>(n), 0.0f);
      for (auto& x : row) x = float(int(g() % 40)) / 8.0f - 2.0f;  // many equal logits
      if (trial % 3 == 1) row[g() % size_t(n)] = NAN, row[g() % size_t(n)] = NAN;
      if (trial == 11) std::fill(row.begin(), row.end(), NAN);
      std::vector<float> reduced = row;
      reduce_output_row(kTopK, reduced.data(), n);
      SamplingParams p;
      p.temperature = 0.3f + 0.4f * float(trial % 4);
      p.top_k = 1 + int(g() % uint32_t(K));
      p.top_p = trial % 2 ? 0.8f : 1.0f;
      p.min_p = trial % 5 ? 0.02f : 0.0f;
      p.typical_p = trial % 3 == 2 ? 0.7f : 1.0f;
      p.top_n_sigma = trial % 4 == 3 ? 1.0f : -1.0f;
      p.xtc_probability = trial % 5 == 2 ? 0.6f : 0.0f;
      p.seed = 1234 + uint64_t(trial);
      Sampler full(p), cand(p);
      REQUIRE(cand.top_k_suffices(K));
      for (int d = 0; d < 40; d++) {
        const int32_t a = full.sample(row.data(), n, {}), b = cand.sample_top_k(reduced.data(), K);
        REQUIRE(a == b);
        compared++;
        drawn_below_top += a != cpu::argmax(row.data(), n);
      }
    }
  }
  CHECK(compared == 5 * 12 * 40);
  CHECK(drawn_below_top > 200);  // the comparison covers real draws, not just argmaxes
}

TEST_CASE("a kTopK row with tokens refused (ignore_eos) draws what the full row draws with them refused") {
  // Up to 5 refused ids, among them the row's best; greedy and top-k <= K - refused, one seed each.
  std::mt19937 g(17);
  int compared = 0, refused_best = 0;
  for (int n : {16, 600, 4096}) {
    const int K = top_k_candidates(n);
    for (int trial = 0; trial < 12; trial++) {
      std::vector<float> row(static_cast<size_t>(n), 0.0f);
      for (auto& x : row) x = float(int(g() % 40)) / 8.0f - 2.0f;
      if (trial % 3 == 1) row[g() % size_t(n)] = NAN;
      std::vector<int32_t> refused = {cpu::argmax(row.data(), n)};
      for (int k = 0; k < trial % 5; k++) refused.push_back(int32_t(g() % uint32_t(n)));
      auto allow = [&](int32_t id) { return std::find(refused.begin(), refused.end(), id) == refused.end(); };
      std::vector<float> reduced = row;
      reduce_output_row(kTopK, reduced.data(), n);
      SamplingParams p;
      p.temperature = trial % 4 == 0 ? 0.0f : 0.3f + 0.4f * float(trial % 4);
      p.top_k = 1 + int(g() % uint32_t(K - int(refused.size())));
      p.top_p = trial % 2 ? 0.8f : 1.0f;
      p.seed = 99 + uint64_t(trial);
      Sampler full(p), cand(p);
      REQUIRE((cand.argmax_only() || cand.top_k_suffices(K - int(refused.size()))));
      for (int d = 0; d < 20; d++) {
        const int32_t a = full.sample(row.data(), n, {}, allow), b = cand.sample_top_k(reduced.data(), K, allow);
        REQUIRE(a == b);
        CHECK(allow(b));
        compared++;
        refused_best += a != cpu::argmax(row.data(), n);
      }
    }
  }
  CHECK(compared == 3 * 12 * 20);
  CHECK(refused_best == compared);  // never the refused best
  // Nothing allowed among the candidates: -1, as sample() gives when it allows none.
  std::vector<float> row = {1.0f, 3.0f, 2.0f, 0.5f};
  reduce_output_row(kTopK, row.data(), 4);
  SamplingParams greedy;
  greedy.temperature = 0;
  CHECK(Sampler(greedy).sample_top_k(row.data(), top_k_candidates(4), [](int32_t) { return false; }) == -1);
}

TEST_CASE("top-k off: top-p and min-p over the whole row draw what sorting the row gives") {
  // The reference sorts the whole row by logit (value, then id), keeps the top-p prefix, cuts it
  // at min-p, and draws with the same RNG stream; the sampler finds that prefix from the best few
  // candidates instead (doubling). Flat and peaked rows, ties, temperatures, every filter mix.
  std::mt19937 g(5);
  int compared = 0;
  for (int n : {3, 100, 5000, 49152}) {
    for (int trial = 0; trial < 16; trial++) {
      std::vector<float> row(static_cast<size_t>(n), 0.0f);
      const float spread = trial % 4 == 0 ? 0.05f : trial % 4 == 1 ? 1.0f : 4.0f;  // flat .. peaked
      for (auto& x : row) x = float(int(g() % 200)) * spread / 20.0f;
      SamplingParams p;
      p.top_k = 0;
      p.temperature = 0.4f + 0.3f * float(trial % 5);
      p.top_p = trial % 3 == 0 ? 1.0f : trial % 3 == 1 ? 0.9f : 0.995f;
      p.min_p = trial % 2 ? 0.0f : 0.05f;
      p.seed = 99 + uint64_t(trial);
      Sampler s(p);
      Rng ref(p.seed);
      std::vector<float> prob(row.size());
      for (size_t i = 0; i < row.size(); i++) prob[i] = row[i] / p.temperature;
      cpu::softmax(prob.data(), n);
      std::vector<int32_t> order(row.size());
      for (int i = 0; i < n; i++) order[size_t(i)] = i;
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      size_t keep = order.size();
      double acc = 0;
      for (size_t i = 0; i < order.size() && p.top_p < 1.0f; i++)
        if ((acc += prob[size_t(order[i])]) >= p.top_p) { keep = i + 1; break; }
      if (p.min_p > 0)
        for (size_t i = 1; i < keep; i++)
          if (prob[size_t(order[i])] < prob[size_t(order[0])] * double(p.min_p)) { keep = i; break; }
      for (int d = 0; d < 30; d++) {
        int32_t want = order[keep - 1];
        if (p.top_p < 1.0f || p.min_p > 0) {
          double total = 0;
          for (size_t i = 0; i < keep; i++) total += prob[size_t(order[i])];
          double r = ref.uniform() * total;
          for (size_t i = 0; i < keep; i++)
            if ((r -= prob[size_t(order[i])]) < 0) { want = order[i]; break; }
        } else {  // nothing filtered: the sampler draws in id order (same distribution)
          double total = 0;
          for (float q : prob) total += q;
          double r = ref.uniform() * total;
          for (int i = 0; i < n; i++)
            if (prob[size_t(i)] > 0 && (r -= prob[size_t(i)]) < 0) { want = i; break; }
        }
        INFO("n " << n << " trial " << trial << " draw " << d << " keep " << keep);
        REQUIRE(s.sample(row.data(), n, {}) == want);
        compared++;
      }
    }
  }
  CHECK(compared == 4 * 16 * 30);
}

TEST_CASE("a token filter draws exactly what the logits with the refused tokens at -inf draw") {
  // Random logits over a vocabulary of 1000; filters allowing many, few, one and no tokens.
  std::mt19937 g(5);
  std::vector<float> l(1000);
  for (auto& x : l) x = std::normal_distribution<float>(0.0f, 2.0f)(g);
  std::vector<int32_t> history = {3, 17, 999, 17, 250};
  struct Filter { const char* name; std::function<bool(int32_t)> allow; };
  const std::vector<Filter> filters = {
      {"every other", [](int32_t t) { return t % 2 == 0; }},
      {"one in 97", [](int32_t t) { return t % 97 == 5; }},
      {"three", [](int32_t t) { return t == 998 || t == 3 || t == 600; }},
      {"one", [](int32_t t) { return t == 421; }},
  };
  struct Setting { float temp; int top_k; float top_p, min_p, penalty, typical = 1.0f; int mirostat = 0; float sigma = -1, xtc = 0; };
  const std::vector<Setting> settings = {
      {0.0f, 40, 0.95f, 0.05f, 1.0f}, {0.0f, 40, 1.0f, 0.0f, 1.3f}, {0.9f, 40, 0.95f, 0.05f, 1.0f},
      {1.2f, 5, 1.0f, 0.0f, 1.0f},    {0.7f, 40, 0.9f, 0.0f, 1.2f},  {1.0f, 0, 0.9f, 0.05f, 1.0f},
      {1.0f, 0, 1.0f, 0.0f, 1.0f},    {1.0f, 1000, 1.0f, 0.1f, 1.0f},
      {1.0f, 40, 0.95f, 0.0f, 1.0f, 0.6f}, {0.8f, 0, 1.0f, 0.0f, 1.1f, 0.5f},
      {1.0f, 40, 1.0f, 0.0f, 1.0f, 1.0f, 1}, {0.9f, 0, 1.0f, 0.0f, 1.2f, 1.0f, 2},
      {1.0f, 0, 1.0f, 0.0f, 1.0f, 1.0f, 0, 1.5f}, {1.0f, 40, 0.9f, 0.0f, 1.0f, 1.0f, 0, 0.5f, 0.5f},
      {1.0f, 0, 1.0f, 0.0f, 1.0f, 1.0f, 0, -1.0f, 0.7f}, {0.8f, 0, 0.95f, 0.02f, 1.0f, 1.0f, 0, -1.0f, 0.7f}};
  for (const auto& f : filters)
    for (const auto& st : settings) {
      SamplingParams p;
      p.temperature = st.temp;
      p.top_k = st.top_k;
      p.top_p = st.top_p;
      p.min_p = st.min_p;
      p.repeat_penalty = st.penalty;
      p.typical_p = st.typical;
      p.mirostat = st.mirostat;
      p.top_n_sigma = st.sigma;
      p.xtc_probability = st.xtc;
      p.xtc_threshold = 0.05f;
      p.seed = 77;
      std::vector<float> masked = l;
      for (int t = 0; t < 1000; t++)
        if (!f.allow(t)) masked[size_t(t)] = -INFINITY;
      Sampler a(p), b(p), c(p);
      int asked = 0;
      auto counting = [&](int32_t t) { asked++; return f.allow(t); };
      // A list of the allowed tokens in a scrambled order gives the same draws too.
      auto listing = [&](std::vector<int32_t>& ids) {
        ids.clear();
        for (int t = 999; t >= 0; t--)
          if (f.allow((t * 7) % 1000)) ids.push_back((t * 7) % 1000);
      };
      INFO(f.name << " temp " << st.temp << " top_k " << st.top_k << " top_p " << st.top_p << " penalty " << st.penalty
                  << " typical " << st.typical << " mirostat " << st.mirostat << " sigma " << st.sigma << " xtc " << st.xtc);
      for (int i = 0; i < 200; i++) {
        const int32_t want = a.sample(masked.data(), 1000, history);
        const int32_t got = b.sample(l.data(), 1000, history, counting);
        REQUIRE(got == want);
        REQUIRE(f.allow(got));
        REQUIRE(c.sample(l.data(), 1000, history, f.allow, listing) == want);
      }
      // With top-k on, the filter is asked about the best candidates only when enough of them pass.
      if (std::string(f.name) == "every other" && st.top_k > 0 && st.top_k < 100 && !st.mirostat) CHECK(asked <= 200 * 128);
    }
  SamplingParams p;
  Sampler s(p);
  CHECK(s.sample(l.data(), 1000, {}, [](int32_t) { return false; }) == -1);
  p.temperature = 0;
  Sampler greedy(p);
  CHECK(greedy.sample(l.data(), 1000, {}, [](int32_t) { return false; }) == -1);
  p.temperature = 1;
  p.top_k = 0;
  Sampler row(p);
  CHECK(row.sample(l.data(), 1000, {}, [](int32_t) { return false; }) == -1);
}

TEST_CASE("typical sampling keeps the tokens whose surprise is nearest the entropy, up to the mass") {
  // The reference: the candidates (the whole row, or the top k) at the temperature, their entropy
  // H, sorted by |-ln p - H| (ties in logit order), the shortest prefix of that order whose mass
  // reaches typical_p, renormalized and drawn in logit order with the same RNG stream.
  std::mt19937 g(21);
  int compared = 0, not_best = 0;
  for (int n : {5, 300, 3000}) {
    for (int trial = 0; trial < 8; trial++) {
      std::vector<float> row(static_cast<size_t>(n));
      for (auto& x : row) x = std::normal_distribution<float>(0.0f, trial % 2 ? 3.0f : 1.0f)(g);
      SamplingParams p;
      p.top_k = trial % 4 < 2 ? 0 : 50;
      p.top_p = 1.0f;
      p.min_p = 0.0f;
      p.temperature = 0.7f + 0.2f * float(trial % 3);
      p.typical_p = trial % 3 == 0 ? 0.2f : 0.9f;
      p.seed = 40 + uint64_t(trial);
      std::vector<int32_t> order(row.size());
      for (int i = 0; i < n; i++) order[size_t(i)] = i;
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      if (p.top_k > 0 && p.top_k < n) order.resize(size_t(p.top_k));
      std::vector<double> prob(order.size());
      double sum = 0;
      for (size_t i = 0; i < order.size(); i++) sum += prob[i] = std::exp((double(row[size_t(order[i])]) - row[size_t(order[0])]) / p.temperature);
      double H = 0;
      for (auto& q : prob) q /= sum;
      for (double q : prob) H -= q * std::log(q);
      std::vector<size_t> by(order.size());
      for (size_t i = 0; i < by.size(); i++) by[i] = i;
      std::stable_sort(by.begin(), by.end(), [&](size_t a, size_t b) { return std::abs(-std::log(prob[a]) - H) < std::abs(-std::log(prob[b]) - H); });
      double mass = 0;
      size_t keep = 0;
      while (keep < by.size() && mass < p.typical_p) mass += prob[by[keep++]];
      std::sort(by.begin(), by.begin() + ptrdiff_t(keep));
      Sampler s(p);
      Rng ref(p.seed);
      for (int d = 0; d < 25; d++) {
        double r = ref.uniform() * 1.0;  // (the kept mass, renormalized)
        int32_t want = order[by[keep - 1]];
        for (size_t i = 0; i < keep; i++)
          if ((r -= prob[by[i]] / mass) < 0) { want = order[by[i]]; break; }
        INFO("n " << n << " trial " << trial << " draw " << d << " keep " << keep);
        REQUIRE(s.sample(row.data(), n, {}) == want);
        compared++;
        not_best += want != order[0];
      }
      if (n >= 300 && p.typical_p < 0.5f) CHECK(std::find(by.begin(), by.begin() + ptrdiff_t(keep), 0) == by.begin() + ptrdiff_t(keep));
    }
  }
  CHECK(compared == 3 * 8 * 25);
  CHECK(not_best > 100);
}

TEST_CASE("top-n-sigma keeps the logits within n deviations of the best; XTC drops the top choices but one") {
  // References written from the definitions, drawing with the sampler's streams: the main one
  // (seed) for the draw, XTC's own (seed ^ 0x585443) for its coin.
  std::mt19937 g(9);
  int compared = 0, fired = 0, dropped_best = 0;
  for (int n : {50, 4000}) {
    for (int trial = 0; trial < 8; trial++) {
      std::vector<float> row(static_cast<size_t>(n));
      for (auto& x : row) x = std::normal_distribution<float>(0.0f, 1.0f)(g);
      for (int i = 0; i < 4; i++) row[g() % size_t(n)] += 6.0f - float(i);  // a few clear favourites
      SamplingParams p;
      p.top_k = trial % 2 ? 0 : 30;
      p.top_p = 1.0f;
      p.min_p = 0.0f;
      p.temperature = 0.8f + 0.3f * float(trial % 3);
      const bool sigma = trial < 4;
      if (sigma) p.top_n_sigma = trial % 4 < 2 ? 1.0f : 2.5f;
      else p.xtc_probability = 0.5f, p.xtc_threshold = 0.08f;
      p.seed = 500 + uint64_t(trial);
      std::vector<int32_t> order(row.size());
      for (int i = 0; i < n; i++) order[size_t(i)] = i;
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      if (p.top_k > 0) order.resize(size_t(p.top_k));
      if (sigma) {  // the deviation of the candidates' logits (the whole row with top-k off)
        double m = 0, m2 = 0;
        for (int32_t t : order) m += row[size_t(t)], m2 += double(row[size_t(t)]) * row[size_t(t)];
        m /= double(order.size());
        const double floor = row[size_t(order[0])] - p.top_n_sigma * std::sqrt(m2 / double(order.size()) - m * m);
        while (order.size() > 1 && row[size_t(order.back())] < floor) order.pop_back();
      }
      std::vector<double> prob(order.size());
      double sum = 0;
      for (size_t i = 0; i < order.size(); i++) sum += prob[i] = std::exp((double(row[size_t(order[i])]) - row[size_t(order[0])]) / p.temperature);
      for (auto& q : prob) q /= sum;
      Sampler s(p);
      Rng main(p.seed), coin(p.seed ^ 0x585443ull);
      for (int d = 0; d < 30; d++) {
        size_t first = 0;
        if (!sigma && coin.uniform() < p.xtc_probability) {
          size_t above = 0;
          while (above < prob.size() && prob[above] >= p.xtc_threshold) above++;
          if (above >= 2) first = above - 1, fired++;
        }
        int32_t want = order.back();
        if (p.top_k == 0 && !sigma) {  // top-k off, nothing else: the id-order draw over the row, the dropped at 0
          std::vector<double> full(row.size());
          double t = 0;
          for (int i = 0; i < n; i++) t += full[size_t(i)] = std::exp((double(row[size_t(i)]) - row[size_t(order[0])]) / p.temperature);
          for (auto& q : full) q /= t;
          for (size_t i = 0; i < first; i++) full[size_t(order[i])] = 0;
          double total = 0;
          for (double q : full) total += q;
          double r = main.uniform() * total;
          for (int i = 0; i < n; i++)
            if (full[size_t(i)] > 0 && (r -= full[size_t(i)]) < 0) { want = i; break; }
        } else {
          double total = 0;
          for (size_t i = first; i < prob.size(); i++) total += prob[i];
          double r = main.uniform() * total;
          for (size_t i = first; i < prob.size(); i++)
            if ((r -= prob[i]) < 0) { want = order[i]; break; }
        }
        INFO("n " << n << " trial " << trial << " draw " << d << " kept " << order.size() << " first " << first);
        REQUIRE(s.sample(row.data(), n, {}) == want);
        compared++;
        dropped_best += first > 0 && want != order[0];
      }
    }
  }
  CHECK(compared == 2 * 8 * 30);
  CHECK(fired > 20);  // XTC fired, and then the best token was never drawn
  CHECK(dropped_best == fired);
}

TEST_CASE("Mirostat steers each token's surprise towards tau; the draws follow its algorithm step by step") {
  // A Zipf-like row of 2000 tokens (p_i ~ 1/(i+1)^1.1, ids shuffled). The reference runs Mirostat's
  // algorithms as the paper states them (version 2: the tokens with surprise <= mu; version 1: the
  // top k, k from the fitted Zipf exponent), with the sampler's RNG stream, and tracks mu.
  const int n = 2000;
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; i++) ids[size_t(i)] = i;
  std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
  std::vector<float> row(n);
  for (int i = 0; i < n; i++) row[size_t(ids[size_t(i)])] = -1.1f * std::log(float(i + 1));
  for (int version : {1, 2}) {
    for (float tau : {2.0f, 5.0f}) {
      SamplingParams p;
      p.mirostat = version;
      p.mirostat_tau = tau;
      p.mirostat_eta = 0.1f;
      p.temperature = 1.0f;
      p.top_k = 3;  // ignored: Mirostat replaces the other filters
      p.seed = 8;
      Sampler s(p);
      Rng rng(p.seed);
      std::vector<float> prob(row);
      cpu::softmax(prob.data(), n);
      std::vector<int32_t> sorted(ids);  // ids by probability, best first: sorted[i] = ids[i]
      float mu = 2 * tau;  // (a float, as the sampler keeps it: the cut-off k is sensitive to its last bits)
      double surprise_sum = 0;
      int late = 0;
      for (int step = 0; step < 600; step++) {
        std::vector<int32_t> kept;
        if (version == 2) {
          for (int t = 0; t < n; t++)
            if (prob[size_t(t)] >= std::exp2(-double(mu))) kept.push_back(t);  // id order
          if (kept.empty()) kept.push_back(sorted[0]);
        } else {
          double tb = 0, tt = 0;
          for (int i = 0; i + 1 < 100; i++) {
            const double t = std::log(double(i + 2) / double(i + 1));
            tb += t * std::log(double(prob[size_t(sorted[size_t(i)])]) / prob[size_t(sorted[size_t(i + 1)])]);
            tt += t * t;
          }
          const double sh = tb / tt, eps = sh - 1;
          const double k = std::pow(eps * std::exp2(double(mu)) / (1 - std::pow(double(n), -eps)), 1 / sh);
          kept.assign(sorted.begin(), sorted.begin() + std::clamp(int(k), 1, n));
        }
        double total = 0;
        for (int32_t t : kept) total += prob[size_t(t)];
        double r = rng.uniform() * total;
        int32_t want = kept.back();
        for (int32_t t : kept)
          if ((r -= prob[size_t(t)]) < 0) { want = t; break; }
        const double surprise = -std::log2(prob[size_t(want)] / total);
        mu -= float(double(p.mirostat_eta) * (surprise - double(tau)));
        INFO("version " << version << " tau " << tau << " step " << step);
        REQUIRE(s.sample(row.data(), n, {}) == want);
        if (step >= 200) surprise_sum += surprise, late++;
      }
      const double mean = surprise_sum / late;
      std::printf("mirostat %d, tau %.1f: mean surprise %.3f bits over steps 200..599\n", version, tau, mean);
      CHECK(std::abs(mean - tau) < 0.35);
    }
  }
  // A cut-off so high that it keeps every token (tau 1000: 2^-2000 is 0 in a double): still never a
  // refused one, in either version.
  for (int version : {1, 2}) {
    SamplingParams p;
    p.mirostat = version;
    p.mirostat_tau = 1000;
    p.seed = 3;
    Sampler s(p);
    for (int d = 0; d < 200; d++) {
      const int32_t t = s.sample(row.data(), n, {}, [](int32_t id) { return id % 2 == 0; });
      REQUIRE(t >= 0);
      REQUIRE(t % 2 == 0);
    }
  }
  SamplingParams p;
  p.mirostat = 2;
  CHECK_FALSE(Sampler(p).top_k_suffices(256));  // it needs the whole row
  p.temperature = 0;
  CHECK(Sampler(p).argmax_only());  // greedy still wins
}

TEST_CASE("top-p keeps the smallest set reaching the mass") {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (logits are their logs, temperature 1).
  std::vector<float> l = {std::log(0.05f), std::log(0.5f), std::log(0.15f), std::log(0.3f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.min_p = 0;
  p.top_p = 0.75f;  // 0.5 + 0.3 reaches it
  p.seed = 3;
  auto h = histogram(p, l, 4000);
  REQUIRE(h.size() == 2);
  CHECK(h.count(1) == 1);
  CHECK(h.count(3) == 1);
  // The kept tokens are renormalised: 0.5 / 0.8 = 62.5 %.
  CHECK(std::abs(h[1] / 4000.0 - 0.625) < 0.03);
}

TEST_CASE("min-p drops tokens below a fraction of the best") {
  std::vector<float> l = {std::log(0.05f), std::log(0.5f), std::log(0.15f), std::log(0.3f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.25f;  // floor 0.125: 0.05 goes, 0.15 stays
  p.seed = 5;
  auto h = histogram(p, l, 4000);
  CHECK(h.size() == 3);
  CHECK(h.count(0) == 0);
}

TEST_CASE("temperature sharpens and flattens") {
  std::vector<float> l = {0.0f, 1.0f};
  SamplingParams p;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0;
  p.seed = 11;
  p.temperature = 0.25f;  // p(1) = 1 / (1 + e^-4) ≈ 0.982
  auto cold = histogram(p, l, 5000);
  p.temperature = 4.0f;   // p(1) = 1 / (1 + e^-0.25) ≈ 0.562
  auto hot = histogram(p, l, 5000);
  CHECK(std::abs(cold[1] / 5000.0 - 0.982) < 0.01);
  CHECK(std::abs(hot[1] / 5000.0 - 0.562) < 0.03);
}

TEST_CASE("repetition penalty lowers recent tokens only, whatever the sign") {
  SamplingParams p;
  p.temperature = 0;
  p.repeat_penalty = 2.0f;
  p.repeat_last_n = 2;
  Sampler s(p);
  std::vector<float> l = {3.0f, 2.0f, -1.0f, -1.5f};
  std::vector<int32_t> hist = {0};
  CHECK(s.sample(l.data(), 4, hist) == 1);  // 3/2 = 1.5 < 2
  hist = {0, 1};
  CHECK(s.sample(l.data(), 4, hist) == 0);  // 1.5 vs 1.0
  hist = {1, 0, 5, 9};                       // only the last 2 count; out-of-vocab ids are ignored
  CHECK(s.sample(l.data(), 4, hist) == 0);
  std::vector<float> neg = {-1.0f, -1.2f};
  hist = {0};
  CHECK(s.sample(neg.data(), 2, hist) == 1);  // -2.0 < -1.2
}

TEST_CASE("presence and frequency penalties take c * frequency + presence off, after the repetition penalty") {
  SamplingParams p;
  p.temperature = 0;
  p.repeat_last_n = 8;
  std::vector<float> l = {2.0f, 1.0f, 0.5f, 0.0f};
  std::vector<int32_t> hist = {0, 0, 3, 0, 1};  // token 0 three times, 1 and 3 once, 2 never
  auto pick = [&](float freq, float presence, float repeat = 1.0f) {
    p.frequency_penalty = freq, p.presence_penalty = presence, p.repeat_penalty = repeat;
    return Sampler(p).sample(l.data(), 4, hist);
  };
  // Token 0: 2 - 3f - 0.2 against token 2's untouched 0.5 (token 1: 1 - f - 0.2).
  CHECK(pick(0.43f, 0.2f) == 0);  // 0.51
  CHECK(pick(0.45f, 0.2f) == 2);  // 0.45: a count of 1 would leave 1.35
  CHECK(pick(0.0f, 1.45f) == 0);  // presence alone: 0.55 against 0.5 (token 1: -0.45)
  CHECK(pick(0.0f, 1.55f) == 2);  // 0.45
  // The repetition penalty first: token 0 is 2 / 2 - 0.6 = 0.4 < 0.5 (subtracting first would
  // give (2 - 0.6) / 2 = 0.7).
  std::vector<float> two = {2.0f, 0.5f};
  p.frequency_penalty = 0, p.presence_penalty = 0.6f, p.repeat_penalty = 2.0f;
  std::vector<int32_t> once = {0};
  CHECK(Sampler(p).sample(two.data(), 2, once) == 1);
  p.presence_penalty = 0.4f;  // 0.6 > 0.5
  CHECK(Sampler(p).sample(two.data(), 2, once) == 0);
  // Only the window counts: with the last 2 tokens (0 and 1) token 0 was seen once.
  p.repeat_penalty = 1.0f, p.presence_penalty = 0.2f, p.frequency_penalty = 0.45f, p.repeat_last_n = 2;
  CHECK(Sampler(p).sample(l.data(), 4, hist) == 0);  // 2 - 0.65 = 1.35
  p.repeat_last_n = 0;  // no window: no penalty, and the pipeline may hand back the argmax alone
  CHECK(Sampler(p).argmax_only());
  p.repeat_last_n = 2;
  CHECK_FALSE(Sampler(p).argmax_only());
  p.presence_penalty = 0, p.frequency_penalty = 0;
  CHECK(Sampler(p).argmax_only());
  p.frequency_penalty = -0.5f;  // negative: repeats are favoured
  CHECK_FALSE(Sampler(p).argmax_only());
  std::vector<float> flat = {1.0f, 1.2f};
  CHECK(Sampler(p).sample(flat.data(), 2, once) == 0);  // 1.5 > 1.2
}

TEST_CASE("DRY penalizes the token that would continue a repeat, by its length, not across breakers") {
  SamplingParams p;
  p.temperature = 0;
  p.dry_multiplier = 0.5f;
  p.dry_base = 2.0f;
  p.dry_allowed_length = 2;
  // History 5 6 7 8 ... 5 6 7: the last 3 tokens occurred before, followed by 8 (a repeat of 3).
  std::vector<int32_t> hist = {5, 6, 7, 8, 1, 2, 5, 6, 7};
  std::vector<float> l(10, 0.0f);
  l[8] = 1.0f;   // the continuation: 1 - 0.5 · 2^(3 - 2) = 0
  l[3] = 0.05f;  // the runner-up
  auto pick = [&](const SamplingParams& q) { return Sampler(q).sample(l.data(), 10, hist); };
  CHECK(pick(p) == 3);                 // 8 lost 1.0
  l[8] = 1.06f;
  CHECK(pick(p) == 8);                 // 0.06 > 0.05: exactly 1.0 taken off
  SamplingParams q = p;
  q.dry_allowed_length = 3;            // 0.5 · 2^0 = 0.5 off: 0.56
  CHECK(pick(q) == 8);
  q.dry_allowed_length = 4;            // a repeat of 3 is allowed
  l[8] = 0.06f;
  CHECK(pick(q) == 8);
  CHECK(pick(p) == 3);
  q = p;
  q.dry_penalty_last_n = 4;            // the earlier 5 6 7 8 is out of the window
  CHECK(pick(q) == 8);
  q = p;
  q.dry_multiplier = 0;                // off
  CHECK(pick(q) == 8);
  CHECK(Sampler(q).argmax_only());
  CHECK_FALSE(Sampler(p).argmax_only());
  // A breaker inside the repeat cuts it: 6 a breaker leaves a match of 1 (7), under the allowed 2.
  auto breaker = std::make_shared<std::vector<bool>>(10, false);
  (*breaker)[6] = true;
  q = p;
  q.dry_breaker = breaker;
  CHECK(pick(q) == 8);
  (*breaker)[6] = false, (*breaker)[5] = true;  // 5 a breaker: the match is 6 7 (2), 0.5 off: -0.44
  CHECK(pick(q) == 3);
  (*breaker)[5] = false, (*breaker)[7] = true;  // the last token a breaker: nothing matches
  CHECK(pick(q) == 8);
  // The longest repeat a token would continue counts: 7 is followed by 8 after 5 6 7 (3) and by 9
  // after 4 7 (1); 9 is not penalized.
  hist = {5, 6, 7, 8, 4, 7, 9, 5, 6, 7};
  l.assign(10, 0.0f);
  l[8] = 1.0f, l[9] = 0.5f, l[3] = 0.02f;
  CHECK(pick(p) == 9);  // 8: 1 - 1 = 0; 9 untouched
}

TEST_CASE("logit biases shift, ban and add up before anything else") {
  SamplingParams p;
  p.temperature = 0;
  std::vector<float> l = ramp(8);  // token 7 best (1.75), then 6 (1.5)
  auto greedy = [&](std::vector<std::pair<int32_t, float>> bias) {
    p.logit_bias = std::move(bias);
    return Sampler(p).sample(l.data(), 8, {});
  };
  CHECK(greedy({}) == 7);
  CHECK(greedy({{7, -INFINITY}}) == 6);
  CHECK(greedy({{7, -INFINITY}, {6, -INFINITY}}) == 5);
  CHECK(greedy({{0, 1.8f}}) == 0);               // 1.8 > 1.75
  CHECK(greedy({{0, 1.7f}}) == 7);
  CHECK(greedy({{0, 1.0f}, {0, 0.8f}}) == 0);    // listed twice: both
  CHECK(greedy({{7, -0.2f}, {6, 0.1f}}) == 6);   // 1.55 < 1.6
  p.logit_bias = {{3, -1.0f}};
  CHECK_FALSE(Sampler(p).argmax_only());          // a bias needs the full row
  p.temperature = 1, p.top_k = 4;
  CHECK_FALSE(Sampler(p).top_k_suffices(16));
  // Sampled: a bias of b multiplies a token's odds by e^b. Two tokens of equal logits, +ln 3 on one.
  p.top_k = 0, p.top_p = 1, p.min_p = 0, p.seed = 5;
  p.logit_bias = {{1, std::log(3.0f)}};
  auto h = histogram(p, {0.0f, 0.0f}, 8000);
  CHECK(std::abs(h[1] / 8000.0 - 0.75) < 0.02);
  p.logit_bias = {{1, -INFINITY}};
  h = histogram(p, {0.0f, 0.0f}, 500);
  CHECK(h[0] == 500);
  p.top_k = 2;  // the candidates' softmax path too
  h = histogram(p, {0.0f, 0.0f, -1.0f}, 500);
  CHECK(h[1] == 0);
}

TEST_CASE("settings are validated with a message") {
  SamplingParams p;
  CHECK(p.validate().empty());
  p.top_p = 0;
  CHECK(p.validate().find("top_p") != std::string::npos);
  p = {};
  p.temperature = -1;
  CHECK(p.validate().find("temperature") != std::string::npos);
  p = {};
  p.min_p = 2;
  CHECK(p.validate().find("min_p") != std::string::npos);
  // One bad value at a time, each named in the message.
  const std::vector<std::pair<std::function<void(SamplingParams&)>, std::string>> bad = {
      {[](SamplingParams& q) { q.typical_p = 0; }, "typical_p must be in (0, 1] (got 0)"},
      {[](SamplingParams& q) { q.mirostat = 3; }, "mirostat must be 0 (off), 1 or 2 (got 3)"},
      {[](SamplingParams& q) { q.mirostat_tau = -1; }, "mirostat_tau must be a finite number >= 0 (got -1)"},
      {[](SamplingParams& q) { q.mirostat_eta = NAN; }, "mirostat_eta must be a finite number >= 0 (got nan)"},
      {[](SamplingParams& q) { q.top_n_sigma = INFINITY; }, "top_n_sigma must be a finite number (got inf)"},
      {[](SamplingParams& q) { q.xtc_probability = 1.5f; }, "xtc_probability must be 0 to 1 (got 1.5)"},
      {[](SamplingParams& q) { q.xtc_threshold = -0.5f; }, "xtc_threshold must be 0 to 1 (got -0.5)"},
      {[](SamplingParams& q) { q.dry_base = 0.5f; }, "dry_base must be a finite number >= 1 (got 0.5)"},
      {[](SamplingParams& q) { q.dry_allowed_length = 0; }, "dry_allowed_length must be >= 1 (got 0)"},
      {[](SamplingParams& q) { q.dry_penalty_last_n = -2; }, "dry_penalty_last_n must be >= -1 (got -2)"},
      {[](SamplingParams& q) { q.presence_penalty = NAN; }, "presence_penalty must be a finite number (got nan)"},
      {[](SamplingParams& q) { q.frequency_penalty = INFINITY; }, "frequency_penalty must be a finite number (got inf)"},
  };
  for (const auto& [set, says] : bad) {
    p = {};
    set(p);
    CHECK(p.validate() == says);
  }
  p = {};
  p.logit_bias = {{-1, 1.0f}};
  CHECK(p.validate().find("token -1") != std::string::npos);
  p.logit_bias = {{5, INFINITY}};
  CHECK(p.validate().find("finite number or -inf") != std::string::npos);
  p.logit_bias = {{5, NAN}};
  CHECK(p.validate().find("finite number or -inf") != std::string::npos);
  p.logit_bias = {{5, -INFINITY}, {9, 2.0f}};
  CHECK(p.validate().empty());
  CHECK(p.validate(10).empty());
  CHECK(p.validate(9) == "logit_bias: token 9 is not in the vocabulary (0..8)");
}

TEST_CASE("stop matcher holds back partial matches and cuts at the stop string") {
  StopMatcher m({"</end>", "STOP"});
  std::string shown;
  shown += m.push("Hello </e");
  CHECK(shown == "Hello ");  // "</e" might become "</end>"
  shown += m.push("nvelope> S");
  CHECK(shown == "Hello </envelope> ");
  CHECK(m.held() == 1);
  shown += m.push("TO");
  CHECK(shown == "Hello </envelope> ");
  shown += m.push("P and more");
  CHECK(m.stopped());
  CHECK(m.matched() == "STOP");
  CHECK(shown == "Hello </envelope> ");
  CHECK(m.push("x").empty());
  CHECK(m.flush().empty());
}

TEST_CASE("stop matcher: the earliest-starting stop wins; unfinished prefix is flushed at the end") {
  StopMatcher m({"bc", "abcd"});
  CHECK(m.push("xab") == "x");
  CHECK(m.push("cd").empty());
  CHECK(m.stopped());
  CHECK(m.matched() == "abcd");
  StopMatcher n({"###"});
  std::string s = n.push("a##");
  CHECK(s == "a");
  CHECK(n.flush() == "##");
  StopMatcher none;
  CHECK(none.push("anything") == "anything");
}
