// libFuzzer target for the HTTP request parser of `baton serve` (built with -DBATON_FUZZ=ON and
// clang; not in scripts/test.sh's timed run: `build-fuzz/tests/fuzz_http -max_total_time=N
// -max_len=8192 CORPUS_DIR` with tests/fuzz/corpus_http/'s seeds copied into CORPUS_DIR). Any
// bytes must give NeedMore, Done or Bad without reading past the buffer, and the answer must not
// change when more bytes follow: Done and Bad stay what they were, NeedMore never skips a request.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "runtime/http.h"

using namespace baton;

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "fuzz_http: invariant broken: %s\n", what);
  std::abort();
}

bool expected_status(int s) {
  return s == 400 || s == 411 || s == 413 || s == 414 || s == 431 || s == 505;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string buf(reinterpret_cast<const char*>(data), size);
  constexpr size_t kMaxBody = 4096;
  http::Request r;
  const http::Parsed p = http::parse_request(buf, r, kMaxBody);
  switch (p.state) {
    case http::Parsed::Done: {
      if (p.consumed > size) broken("consumed past the buffer");
      if (r.method.empty() || r.target.empty() || r.path.empty()) broken("a request without method or target");
      if (r.body.size() > kMaxBody) broken("a body over the limit");
      if (r.target.compare(0, r.path.size(), r.path) != 0) broken("the path is not the target's start");
      for (const auto& [k, v] : r.headers)
        for (char c : k)
          if (c >= 'A' && c <= 'Z') broken("a header name not in lower case");
      // More bytes after a whole request change nothing about it.
      http::Request again;
      const http::Parsed q = http::parse_request(buf + "GET / HTTP/1.1\r\n\r\n", again, kMaxBody);
      if (q.state != http::Parsed::Done || q.consumed != p.consumed || again.body != r.body || again.target != r.target)
        broken("a request read differently with bytes after it");
      break;
    }
    case http::Parsed::Bad:
      if (!expected_status(p.status)) broken("an unexpected status");
      if (p.error.empty()) broken("a refusal without a reason");
      break;
    case http::Parsed::NeedMore:
      if (size > http::kMaxHead + kMaxBody + 4) broken("waiting for more past every limit");
      break;
  }
  // Every prefix of a request that is Done is NeedMore or Done, never Bad... unless the prefix cut
  // a header line short in a way that is itself malformed, which parse_request cannot see before
  // the head ends: so only check that a prefix never claims a different whole request.
  if (p.state == http::Parsed::Done && p.consumed > 0) {
    http::Request part;
    const http::Parsed q = http::parse_request(std::string_view(buf).substr(0, p.consumed - 1), part, kMaxBody);
    if (q.state == http::Parsed::Done) broken("a request cut short read as whole");
  }
  return 0;
}
