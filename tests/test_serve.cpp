// `baton serve`: the HTTP parser on its own (partial, oversized and malformed requests), then a
// server on the generated tiny llama answering over real sockets: the same text as `baton run`,
// streamed or whole, requests decoding side by side, errors as OpenAI-style JSON with the right
// status, a client that leaves stopping its request, and Ctrl-C stopping the server.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/http.h"
#include "tests/cli_helpers.h"
#include "tests/model_helpers.h"

using namespace baton;
using namespace baton::test;
using nlohmann::json;

TEST_CASE("http: a request in pieces, its headers and body; lines may end in LF") {
  const std::string full =
      "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nCONTENT-LENGTH:  7 \r\n\r\n{\"a\":1}";
  http::Request r;
  for (size_t n = 0; n < full.size(); n++) {
    INFO(n << " bytes");
    const http::Parsed p = http::parse_request(std::string_view(full).substr(0, n), r, 1024);
    REQUIRE(p.state == http::Parsed::NeedMore);
    CHECK(p.headers_done == (n >= full.find("\r\n\r\n") + 4));
  }
  http::Parsed p = http::parse_request(full + "GET / HTTP/1.1\r\n", r, 1024);
  REQUIRE(p.state == http::Parsed::Done);
  CHECK(p.consumed == full.size());
  CHECK(r.method == "POST");
  CHECK(r.target == "/v1/completions?x=1");
  CHECK(r.path == "/v1/completions");
  CHECK(r.header("content-length") == "7");
  CHECK(r.header("content-type") == "application/json");
  CHECK(r.header("accept").empty());
  CHECK(r.body == "{\"a\":1}");
  CHECK_FALSE(p.expect_continue);

  p = http::parse_request("GET /health HTTP/1.0\nHost: x\n\n", r, 0);
  REQUIRE(p.state == http::Parsed::Done);
  CHECK(r.path == "/health");
  CHECK(r.body.empty());

  p = http::parse_request("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n", r, 10);
  CHECK(p.state == http::Parsed::NeedMore);
  CHECK(p.headers_done);
  CHECK(p.expect_continue);
}

