#include "runtime/http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "gguf/error.h"

namespace baton::http {

std::string_view Request::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return v;
  return {};
}

namespace {

Parsed bad(int status, std::string error) {
  Parsed p;
  p.state = Parsed::Bad;
  p.status = status;
  p.error = std::move(error);
  return p;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

bool token_char(char c) {  // RFC 9110's tchar
  return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

}  // namespace

Parsed parse_request(std::string_view buf, Request& out, size_t max_body) {
  // The head ends at the first empty line (CRLF CRLF, or LF LF from a lenient client).
  size_t head_end = std::string_view::npos, body_at = 0;
  for (size_t i = buf.find('\n'); i != std::string_view::npos; i = buf.find('\n', i + 1)) {
    const size_t next = i + 1;
    if (next < buf.size() && buf[next] == '\n') { head_end = i; body_at = next + 1; break; }
    if (next + 1 < buf.size() && buf[next] == '\r' && buf[next + 1] == '\n') { head_end = i; body_at = next + 2; break; }
  }
  if (head_end == std::string_view::npos) {
    if (buf.size() > kMaxHead) {
      const size_t eol = buf.find('\n');
      if (eol == std::string_view::npos || eol > kMaxHead) return bad(414, "the request line is too long");
      return bad(431, fmt::format("the request's headers are longer than {} KiB", kMaxHead / 1024));
    }
    return {};
  }
  if (head_end > kMaxHead) return bad(431, fmt::format("the request's headers are longer than {} KiB", kMaxHead / 1024));
  out = Request{};
  std::string_view head = buf.substr(0, head_end);
  size_t eol = head.find('\n');
  std::string_view line = trim(head.substr(0, eol));
  head = eol == std::string_view::npos ? std::string_view() : head.substr(eol + 1);
  // METHOD SP target SP HTTP/1.x
  const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string_view::npos || sp2 == sp1) return bad(400, "malformed request line");
  const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                         version = line.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), token_char)) return bad(400, "malformed request line");
  if (target.empty() || target.find(' ') != std::string_view::npos) return bad(400, "malformed request line");
  if (target[0] != '/' && target != "*") return bad(400, fmt::format("the target '{}' does not start with /", target.substr(0, 100)));
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    if (version.substr(0, 5) != "HTTP/") return bad(400, "malformed request line");
    return bad(505, fmt::format("{} is not supported (HTTP/1.1 is)", version));
  }
  out.method = method;
  out.target = target;
  out.path = target.substr(0, target.find('?'));
  while (!head.empty()) {
    eol = head.find('\n');
    line = head.substr(0, eol);
    head = eol == std::string_view::npos ? std::string_view() : head.substr(eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t colon = line.find(':');
    if (colon == 0 || colon == std::string_view::npos) return bad(400, "malformed header line");
    const std::string_view name = line.substr(0, colon);
    if (!std::all_of(name.begin(), name.end(), token_char)) return bad(400, "malformed header line");
    std::string lower(name);
    for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
    out.headers.emplace_back(std::move(lower), std::string(trim(line.substr(colon + 1))));
  }
  if (!out.header("transfer-encoding").empty())
    return bad(411, "chunked request bodies are not supported: send the body with a Content-Length");
  size_t length = 0;
  int lengths = 0;
  for (const auto& [k, v] : out.headers) {
    if (k != "content-length") continue;
    if (v.empty() || v.size() > 18 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return bad(400, fmt::format("Content-Length '{}' is not a number", v));
    const size_t n = std::stoull(v);
    if (lengths++ > 0 && n != length) return bad(400, "two different Content-Length headers");
    length = n;
  }
  if (length > max_body) return bad(413, fmt::format("the body is {} bytes; the most this server takes is {}", length, max_body));
  Parsed p;
  p.headers_done = true;
  std::string_view expect = out.header("expect");
  p.expect_continue = expect.size() == 12 && std::equal(expect.begin(), expect.end(), "100-continue",
                                                         [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) == b; });
  if (buf.size() - body_at < length) return p;
  out.body = buf.substr(body_at, length);
  p.state = Parsed::Done;
  p.consumed = body_at + length;
  return p;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
  }
  return "Unknown";
}

std::string response(int status, std::string_view content_type, std::string_view body, std::string_view extra_headers) {
  std::string r = fmt::format("HTTP/1.1 {} {}\r\nConnection: close\r\nContent-Length: {}\r\n", status,
                              reason_phrase(status), body.size());
  if (!content_type.empty()) r += fmt::format("Content-Type: {}\r\n", content_type);
  r += extra_headers;
  r += "\r\n";
  r += body;
  return r;
}

std::string stream_head(std::string_view content_type, std::string_view extra_headers) {
  std::string r = fmt::format("HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: {}\r\nCache-Control: no-cache\r\n",
                              content_type);
  r += extra_headers;
  r += "\r\n";
  return r;
}

std::string event(std::string_view data) { return fmt::format("data: {}\n\n", data); }

int listen_on(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); e != 0)
    fail(ErrorKind::Usage, "--host {}: {}", host, gai_strerror(e));
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) { why = std::strerror(errno); continue; }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) break;
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) fail(ErrorKind::Usage, "cannot listen on {}:{}: {}", host, port, why);
  return fd;
}

int bound_port(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return -1;
}

int accept_within(int listen_fd, int timeout_ms) {
  pollfd p{listen_fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return -1;
  const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) {
    // Out of descriptors: the connection waits in the backlog; do not spin on it meanwhile.
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) ::poll(nullptr, 0, 100);
    return -1;
  }
  // A client that stops reading a long reply fails the write after a minute instead of holding
  // its thread for ever.
  timeval tv{kSendTimeoutS, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return fd;
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(size_t(n));
  }
  return true;
}

long read_some(int fd, std::string& buf, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  int r;
  while ((r = ::poll(&p, 1, timeout_ms)) < 0 && errno == EINTR) {}
  if (r <= 0) return -1;
  char chunk[16384];
  ssize_t n;
  while ((n = ::recv(fd, chunk, sizeof chunk, 0)) < 0 && errno == EINTR) {}
  if (n < 0) return -1;
  buf.append(chunk, size_t(n));
  return long(n);
}

bool peer_closed(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  char c;
  return ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace baton::http
