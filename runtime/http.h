// The HTTP/1.1 that `baton serve` speaks: a request parsed from the bytes read so far (a pure
// function, so that partial, oversized and malformed requests are tested without sockets),
// responses and server-sent events written out, and the few socket calls a server needs. One
// request per connection (every response says `Connection: close`); request bodies need a
// Content-Length (chunked uploads are refused with 411).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace baton::http {

struct Request {
  std::string method, target;   // "POST", "/v1/chat/completions?x=1"
  std::string path;             // target without the query
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case, values trimmed
  std::string body;
  // The first header of that (lower-case) name, or "".
  std::string_view header(std::string_view name) const;
};

struct Parsed {
  enum State { NeedMore, Done, Bad } state = NeedMore;
  bool headers_done = false;  // NeedMore with the head read: the body is still coming
  bool expect_continue = false;  // the client waits for "100 Continue" before sending its body
  size_t consumed = 0;        // Done: the request's bytes
  int status = 0;             // Bad: the status to answer with (400, 411, 413, 414, 431, 505)
  std::string error;          // Bad: why, for the client
};

constexpr size_t kMaxHead = 32 * 1024;  // request line and headers

// Parses buf (everything read from the connection so far) into out. Lines may end in CRLF or LF.
Parsed parse_request(std::string_view buf, Request& out, size_t max_body);

const char* reason_phrase(int status);

// A whole response: status line, Content-Type, Content-Length, `Connection: close`, the extra
// header lines (each "Name: value\r\n"), the body.
std::string response(int status, std::string_view content_type, std::string_view body,
                     std::string_view extra_headers = "");
// The head of a streamed response (no length: the stream ends when the connection closes), e.g.
// text/event-stream (server-sent events) or application/x-ndjson; and one server-sent event,
// "data: <payload>\n\n".
std::string stream_head(std::string_view content_type, std::string_view extra_headers = "");
std::string event(std::string_view data);

// Sockets. A listening socket on host:port (port 0: any free one); Error(Usage) naming the
// address when it cannot be had. Returns the fd; bound_port() says which port it got.
int listen_on(const std::string& host, int port);
int bound_port(int fd);
// accept() that gives up after timeout_ms (-1: nothing came, or a signal); the connection's fd,
// whose writes fail after kSendTimeoutS seconds without progress (a client that stopped reading).
constexpr int kSendTimeoutS = 60;
int accept_within(int listen_fd, int timeout_ms);
// Writes all of data (never raising SIGPIPE); false when the peer is gone.
bool write_all(int fd, std::string_view data);
// Reads what is there within timeout_ms into buf: bytes added, 0 at the peer's end, -1 on error or
// timeout.
long read_some(int fd, std::string& buf, int timeout_ms);
// Whether the peer closed its end (a client that went away), without taking any of its data.
bool peer_closed(int fd);

}  // namespace baton::http