TEST_CASE("http: malformed, oversized and chunked requests get the status that says why") {
  http::Request r;
  struct Case {
    std::string text;
    int status;
    const char* says;
  };
  const std::vector<Case> cases{
      {"GARBAGE\r\n\r\n", 400, "request line"},
      {"GET  HTTP/1.1\r\n\r\n", 400, "request line"},
      {"G(T / HTTP/1.1\r\n\r\n", 400, "request line"},
      {"GET / SPDY/3\r\n\r\n", 400, "request line"},
      {"GET ?x HTTP/1.1\r\n\r\n", 400, "does not start with /"},
      {"GET http://a/ HTTP/1.1\r\n\r\n", 400, "does not start with /"},
      {"GET / HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"},
      {"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400, "header"},
      {"GET / HTTP/1.1\r\n: empty name\r\n\r\n", 400, "header"},
      {"POST / HTTP/1.1\r\nContent-Length: 12x\r\n\r\n", 400, "12x"},
      {"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "-1"},
      {"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400, "two different"},
      {"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400, "not a number"},
      {"POST / HTTP/1.1\r\nContent-Length: 2000\r\n\r\n", 413, "2000 bytes"},
      {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411, "Content-Length"},
      {"GET /" + std::string(http::kMaxHead + 10, 'a'), 414, "too long"},
      {"GET / HTTP/1.1\r\n" + std::string(http::kMaxHead + 10, 'a'), 431, "KiB"},
      {"GET / HTTP/1.1\r\nX: " + std::string(http::kMaxHead, 'a') + "\r\n\r\n", 431, "KiB"},
  };
  for (const Case& c : cases) {
    INFO(c.text.substr(0, 80));
    const http::Parsed p = http::parse_request(c.text, r, 1000);
    REQUIRE(p.state == http::Parsed::Bad);
    CHECK(p.status == c.status);
    CHECK(p.error.find(c.says) != std::string::npos);
  }
  // Responses: the status line, the length and the close; events as "data: ...\n\n".
  const std::string resp = http::response(404, "application/json", "{}", "X-A: b\r\n");
  CHECK(resp.rfind("HTTP/1.1 404 Not Found\r\n", 0) == 0);
  CHECK(resp.find("Content-Length: 2\r\n") != std::string::npos);
  CHECK(resp.find("Connection: close\r\n") != std::string::npos);
  CHECK(resp.find("X-A: b\r\n\r\n{}") != std::string::npos);
  CHECK(http::event("[DONE]") == "data: [DONE]\n\n");
}

namespace {

const std::string& tiny() {
  static const std::string path = tiny_model_of(GgmlType::Q8_0);
  return path;
}

// A `baton serve` process on a free port, its stderr in a file.
struct ServerProcess {
  pid_t pid = -1;
  int port = -1;
  std::string err_path = temp_dir() + "/serve.err";

  explicit ServerProcess(const std::vector<std::string>& extra) {
    std::vector<std::string> args{"serve", "-m", tiny(), "--port", "0", "-t", "2", "-c", "2048"};
    args.insert(args.end(), extra.begin(), extra.end());
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      const int e = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int null = ::open("/dev/null", O_RDWR);
      dup2(null, 0);
      dup2(null, 1);
      dup2(e, 2);
      exec_baton(args);
    }
    const std::regex listening("on http://127\\.0\\.0\\.1:([0-9]+) ");
    for (int i = 0; i < 1200 && port < 0; i++) {  // 2 minutes (the sanitizers' build loads slowly)
      std::smatch m;
      const std::string err = slurp(err_path);
      if (std::regex_search(err, m, listening)) port = std::stoi(m[1]);
      else usleep(100000);
    }
    INFO(slurp(err_path));
    REQUIRE(port > 0);
  }
  ~ServerProcess() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  std::string log() const { return slurp(err_path); }
};

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

struct Reply {
  int status = 0;
  std::string head, body;
};

// Everything the server sends until it closes (60 s at most).
std::string read_all(int fd) {
  std::string got;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    if (http::read_some(fd, got, 500) == 0) break;
  }
  return got;
}

Reply split(const std::string& raw) {
  Reply r;
  const size_t end = raw.find("\r\n\r\n");
  REQUIRE(end != std::string::npos);
  r.head = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  REQUIRE(r.head.rfind("HTTP/1.1 ", 0) == 0);
  r.status = std::stoi(r.head.substr(9, 3));
  return r;
}

// A request sent and everything the server answered, without Catch's assertions (they are not
// thread-safe): "" when the connection failed.
std::string round_trip(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string raw;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && http::write_all(fd, request)) raw = read_all(fd);
  ::close(fd);
  return raw;
}

std::string request_text(const std::string& method, const std::string& path, const std::string& body,
                         const std::string& headers) {
  return method + " " + path + " HTTP/1.1\r\nHost: t\r\n" + headers +
         (body.empty() && method == "GET" ? "" : "Content-Length: " + std::to_string(body.size()) + "\r\n") + "\r\n" + body;
}

Reply send_raw(int port, const std::string& request) { return split(round_trip(port, request)); }

Reply call(int port, const std::string& method, const std::string& path, const std::string& body = "",
           const std::string& headers = "") {
  return send_raw(port, request_text(method, path, body, headers));
}

// The data of a server-sent event stream, event by event.
std::vector<std::string> events(const std::string& body) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    const std::string e = body.substr(at, end - at);
    REQUIRE(e.rfind("data: ", 0) == 0);
    out.push_back(e.substr(6));
    at = end + 2;
  }
  return out;
}

// `baton run`'s greedy answer (stdout), the reference the server's replies are held to. JSON
// carries text as UTF-8, so bytes that are not (the tiny model's byte tokens) become U+FFFD there:
// the reference goes through the same replacement.
std::string run_text(const std::string& args) {
  const Out o = run_baton("run -m " + tiny() + " -t 2 --temp 0 " + args);
  INFO(o.err);
  REQUIRE(o.code == 0);
  std::string text = o.out;
  if (!text.empty() && text.back() == '\n') text.pop_back();  // run ends its output with a newline
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

}  // namespace

