// `baton serve`: the model behind an HTTP server that speaks OpenAI's API (the one llama-server and
// Ollama also offer: POST /v1/chat/completions and /v1/completions, streamed as server-sent events
// or whole, GET /v1/models) and Ollama's own (POST /api/chat and /api/generate, streamed as JSON
// lines; GET /api/tags), and GET /health. The requests of all connections decode together in
// one engine with continuous batching (--parallel slots), as `baton batch` does; a client that goes
// away stops its request's compute at the next step.
//
// Threads: the main thread runs the engine (Engine::serve), taking queued jobs as requests; one
// thread accepts connections; each connection has a thread that reads its request, tokenizes its
// prompt (one connection at a time), queues a job and writes what the engine streams into it.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "cli/request_json.h"
#include "gguf/error.h"
#include "runtime/config.h"
#include "runtime/http.h"
#include "runtime/tokenizer.h"

namespace baton::cli {
namespace {

using nlohmann::json;
using ojson = nlohmann::ordered_json;  // replies keep OpenAI's key order: id, object, created, model, ...
using namespace std::chrono_literals;

struct ServeOpts {
  ModelFlags model;
  SamplingFlags sampling;
  std::string host = "127.0.0.1";
  int port = 8080;
  int parallel = 4;
  std::string api_key, alias;
  size_t max_body = 8 << 20;
  int max_connections = 256;
  int timeout_s = 600;  // a request's whole life: reading it, queueing and generating
};

// One request's generation, shared by its connection's thread and the engine's.
struct Job {
  // Which API asked: its reply's shape. OpenAI's chat and text completions, Ollama's chat and generate.
  enum Api { Chat, Completion, OllamaChat, OllamaGenerate } api = Chat;
  bool templated = true;          // messages through the chat template, or the raw prompt
  bool load_only = false;         // Ollama's empty request, which only loads the model
  std::vector<Message> messages;
  std::string prompt;
  std::vector<int32_t> tokens;    // the prompt, tokenized
  RequestFields fields;
  bool stream = false;
  std::string endpoint;           // "/v1/chat/completions", for the log
  std::shared_ptr<std::atomic<bool>> cancel = std::make_shared<std::atomic<bool>>(false);

  std::mutex m;
  std::condition_variable cv;
  std::string text, reasoning;  // streamed and not yet written
  bool finished = false;
  Result result;                // when finished (result.error: rejected)
};

struct Server {
  ServeOpts o;
  std::string model_id, family;  // family: the GGUF's architecture
  uint64_t model_bytes = 0;
  std::time_t started = std::time(nullptr);
  std::atomic<bool> stopping{false};
  std::atomic<int> connections{0};
  std::atomic<uint64_t> next_id{1};

  std::mutex qm;
  std::condition_variable qcv;
  std::deque<std::shared_ptr<Job>> queue;

  // Prompts are tokenized by the connections' threads, one at a time, not by the engine's (a long
  // one would hold up every reply's next token).
  const Prompter* prompter = nullptr;
  std::mutex prompter_mutex;