TEST_CASE("serve: OpenAI's completions and chat completions, whole and streamed, as `baton run` answers") {
  ServerProcess s({"--parallel", "2", "--alias", "tiny", "--api-key", "k3y"});
  const std::string auth = "Authorization: Bearer k3y\r\n";

  Reply r = call(s.port, "GET", "/health");
  CHECK(r.status == 200);
  CHECK(json::parse(r.body)["status"] == "ok");
  r = call(s.port, "GET", "/v1/models", "", auth);
  REQUIRE(r.status == 200);
  CHECK(json::parse(r.body)["data"][0]["id"] == "tiny");
  r = call(s.port, "GET", "/v1/models");
  CHECK(r.status == 401);
  CHECK(json::parse(r.body)["error"]["message"].get<std::string>().find("Bearer") != std::string::npos);

  const std::string want = run_text("--raw -p 'Once upon a time' -n 24 --ignore-eos");
  REQUIRE(!want.empty());
  r = call(s.port, "POST", "/v1/completions",
           R"({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true})", auth);
  REQUIRE(r.status == 200);
  json v = json::parse(r.body);
  CHECK(v["object"] == "text_completion");
  CHECK(v["model"] == "tiny");
  CHECK(v["choices"][0]["text"] == want);
  CHECK(v["choices"][0]["finish_reason"] == "length");
  CHECK(v["usage"]["completion_tokens"] == 24);
  CHECK(v["usage"]["total_tokens"] == v["usage"]["prompt_tokens"].get<int>() + 24);

  // Streamed: the same text in deltas, a finish chunk, the usage asked for, then [DONE].
  r = call(s.port, "POST", "/v1/completions",
           R"({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stream": true,
               "stream_options": {"include_usage": true}})",
           auth);
  REQUIRE(r.status == 200);
  CHECK(r.head.find("Content-Type: text/event-stream") != std::string::npos);
  std::vector<std::string> ev = events(r.body);
  REQUIRE(ev.size() >= 4);
  CHECK(ev.back() == "[DONE]");
  std::string text;
  for (size_t i = 0; i + 3 < ev.size(); i++) {
    const json c = json::parse(ev[i]);
    CHECK(c["choices"][0]["finish_reason"].is_null());
    text += c["choices"][0]["text"].get<std::string>();
  }
  CHECK(text == want);
  CHECK(json::parse(ev[ev.size() - 3])["choices"][0]["finish_reason"] == "length");
  CHECK(json::parse(ev[ev.size() - 2])["usage"]["completion_tokens"] == 24);

  // Chat: the model's template, as `baton run -p` applies it; the stream's deltas carry the same.
  const std::string chat_want = run_text("-p 'Tell me about the sea.' -n 20 --ignore-eos");
  const std::string chat_body =
      R"({"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me about "}, {"type": "text", "text": "the sea."}]}],
          "max_completion_tokens": 20, "temperature": 0, "ignore_eos": true)";
  r = call(s.port, "POST", "/v1/chat/completions", chat_body + "}", auth);
  REQUIRE(r.status == 200);
  v = json::parse(r.body);
  CHECK(v["object"] == "chat.completion");
  CHECK(v["choices"][0]["message"]["role"] == "assistant");
  CHECK(v["choices"][0]["message"]["content"] == chat_want);
  r = call(s.port, "POST", "/v1/chat/completions", chat_body + R"(, "stream": true})", auth);
  REQUIRE(r.status == 200);
  ev = events(r.body);
  REQUIRE(ev.size() >= 3);
  CHECK(ev.back() == "[DONE]");
  CHECK(json::parse(ev[0])["choices"][0]["delta"]["role"] == "assistant");
  text.clear();
  for (size_t i = 0; i + 1 < ev.size(); i++) text += json::parse(ev[i])["choices"][0]["delta"].value("content", "");
  CHECK(text == chat_want);
  CHECK(json::parse(ev[ev.size() - 2])["choices"][0]["finish_reason"] == "length");

  // Ollama's API: /api/chat streams one JSON object per line, the last one "done" with the counts;
  // /api/generate with "raw" is the text completion; an empty request only loads.
  r = call(s.port, "POST", "/api/chat",
           R"({"model": "x", "messages": [{"role": "user", "content": "Tell me about the sea."}],
               "options": {"num_predict": 20, "temperature": 0, "ignore_eos": true}})",
           auth);
  REQUIRE(r.status == 200);
  CHECK(r.head.find("Content-Type: application/x-ndjson") != std::string::npos);
  std::vector<json> lines = jsonl(r.body);
  REQUIRE(lines.size() >= 2);
  text.clear();
  for (size_t i = 0; i + 1 < lines.size(); i++) {
    CHECK(lines[i]["done"] == false);
    text += lines[i]["message"]["content"].get<std::string>();
  }
  CHECK(text == chat_want);
  CHECK(lines.back()["done"] == true);
  CHECK(lines.back()["done_reason"] == "length");
  CHECK(lines.back()["eval_count"] == 20);
  r = call(s.port, "POST", "/api/generate",
           R"({"prompt": "Once upon a time", "raw": true, "stream": false, "options": {"num_predict": 24, "temperature": 0, "ignore_eos": true}})",
           auth);
  REQUIRE(r.status == 200);
  v = json::parse(r.body);
  CHECK(v["response"] == want);
  CHECK(v["done"] == true);
  r = call(s.port, "POST", "/api/generate", R"({"model": "tiny"})", auth);
  REQUIRE(r.status == 200);
  CHECK(json::parse(r.body)["done_reason"] == "load");
  r = call(s.port, "GET", "/api/tags", "", auth);
  REQUIRE(r.status == 200);
  CHECK(json::parse(r.body)["models"][0]["name"] == "tiny");
  CHECK(json::parse(r.body)["models"][0]["details"]["family"] == "llama");

  // Logprobs, the chat API's shape: the chosen token's and its alternatives, best first.
  r = call(s.port, "POST", "/v1/chat/completions",
           R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": true,
               "logprobs": true, "top_logprobs": 3})",
           auth);
  REQUIRE(r.status == 200);
  const json lp = json::parse(r.body)["choices"][0]["logprobs"]["content"];
  REQUIRE(lp.size() == 4);
  for (const json& t : lp) {
    REQUIRE(t["top_logprobs"].size() == 3);
    CHECK(t["top_logprobs"][0]["token"] == t["token"]);  // greedy: the best one
    CHECK(t["logprob"].get<double>() <= 0);
    CHECK(t["top_logprobs"][1]["logprob"].get<double>() <= t["top_logprobs"][0]["logprob"].get<double>());
  }

  // Requests side by side (two slots, four clients): each gets what it gets alone.
  std::vector<std::string> prompts{"The cat", "A dog", "In the morning", "Seven"}, wants, gots(4);
  for (const auto& p : prompts) wants.push_back(run_text("--raw -p '" + p + "' -n 16 --ignore-eos"));
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); i++)
    clients.emplace_back([&, i] {
      const std::string body = json{{"prompt", prompts[i]}, {"max_tokens", 16}, {"temperature", 0}, {"ignore_eos", true}}.dump();
      const std::string raw = round_trip(s.port, request_text("POST", "/v1/completions", body, auth));
      const size_t end = raw.find("\r\n\r\n");
      if (raw.rfind("HTTP/1.1 200 ", 0) != 0 || end == std::string::npos) return;
      const json v = json::parse(raw.substr(end + 4), nullptr, false);
      if (v.is_object()) gots[i] = v["choices"][0].value("text", "");
    });
  for (auto& t : clients) t.join();
  CHECK(gots == wants);
  CHECK(s.log().find("Sanitizer") == std::string::npos);
}

TEST_CASE("serve: bad requests are answered with a status and a message naming the problem; the server goes on") {
  ServerProcess s({"--parallel", "1"});
  struct Case {
    std::string method, path, body;
    int status;
    const char* says;
  };
  const std::vector<Case> cases{
      {"POST", "/v1/chat/completions", "{bad", 400, "not valid JSON"},
      {"POST", "/v1/chat/completions", "[1]", 400, "JSON object"},
      {"POST", "/v1/chat/completions", R"({"messages": []})", 400, "'messages'"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"content": "x"}]})", 400, "'role'"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "text"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "n": 2})", 400, "'n' must be 1"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_k": "9"})", 400, "'top_k'"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})", 400, "tool"},
      {"POST", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}})", 400, "response_format"},
      {"POST", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "stream": true})", 400, "not streamed"},
      {"POST", "/v1/completions", R"({"prompt": ""})", 400, "empty"},
      {"POST", "/v1/completions", R"({"prompt": ["a", "b"]})", 400, "'prompt'"},
      {"POST", "/v1/completions", R"({"prompt": "a", "temperature": -1})", 400, "temperature"},
      {"POST", "/v1/completions", R"({"prompt": "a", "logit_bias": {"999999": 1}})", 400, "999999"},
      {"POST", "/v1/completions", "{\"prompt\": \"" + std::string(2100, 'z') + " \"}", 400, "context holds 2048"},
      {"GET", "/v1/completions", "", 405, "POST"},
      {"POST", "/v1/models", "", 405, "GET"},
      {"GET", "/nowhere", "", 404, "/nowhere"},
  };
  for (const Case& c : cases) {
    INFO(c.method << " " << c.path << " " << c.body.substr(0, 100));
    const Reply r = call(s.port, c.method, c.path, c.body);
    CHECK(r.status == c.status);
    const json e = json::parse(r.body, nullptr, false);
    REQUIRE(e.is_object());
    CHECK(e["error"]["message"].get<std::string>().find(c.says) != std::string::npos);
  }
  // Ollama's endpoints answer errors in Ollama's shape, {"error": "..."}.
  for (const auto& [path, body, says] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"/api/chat", R"({"messages": 5})", "'messages'"},
           {"/api/generate", R"({"prompt": "a", "options": {"num_predict": "x"}})", "field 'options.num_predict' must be"},
           {"/api/generate", R"({"prompt": "a", "options": 3})", "'options'"},
           {"/api/generate", R"({"prompt": "a", "images": ["AAAA"]})", "images"},
           {"/api/generate", R"({"prompt": "a", "format": "yaml"})", "format"}}) {
    INFO(path << " " << body);
    const Reply x = call(s.port, "POST", path, body);
    CHECK(x.status == 400);
    const json e = json::parse(x.body, nullptr, false);
    REQUIRE(e.is_object());
    REQUIRE(e["error"].is_string());
    CHECK(e["error"].get<std::string>().find(says) != std::string::npos);
  }
  // Malformed HTTP, and a declared body over the limit (refused before it is sent).
  Reply r = send_raw(s.port, "HELLO\r\n\r\n");
  CHECK(r.status == 400);
  r = send_raw(s.port, "POST /v1/completions HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n");
  CHECK(r.status == 413);
  // A JSON-constrained reply is JSON.
  r = call(s.port, "POST", "/v1/chat/completions",
           R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}})");
  REQUIRE(r.status == 200);
  const json v = json::parse(r.body);
  if (v["choices"][0]["finish_reason"] == "stop") {
    const json reply = json::parse(v["choices"][0]["message"]["content"].get<std::string>());
    CHECK(reply["a"].is_number_integer());
  }
  CHECK(call(s.port, "GET", "/health").status == 200);
  CHECK(s.log().find("refused: prompt is") != std::string::npos);
  CHECK(s.log().find("Sanitizer") == std::string::npos);
}