  void push(std::shared_ptr<Job> j) {
    {
      std::lock_guard<std::mutex> lk(qm);
      queue.push_back(std::move(j));
    }
    qcv.notify_one();
  }
};

const char* kCors = "Access-Control-Allow-Origin: *\r\n";

std::string error_body(const std::string& message, const char* type = "invalid_request_error") {
  return json{{"error", {{"message", message}, {"type", type}, {"code", nullptr}}}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

bool send_json(int fd, int status, const ojson& body) {
  return http::write_all(fd, http::response(status, "application/json",
                                            body.dump(-1, ' ', false, json::error_handler_t::replace), kCors));
}
bool send_error(int fd, int status, const std::string& message, const char* type = "invalid_request_error") {
  return http::write_all(fd, http::response(status, "application/json", error_body(message, type), kCors));
}

const char* finish_reason(FinishReason f) { return f == FinishReason::Stop ? "stop" : "length"; }

// A message's content: a string, or OpenAI's array of parts of which only text ones are taken.
std::string message_content(const json& c, std::string& err) {
  if (c.is_string()) return c.get<std::string>();
  if (c.is_null()) return "";
  if (!c.is_array()) { err = "a message's 'content' must be a string or an array of text parts"; return ""; }
  std::string text;
  for (const json& p : c) {
    if (!p.is_object() || p.value("type", "") != "text" || !p.contains("text") || !p["text"].is_string()) {
      err = "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported";
      return "";
    }
    text += p["text"].get<std::string>();
  }
  return text;
}

// The body of a completion request into a job; "" or the error (a 400).
std::string read_job(const std::string& body, Job::Api api, const ServeOpts& o,
                     const std::shared_ptr<const Grammar>& default_grammar, Job& j) {
  json v = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return "the body is not valid JSON";
  if (!v.is_object()) return "the body must be a JSON object";
  j.api = api;
  j.templated = api == Job::Chat;
  j.fields = RequestFields::from(o.sampling, default_grammar);
  for (const char* k : {"tools", "tool_choice", "functions"})
    if (v.contains(k) && !v[k].is_null()) return fmt::format("field '{}' is not supported (no tool calls)", k);
  if (v.contains("n") && !(v["n"].is_number_integer() && v["n"].get<int64_t>() == 1)) return "field 'n' must be 1";
  if (v.contains("best_of") && !(v["best_of"].is_number_integer() && v["best_of"].get<int64_t>() == 1))
    return "field 'best_of' must be 1";
  if (v.contains("echo") && v["echo"] != false) return "field 'echo' is not supported";
  if (v.contains("suffix") && !v["suffix"].is_null() && v["suffix"] != "") return "field 'suffix' is not supported";
  if (v.contains("stream")) {
    if (!v["stream"].is_boolean()) return "field 'stream' must be true or false";
    j.stream = v["stream"].get<bool>();
  }
  if (v.contains("max_completion_tokens")) {
    if (v.contains("max_tokens")) return "give 'max_tokens' or 'max_completion_tokens', not both";
    v["max_tokens"] = v["max_completion_tokens"];
  }
  if (v.contains("max_tokens") && v["max_tokens"].is_null()) v.erase("max_tokens");
  if (v.contains("stop") && v["stop"].is_null()) v.erase("stop");
  // The legacy completions API's "logprobs" is a count of alternatives, the chat API's a switch.
  if (api == Job::Completion && v.contains("logprobs") && !v["logprobs"].is_boolean()) {
    int n = -1;
    if (!v["logprobs"].is_null()) {
      if (std::string e = read_number(v, "logprobs", n); !e.empty()) return e;
      if (n < 0 || n > kMaxTopLogprobs) return fmt::format("field 'logprobs' must be 0 to {}", kMaxTopLogprobs);
    }
    v.erase("logprobs");
    j.fields.logprobs = n;
  }
  if (std::string e = read_request_fields(v, body, j.fields); !e.empty()) return e;
  if (v.contains("response_format") && !v["response_format"].is_null()) {
    const auto rf = nlohmann::ordered_json::parse(body)["response_format"];
    const std::string type = rf.is_object() && rf.contains("type") && rf["type"].is_string() ? rf["type"].get<std::string>() : "";
    if (type == "json_object") {
      if (std::string e = read_constraint("format", "json", "field 'response_format'", j.fields); !e.empty()) return e;
    } else if (type == "json_schema") {
      if (!rf.contains("json_schema") || !rf["json_schema"].is_object() || !rf["json_schema"].contains("schema"))
        return "field 'response_format' of type json_schema needs {\"json_schema\": {\"schema\": ...}}";
      if (std::string e = read_constraint("json_schema", rf["json_schema"]["schema"], "field 'response_format'", j.fields);
          !e.empty())
        return e;
    } else if (type != "text") {
      return "field 'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
             "\"json_schema\", \"json_schema\": {\"schema\": ...}}";
    }
  }
  if (j.stream && j.fields.logprobs >= 0) return "logprobs are not streamed: ask for them without 'stream'";
  if (api == Job::Chat) {
    if (!v.contains("messages") || !v["messages"].is_array() || v["messages"].empty())
      return "field 'messages' must be a non-empty array";
    for (const json& m : v["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        return "each message needs a string field 'role'";
      std::string err;
      std::string content = message_content(m.value("content", json()), err);
      if (!err.empty()) return err;
      j.messages.push_back({m["role"].get<std::string>(), std::move(content)});
    }
    if (!o.sampling.system.empty() && j.messages[0].role != "system")
      j.messages.insert(j.messages.begin(), {"system", o.sampling.system});
  } else {
    const json& p = v.value("prompt", json());
    if (p.is_string()) j.prompt = p.get<std::string>();
    else if (p.is_array() && p.size() == 1 && p[0].is_string()) j.prompt = p[0].get<std::string>();
    else return "field 'prompt' must be a string (or an array of one string)";
    if (j.prompt.empty()) return "field 'prompt' is empty";
  }
  return "";
}

// Ollama's /api/chat and /api/generate body into a job: "messages", or "prompt" with "system" and
// "raw"; "stream" (true unless false); "format" ("json" or a schema); and "options", whose sampling
// keys are Baton's request fields but "num_predict" (max_tokens). "" or the error.
std::string read_ollama_job(const std::string& body, Job::Api api, const ServeOpts& o,
                            const std::shared_ptr<const Grammar>& default_grammar, Job& j) {
  json v = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return "the body is not valid JSON";
  if (!v.is_object()) return "the body must be a JSON object";
  j.api = api;
  j.fields = RequestFields::from(o.sampling, default_grammar);
  j.stream = true;
  if (v.contains("stream")) {
    if (!v["stream"].is_boolean()) return "field 'stream' must be true or false";
    j.stream = v["stream"].get<bool>();
  }
  json fields = json::object();
  if (v.contains("options") && !v["options"].is_null()) {
    if (!v["options"].is_object()) return "field 'options' must be an object";
    for (const auto& [k, x] : v["options"].items()) {
      if (k == "num_predict") fields["max_tokens"] = x;
      else if (k == "num_ctx" || k == "num_batch" || k == "num_gpu" || k == "num_thread" || k == "num_keep" ||
               k == "use_mmap" || k == "numa" || k == "main_gpu" || k == "low_vram")
        continue;  // the server's, set by its flags
      else fields[k] = x;
    }
  }
  if (v.contains("format") && !v["format"].is_null() && v["format"] != "") fields["format"] = v["format"];
  if (std::string e = read_request_fields(fields, body, j.fields); !e.empty()) {
    // Named as the request spells it: options.num_predict, options.top_k.
    for (const auto& [k, x] : fields.items()) {
      const std::string ours = fmt::format("field '{}'", k);
      if (k != "format" && e.find(ours) != std::string::npos)
        e.replace(e.find(ours), ours.size(), fmt::format("field 'options.{}'", k == "max_tokens" ? "num_predict" : k));
    }
    return e;
  }
  for (const char* k : {"tools", "images"})
    if (v.contains(k) && !v[k].is_null() && !(v[k].is_array() && v[k].empty())) return fmt::format("field '{}' is not supported", k);
  const std::string system = v.contains("system") && v["system"].is_string() ? v["system"].get<std::string>() : o.sampling.system;
  if (api == Job::OllamaChat) {
    if (!v.contains("messages") || !v["messages"].is_array()) return "field 'messages' must be an array";
    for (const json& m : v["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") || !m["content"].is_string())
        return "each message needs string fields 'role' and 'content'";
      if (m.contains("images") && !m["images"].is_null() && !m["images"].empty()) return "images are not supported";
      j.messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    j.load_only = j.messages.empty();
    if (!system.empty() && (j.messages.empty() || j.messages[0].role != "system")) j.messages.insert(j.messages.begin(), {"system", system});
    return "";
  }
  const json& p = v.value("prompt", json(""));
  if (!p.is_string()) return "field 'prompt' must be a string";
  j.prompt = p.get<std::string>();
  j.load_only = j.prompt.empty();
  j.templated = !(v.contains("raw") && v["raw"] == true);
  if (j.templated) {
    if (!system.empty()) j.messages.push_back({"system", system});
    j.messages.push_back({"user", j.prompt});
  }
  return "";
}

// OpenAI's logprobs: the chat API's {"content": [{token, logprob, bytes, top_logprobs}]}, the
// completions API's {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
json openai_logprobs(const Result& r, const Tokenizer& tok, Job::Api api) {
  const json ours = logprobs_json(r, tok);
  auto bytes_of = [&](int32_t id) {
    json b = json::array();
    for (unsigned char c : tok.decode_piece(id, /*show_special=*/true)) b.push_back(int(c));
    return b;
  };
  if (api == Job::Chat) {
    json content = json::array();
    for (const json& t : ours) {
      json e{{"token", t["token"]}, {"logprob", t["logprob"]}, {"bytes", bytes_of(t["id"].get<int32_t>())},
             {"top_logprobs", json::array()}};
      for (const json& a : t["top_logprobs"])
        e["top_logprobs"].push_back({{"token", a["token"]}, {"logprob", a["logprob"]}, {"bytes", bytes_of(a["id"].get<int32_t>())}});
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}};
  }
  json out{{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
           {"text_offset", json::array()}};
  size_t offset = 0;
  for (const json& t : ours) {
    out["tokens"].push_back(t["token"]);
    out["token_logprobs"].push_back(t["logprob"]);
    json top = json::object();
    for (const json& a : t["top_logprobs"]) top[a["token"].get<std::string>()] = a["logprob"];
    out["top_logprobs"].push_back(std::move(top));
    out["text_offset"].push_back(offset);
    offset += tok.decode_piece(t["id"].get<int32_t>(), true).size();
  }
  return out;
}

ojson usage_of(const Result& r) {
  return {{"prompt_tokens", r.prompt_tokens}, {"completion_tokens", r.completion_tokens()},
          {"total_tokens", r.prompt_tokens + r.completion_tokens()}};
}
// llama-server's "timings" beside the usage: what the prompt and the reply took.
ojson timings_of(const Result& r) {
  return {{"prompt_n", r.prompt_evaluated}, {"prompt_ms", r.prompt_ms}, {"prompt_per_second", r.prompt_tps()},
          {"predicted_n", r.completion_tokens()}, {"predicted_ms", r.gen_ms}, {"predicted_per_second", r.gen_tps()}};
}

constexpr const char* kVersion = "0.1.0";  // baton --version's

// The key check in time that does not depend on where a guess first differs.
bool same_secret(std::string_view given, std::string_view key) {
  unsigned diff = given.size() != key.size();
  for (size_t i = 0; i < key.size(); i++) diff |= unsigned(uint8_t(key[i]) ^ uint8_t(i < given.size() ? given[i] : 0));
  return diff == 0;
}

// "2026-12-07T23:40:05Z", as Ollama writes times.
std::string rfc3339(std::time_t t) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Whether an OpenAI streaming request asked for the usage at the end (stream_options.include_usage).
bool stream_usage(const std::string& body) {
  const json v = json::parse(body, nullptr, false);
  if (!v.is_object() || !v.contains("stream_options") || !v["stream_options"].is_object()) return false;
  const json& u = v["stream_options"].value("include_usage", json(false));
  return u.is_boolean() && u.get<bool>();
}

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// How an API shapes a reply: a stream (its head, a piece per batch of text, its end) or the whole
// reply at once.
class ReplyFormat {
 public:
  virtual ~ReplyFormat() = default;
  virtual std::string head() const = 0;  // the stream's HTTP head and its opening
  virtual std::string piece(const std::string& text, const std::string& reasoning) const = 0;
  virtual std::string end(const Result& r) const = 0;
  virtual std::string stream_error(const std::string& message) const = 0;  // after the head
  virtual ojson whole(const Result& r) const = 0;
  virtual ojson loaded() const { return ojson::object(); }  // Ollama's empty request
};

// OpenAI's: chat.completion / text_completion objects; streams of server-sent events ending in
// "data: [DONE]", the chat API's opening with the role.
class OpenAIReply : public ReplyFormat {
 public:
  OpenAIReply(Job::Api api, std::string model, std::time_t started, uint64_t n, const Tokenizer& tok, bool logprobs,
              bool usage_at_end)
      : chat_(api == Job::Chat), model_(std::move(model)), created_(std::time(nullptr)), tok_(tok),
        logprobs_(logprobs), usage_at_end_(usage_at_end) {
    id_ = fmt::format("{}-{:x}{:06x}", chat_ ? "chatcmpl" : "cmpl", started, n);
  }
  std::string head() const override {
    return http::stream_head("text/event-stream", kCors) + (chat_ ? chunk({{"role", "assistant"}, {"content", ""}}, nullptr) : "");
  }
  std::string piece(const std::string& text, const std::string& reasoning) const override {
    std::string out;
    if (!reasoning.empty()) out += chunk({{"reasoning_content", reasoning}}, nullptr);
    if (!text.empty()) out += chunk({{"content", text}}, nullptr);
    return out;
  }
  std::string end(const Result& r) const override {
    std::string out = chunk(ojson::object(), finish_reason(r.finish));
    if (usage_at_end_) {
      ojson u = top(chunk_object());
      u["choices"] = ojson::array();
      u["usage"] = usage_of(r);
      u["timings"] = timings_of(r);
      out += http::event(dump(u));
    }
    return out + http::event("[DONE]");
  }
  std::string stream_error(const std::string& message) const override { return http::event(error_body(message)); }
  ojson whole(const Result& r) const override {
    ojson choice{{"index", 0}};
    if (chat_) {
      choice["message"] = {{"role", "assistant"}, {"content", r.text}};
      if (!r.reasoning.empty()) choice["message"]["reasoning_content"] = r.reasoning;
    } else {
      choice["text"] = r.text;
    }
    choice["logprobs"] = logprobs_ ? ojson(openai_logprobs(r, tok_, chat_ ? Job::Chat : Job::Completion)) : ojson();
    choice["finish_reason"] = finish_reason(r.finish);
    ojson o = top(chat_ ? "chat.completion" : "text_completion");
    o["choices"] = ojson::array({choice});
    o["usage"] = usage_of(r);
    o["timings"] = timings_of(r);
    return o;
  }

 private:
  const char* chunk_object() const { return chat_ ? "chat.completion.chunk" : "text_completion"; }
  ojson top(const char* object) const { return {{"id", id_}, {"object", object}, {"created", created_}, {"model", model_}}; }
  // A streamed chunk: the chat API's delta, the completions API's text.
  std::string chunk(const ojson& delta, const ojson& finish) const {
    ojson c = top(chunk_object());
    if (chat_) c["choices"] = ojson::array({{{"index", 0}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", finish}}});
    else c["choices"] = ojson::array({{{"index", 0}, {"text", delta.value("content", "")}, {"logprobs", nullptr}, {"finish_reason", finish}}});
    return http::event(dump(c));
  }
  bool chat_;
  std::string model_, id_;
  std::time_t created_;
  const Tokenizer& tok_;
  bool logprobs_, usage_at_end_;
};

// Ollama's: one JSON object per line (application/x-ndjson), the last with "done": true, the
// durations in nanoseconds and the token counts; /api/chat's text in "message", /api/generate's in
// "response", a thinking model's reasoning in "thinking".
class OllamaReply : public ReplyFormat {
 public:
  OllamaReply(Job::Api api, std::string model) : chat_(api == Job::OllamaChat), model_(std::move(model)) {}
  std::string head() const override { return http::stream_head("application/x-ndjson", kCors); }
  std::string piece(const std::string& text, const std::string& reasoning) const override {
    return dump(line(text, reasoning, false)) + "\n";
  }
  std::string end(const Result& r) const override { return dump(last(r, "", "")) + "\n"; }
  std::string stream_error(const std::string& message) const override { return dump({{"error", message}}) + "\n"; }
  ojson whole(const Result& r) const override { return last(r, r.text, r.reasoning); }
  ojson loaded() const override {
    ojson o = line("", "", true);
    o["done_reason"] = "load";
    return o;
  }

 private:
  ojson line(const std::string& text, const std::string& reasoning, bool done) const {
    ojson o{{"model", model_}, {"created_at", rfc3339(std::time(nullptr))}};
    if (chat_) {
      o["message"] = {{"role", "assistant"}, {"content", text}};
      if (!reasoning.empty()) o["message"]["thinking"] = reasoning;
    } else {
      o["response"] = text;
      if (!reasoning.empty()) o["thinking"] = reasoning;
    }
    o["done"] = done;
    return o;
  }
  ojson last(const Result& r, const std::string& text, const std::string& reasoning) const {
    ojson o = line(text, reasoning, true);
    auto ns = [](double ms) { return int64_t(ms * 1e6); };
    o["done_reason"] = finish_reason(r.finish);
    o["total_duration"] = ns(r.total_ms);
    o["load_duration"] = 0;
    o["prompt_eval_count"] = r.prompt_evaluated;
    o["prompt_eval_duration"] = ns(r.prompt_ms);
    o["eval_count"] = r.completion_tokens();
    o["eval_duration"] = ns(r.gen_ms);
    return o;
  }
  bool chat_;
  std::string model_;
};

class Connection {
 public:
  Connection(std::shared_ptr<Server> s, int fd, std::shared_ptr<const Grammar> grammar, const Tokenizer& tok)
      : s_(std::move(s)), fd_(fd), grammar_(std::move(grammar)), tok_(tok) {}
  ~Connection() { ::close(fd_); }

  void serve() {
    const auto t0 = std::chrono::steady_clock::now();
    http::Request req;
    std::string buf;
    bool continued = false;
    for (;;) {
      const http::Parsed p = http::parse_request(buf, req, s_->o.max_body);
      if (p.state == http::Parsed::Bad) return (void)fail(p.status, p.error);
      if (p.state == http::Parsed::Done) break;
      if (p.expect_continue && !continued) {
        continued = true;
        if (!http::write_all(fd_, "HTTP/1.1 100 Continue\r\n\r\n")) return;
      }
      if (s_->stopping) return (void)fail(503, "the server is stopping", "server_error");
      if (std::chrono::steady_clock::now() - t0 > 30s) return (void)fail(408, "the request took too long to arrive");
      const long n = http::read_some(fd_, buf, 200);
      if (n == 0) return;  // the client left
    }
    route(req);
  }

 private:
  void route(const http::Request& req) {
    const std::string& path = req.path;
    const bool v1 = path.rfind("/v1/", 0) == 0;
    ollama_ = path.rfind("/api/", 0) == 0;
    if (req.method == "OPTIONS")  // a browser's preflight
      return (void)http::write_all(fd_, http::response(204, "", "",
                                                       "Access-Control-Allow-Origin: *\r\nAccess-Control-Allow-Methods: "
                                                       "GET, POST, OPTIONS\r\nAccess-Control-Allow-Headers: *\r\n"));
    if (path == "/health" || path == "/") {
      if (req.method != "GET" && req.method != "HEAD") return method_not_allowed("GET");
      if (req.method == "HEAD") {  // the head GET would send, without its body
        const std::string head = http::response(200, "application/json", R"({"status":"ok"})", kCors);
        return (void)http::write_all(fd_, std::string_view(head).substr(0, head.find("\r\n\r\n") + 4));
      }
      return (void)send_json(fd_, 200, {{"status", "ok"}});
    }
    if ((v1 || ollama_) && !s_->o.api_key.empty() && !same_secret(req.header("authorization"), "Bearer " + s_->o.api_key))
      return (void)fail(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error");
    if (path == "/v1/models") {
      if (req.method != "GET") return method_not_allowed("GET");
      ojson m{{"id", s_->model_id}, {"object", "model"}, {"created", s_->started}, {"owned_by", "baton"}};
      return (void)send_json(fd_, 200, {{"object", "list"}, {"data", ojson::array({m})}});
    }
    if (path == "/v1/chat/completions" || path == "/v1/completions") {
      if (req.method != "POST") return method_not_allowed("POST");
      return complete(req, path == "/v1/chat/completions" ? Job::Chat : Job::Completion);
    }
    if (path == "/api/chat" || path == "/api/generate") {
      if (req.method != "POST") return method_not_allowed("POST");
      return complete(req, path == "/api/chat" ? Job::OllamaChat : Job::OllamaGenerate);
    }
    if (path == "/api/tags" || path == "/api/ps") {
      if (req.method != "GET") return method_not_allowed("GET");
      ojson m{{"name", s_->model_id}, {"model", s_->model_id}, {"modified_at", rfc3339(s_->started)}, {"size", s_->model_bytes},
              {"details", {{"format", "gguf"}, {"family", s_->family}}}};
      return (void)send_json(fd_, 200, {{"models", ojson::array({m})}});
    }
    if (path == "/api/version") {
      if (req.method != "GET") return method_not_allowed("GET");
      return (void)send_json(fd_, 200, {{"version", kVersion}});
    }
    fail(404, fmt::format("no such endpoint: {} {} (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
                          "POST /api/chat, POST /api/generate, GET /api/tags, GET /health)",
                          req.method, path));
  }

  void method_not_allowed(const char* allow) {
    http::write_all(fd_, http::response(405, "application/json", error_text(fmt::format("use {} here", allow)),
                                        fmt::format("{}Allow: {}\r\n", kCors, allow)));
  }
  // Errors in the shape of the API asked: OpenAI's {"error": {"message", "type", "code"}}, Ollama's
  // {"error": "..."}.
  std::string error_text(const std::string& message, const char* type = "invalid_request_error") const {
    return ollama_ ? json{{"error", message}}.dump(-1, ' ', false, json::error_handler_t::replace) : error_body(message, type);
  }
  bool fail(int status, const std::string& message, const char* type = "invalid_request_error") const {
    return http::write_all(fd_, http::response(status, "application/json", error_text(message, type), kCors));
  }

  void complete(const http::Request& req, Job::Api api) {
    auto job = std::make_shared<Job>();
    job->endpoint = req.path;
    const bool ollama = api == Job::OllamaChat || api == Job::OllamaGenerate;
    const std::string e = ollama ? read_ollama_job(req.body, api, s_->o, grammar_, *job)
                                 : read_job(req.body, api, s_->o, grammar_, *job);
    if (!e.empty()) return (void)fail(400, e);
    std::unique_ptr<ReplyFormat> reply;
    if (ollama) reply = std::make_unique<OllamaReply>(api, s_->model_id);
    else reply = std::make_unique<OpenAIReply>(api, s_->model_id, s_->started, s_->next_id++, tok_, job->fields.logprobs >= 0,
                                             stream_usage(req.body));
    if (job->load_only)
      return (void)send_json(fd_, 200, reply->loaded());  // Ollama's way to load a model: nothing to generate
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(s_->o.timeout_s);
    try {
      std::lock_guard<std::mutex> lk(s_->prompter_mutex);
      job->tokens = job->templated ? s_->prompter->chat(job->messages) : s_->prompter->raw(job->prompt);
    } catch (const Error& e) {
      std::fprintf(stderr, "%s: refused: %s\n", req.path.c_str(), e.what());
      return (void)fail(400, e.what());
    }
    s_->push(job);

    bool head_sent = false;
    std::unique_lock<std::mutex> lk(job->m);
    for (;;) {
      job->cv.wait_for(lk, 100ms, [&] { return job->finished || (job->stream && !(job->text.empty() && job->reasoning.empty())); });
      std::string text, reasoning;
      if (job->stream) text.swap(job->text), reasoning.swap(job->reasoning);
      const bool finished = job->finished;
      lk.unlock();
      if (!text.empty() || !reasoning.empty()) {
        std::string out = head_sent ? "" : reply->head();
        head_sent = true;
        out += reply->piece(text, reasoning);
        if (!http::write_all(fd_, out)) return cancel(*job);
      }
      if (finished) break;
      if (http::peer_closed(fd_)) return cancel(*job);
      if (s_->stopping || std::chrono::steady_clock::now() > deadline) {
        // A stopping server's engine is gone: a job it never took would not finish.
        cancel(*job);
        if (!head_sent) fail(503, s_->stopping ? "the server is stopping" : fmt::format("no answer within --timeout {} s", s_->o.timeout_s), "server_error");
        return;
      }
      lk.lock();
    }
    Result& r = job->result;  // finished: the engine is done with it
    if (s_->o.sampling.hide_thinking) r.reasoning.clear();
    if (!r.error.empty()) {
      if (!head_sent) fail(400, r.error);
      else http::write_all(fd_, reply->stream_error(r.error));
      return;
    }
    if (r.finish == FinishReason::Cancelled) {
      if (!head_sent) fail(503, "the server is stopping", "server_error");
      return;
    }
    if (job->stream) {
      http::write_all(fd_, (head_sent ? "" : reply->head()) + reply->end(r));
      return;
    }
    send_json(fd_, 200, reply->whole(r));
  }

  void cancel(Job& j) { j.cancel->store(true); }

  std::shared_ptr<Server> s_;
  int fd_;
  bool ollama_ = false;  // an /api/ path: Ollama's error shape
  std::shared_ptr<const Grammar> grammar_;
  const Tokenizer& tok_;
};

int run(const ServeOpts& o) {
  if (std::string e = o.sampling.params.validate(); !e.empty()) fail(ErrorKind::Usage, "{}", e);
  if (o.sampling.logprobs >= 0) fail(ErrorKind::Usage, "--logprobs: ask for them per request (\"logprobs\": true)");
  const std::shared_ptr<const Grammar> grammar = reply_grammar(o.sampling, o.model.verbose);
  auto s = std::make_shared<Server>();
  s->o = o;
  // The port first: a busy one fails before a long load.
  const int listen_fd = http::listen_on(o.host, o.port);
  const int port = http::bound_port(listen_fd);

  Loaded m = load_model(o.model, o.parallel, generation_outputs(o.sampling, o.parallel));
  s->model_id = !o.alias.empty() ? o.alias : std::filesystem::path(m.path).stem().string();
  s->family = m.pipe->config().arch;
  std::error_code ec;
  s->model_bytes = std::filesystem::file_size(m.path, ec);
  Prompter prompter(*m.pipe, o.sampling.chat_template);
  s->prompter = &prompter;
  Engine engine(*m.pipe, *m.vocab, engine_options(o.sampling, o.model, *m.pipe));
  const Tokenizer& tok = m.pipe->tokenizer();
  install_interrupt_handler();

  std::thread acceptor([&, s] {
    while (!s->stopping) {
      const int fd = http::accept_within(listen_fd, 200);
      if (fd < 0) continue;
      if (s->connections >= s->o.max_connections) {
        send_error(fd, 503, fmt::format("the server has {} connections open; try again", s->o.max_connections), "server_error");
        ::close(fd);
        continue;
      }
      s->connections++;
      std::thread([s, fd, grammar, &tok] {
        {
          Connection c(s, fd, grammar, tok);
          try {
            c.serve();
          } catch (const std::exception& e) {
            std::fprintf(stderr, "connection: %s\n", e.what());
          }
        }
        s->connections--;
      }).detach();
    }
  });
  std::fprintf(stderr, "baton serve: %s on http://%s:%d (%d slots of %d tokens). Ctrl-C stops.\n", s->model_id.c_str(),
               o.host.c_str(), port, o.parallel, engine.n_ctx());
  std::fflush(stderr);

  std::map<uint64_t, std::shared_ptr<Job>> running;
  uint64_t next_tag = 0;
  Engine::Source source = [&]() -> std::optional<Request> {
    std::shared_ptr<Job> j;
    {
      std::unique_lock<std::mutex> lk(s->qm);
      // Idle: wait for work (or the end); busy: only what is there now.
      while (running.empty() && s->queue.empty() && !interrupted()) s->qcv.wait_for(lk, 100ms);
      if (s->queue.empty() || interrupted()) return std::nullopt;
      j = std::move(s->queue.front());
      s->queue.pop_front();
    }
    Request r;
    r.prompt = std::move(j->tokens);
    j->fields.apply(r);
    r.cancel = j->cancel;
    Job* raw = j.get();
    if (j->stream) {
      r.on_text = [raw](std::string_view t) {
        std::lock_guard<std::mutex> lk(raw->m);
        raw->text += t;
        raw->cv.notify_all();
      };
      if (!o.sampling.hide_thinking)
        r.on_reasoning = [raw](std::string_view t) {
          std::lock_guard<std::mutex> lk(raw->m);
          raw->reasoning += t;
          raw->cv.notify_all();
        };
    }
    r.tag = next_tag++;
    running[r.tag] = std::move(j);
    return r;
  };
  Engine::Sink sink = [&](Result&& r) {
    auto it = running.find(r.tag);
    BATON_CHECK(it != running.end());
    std::shared_ptr<Job> j = std::move(it->second);
    running.erase(it);
    // One line per request: what it took, or why it was refused; a client that left shows as cancelled.
    if (!r.error.empty())
      std::fprintf(stderr, "%s: refused: %s\n", j->endpoint.c_str(), r.error.c_str());
    else
      std::fprintf(stderr, "%s: %s | %s\n", j->endpoint.c_str(), speed_stats(r).c_str(), to_string(r.finish));
    std::lock_guard<std::mutex> lk(j->m);
    j->result = std::move(r);
    j->finished = true;
    j->cv.notify_all();
  };
  std::exception_ptr error;
  try {
    engine.serve(source, sink, o.parallel, &interrupted());
  } catch (...) {
    error = std::current_exception();
  }
  s->stopping = true;
  acceptor.join();
  ::close(listen_fd);
  // Connections finish what they were writing (their requests ended as cancelled); a few seconds at most.
  for (int i = 0; i < 50 && s->connections > 0; i++) std::this_thread::sleep_for(100ms);
  if (error) std::rethrow_exception(error);
  std::fprintf(stderr, "baton serve: stopped\n");
  return 0;
}

Register reg{{"serve", "Serve the model over HTTP with OpenAI's and Ollama's APIs (chat and completions, streamed, batched)", [](CLI::App& app) {
  auto o = std::make_shared<ServeOpts>();
  add_model_flags(app, o->model);
  add_sampling_flags(app, o->sampling);
  app.add_option("--host", o->host, "address to listen on (0.0.0.0: every interface)")->capture_default_str();
  app.add_option("--port", o->port, "port to listen on (0: any free one, printed at start)")
      ->check(in_range(0, 65535))
      ->capture_default_str();
  app.add_option("--parallel", o->parallel, "requests decoding together (each gets a slot of --ctx tokens)")
      ->check(in_range(1, 256))
      ->capture_default_str();
  app.add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' on /v1/ and /api/ requests");
  app.add_option("--alias", o->alias, "the model's name in /v1/models and in replies (default: the file's name)");
  app.add_option("--timeout", o->timeout_s, "seconds a request may take from arrival to its last token")
      ->check(at_least(1))
      ->capture_default_str();
  return [o] { return run(*o); };
}}};

}  // namespace
}  // namespace baton::cli