TEST_CASE("serve: a client that leaves stops its request's compute; Ctrl-C stops the server") {
  ServerProcess s({"--parallel", "2"});
  // A long reply, streamed (its first event read) or whole: the client hangs up.
  int n_cancelled = 0;
  for (const bool stream : {true, false}) {
    INFO((stream ? "streamed" : "whole"));
    const int fd = connect_to(s.port);
    const std::string body = json{{"prompt", "Once"}, {"max_tokens", 2000}, {"ignore_eos", true}, {"stream", stream}}.dump();
    REQUIRE(http::write_all(fd, "POST /v1/completions HTTP/1.1\r\nContent-Length: " + std::to_string(body.size()) +
                                    "\r\n\r\n" + body));
    if (stream) {
      std::string got;
      while (got.find("\n\n") == std::string::npos) REQUIRE(http::read_some(fd, got, 30000) > 0);
    } else {
      usleep(50000);
    }
    ::close(fd);
    // The server's log line for it: cancelled, well short of 2000 tokens.
    // (speed_stats: "generated nothing", "generated 1 token", "generated N tokens, X tok/s")
    const std::regex cancelled("generated (nothing|([0-9]+) tokens?)[^\\n]*\\| cancelled");
    std::vector<int> generated;
    std::string log;
    for (int i = 0; i < 300 && int(generated.size()) <= n_cancelled; i++) {
      usleep(100000);
      log = s.log();
      generated.clear();
      for (auto it = std::sregex_iterator(log.begin(), log.end(), cancelled); it != std::sregex_iterator(); ++it)
        generated.push_back((*it)[2].matched ? std::stoi((*it)[2]) : 0);
    }
    INFO(log);
    REQUIRE(int(generated.size()) == n_cancelled + 1);
    CHECK(generated.back() < 2000);
    n_cancelled++;
  }
  CHECK(call(s.port, "GET", "/health").status == 200);

  // Ctrl-C with a reply streaming: the stream ends, the process exits 0 saying so.
  const int fd = connect_to(s.port);
  const std::string body = json{{"prompt", "Once"}, {"max_tokens", 2000}, {"ignore_eos", true}, {"stream", true}}.dump();
  REQUIRE(http::write_all(fd, "POST /v1/completions HTTP/1.1\r\nContent-Length: " + std::to_string(body.size()) +
                                  "\r\n\r\n" + body));
  std::string got;
  while (got.find("\n\n") == std::string::npos) REQUIRE(http::read_some(fd, got, 30000) > 0);
  kill(s.pid, SIGINT);
  read_all(fd);  // returns when the server closes the connection
  ::close(fd);
  int status = 0;
  REQUIRE(waitpid(s.pid, &status, 0) == s.pid);
  s.pid = -1;
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(s.log().find("stopped") != std::string::npos);
  CHECK(s.log().find("Sanitizer") == std::string::npos);
}
