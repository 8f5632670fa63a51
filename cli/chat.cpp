// `baton chat`: a conversation in the terminal. The model's chat template per turn, the KV cache
// kept across turns (each turn's prompt shares its prefix with what is cached, so only the new
// turn is evaluated), line editing and history (libedit), slash commands, Ctrl-C that stops the
// reply's compute. With stdin piped it reads one message per line (or per """ block) and prints
// each answer followed by a blank line, with no decorations.
#include <poll.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <clocale>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>

#include <editline/readline.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "runtime/model_files.h"

namespace baton::cli {
namespace {

using nlohmann::json;

struct ChatOpts {
  ModelFlags model;
  SamplingFlags sampling;
  std::string on_context_full = "drop-oldest";
};

const char* kHelp =
    "  /help                 this text\n"
    "  /exit                 leave (Ctrl-D too)\n"
    "  /reset                forget the conversation (the system prompt stays)\n"
    "  /system TEXT          set the system prompt\n"
    "  /set NAME VALUE       temp, top_p, top_k, min_p, typical_p, top_n_sigma, xtc_probability,\n"
    "                        xtc_threshold, mirostat, mirostat_tau, mirostat_eta, repeat_penalty,\n"
    "                        presence_penalty, frequency_penalty, dry_multiplier, seed, max_tokens\n"
    "  /set format json      replies are JSON objects (/set noformat: free text again)\n"
    "  /stats                show or hide the line after each reply\n"
    "  /save FILE            write the conversation as JSON\n"
    "  /load FILE            read a conversation written by /save\n"
    "  A line ending in \\ continues on the next line; \"\"\" opens and closes a multi-line block.\n"
    "  Ctrl-C stops a reply; the part already written stays in the conversation.\n";

// Waits until fd has input (true) or Ctrl-C is pending (false; also on a failed poll).
bool wait_input(int fd) {
  for (;;) {
    pollfd p[2] = {{fd, POLLIN, 0}, {interrupt_fd(), POLLIN, 0}};  // a negative fd is skipped
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;  // the handler ran: its byte is in the pipe now
      return false;
    }
    if (p[1].revents & POLLIN) {
      if (interrupted()) return false;
      clear_interrupt();  // a byte from a press already dealt with (it landed during the last clear)
      continue;
    }
    if (p[0].revents != 0) return true;  // data, or the end or an error, which read() tells
  }
}

// One byte of input, or -1 at the end of input or when Ctrl-C is pending (interrupt_fd() readable).
int next_byte(int fd) {
  for (;;) {
    if (!wait_input(fd)) return -1;
    unsigned char c;
    ssize_t n = read(fd, &c, 1);
    if (n == 1) return c;
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    return -1;
  }
}

// libedit's key reader. libedit prints the prompt, then switches the terminal to raw mode, then
// blocks in read(). A Ctrl-C that lands before that read (the terminal still cooked echoes it as
// ^C) runs the handler, which sets the flag but has no read() to interrupt: libedit then waits in
// read() with the press gone, and the REPL says nothing. Waiting on stdin and on the interrupt pipe
// together sees every press, whenever it came; -1 ends the line and the caller sees interrupted().
// libedit takes one character per call, so UTF-8 sequences are put together here.
int read_key(FILE* in) {
  const int fd = fileno(in);
  int c = next_byte(fd);
  if (c < 0xC0) return c;  // ASCII, -1, or a stray continuation byte (passed on as is)
  const int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  int code = c & (0x7F >> len);
  for (int i = 1; i < len; i++) {
    int b = next_byte(fd);
    if (b < 0) return -1;
    if ((b & 0xC0) != 0x80) return 0xFFFD;  // not UTF-8
    code = (code << 6) | (b & 0x3F);
  }
  return code;
}

// Where input lines come from: libedit on a terminal, plain reads otherwise.
class LineSource {
 public:
  explicit LineSource(bool tty) : tty_(tty) {
    if (!tty_) return;
    // libedit turns the characters read_key returns into text through the C library's locale.
    if (!std::setlocale(LC_CTYPE, "C.UTF-8")) std::setlocale(LC_CTYPE, "");
    rl_catch_signals = 0;  // our SIGINT handler decides what Ctrl-C means
    rl_getc_function = read_key;  // before using_history(), which initializes libedit
    using_history();
    stifle_history(1000);
    std::error_code ec;
    std::filesystem::create_directories(cache_dir(), ec);
    history_ = cache_dir() + "/chat_history";
    read_history(history_.c_str());
  }
  // nullopt: end of input (Ctrl-D) — or Ctrl-C, which interrupted() tells apart.
  std::optional<std::string> line(const char* prompt) {
    if (!tty_) return piped_line();
    // libedit prints the prompt and only then switches the terminal to raw mode. Keys that arrive
    // in between meet a cooked terminal: Ctrl-D there becomes an end-of-file mark that libedit then
    // reads as a NUL key, and the REPL does not leave. Raw mode from before the prompt closes that
    // window (Ctrl-C still raises SIGINT); the terminal's own mode comes back afterwards.
    termios saved{};
    const bool restore = tcgetattr(STDIN_FILENO, &saved) == 0;
    if (restore) {
      termios raw = saved;
      raw.c_lflag &= ~tcflag_t(ICANON | ECHO);
      raw.c_cc[VMIN] = 1;
      raw.c_cc[VTIME] = 0;
      tcsetattr(STDIN_FILENO, TCSANOW, &raw);
    }
    char* l = readline(prompt);
    if (restore) tcsetattr(STDIN_FILENO, TCSANOW, &saved);
    // A press while the line was being typed cancels the line (libedit may hand back what was typed).
    if (!l || interrupted()) {
      std::free(l);
      return std::nullopt;
    }
    std::string s(l);
    std::free(l);
    return s;
  }
  void remember(const std::string& entry) {
    if (!tty_ || entry.empty()) return;
    add_history(entry.c_str());
    write_history(history_.c_str());
  }

 private:
  // A line of piped input. A press while nothing is being answered is a press at the prompt, as on
  // a terminal: it is seen while waiting for input too (SA_RESTART keeps a plain read waiting).
  std::optional<std::string> piped_line() {
    for (;;) {
      if (interrupted()) return std::nullopt;
      const size_t nl = pending_.find('\n');
      if (nl != std::string::npos || (ended_ && !pending_.empty())) {
        std::string s = pending_.substr(0, nl);
        pending_.erase(0, nl == std::string::npos ? nl : nl + 1);
        if (!s.empty() && s.back() == '\r') s.pop_back();
        return s;
      }
      if (ended_) return std::nullopt;
      if (!wait_input(STDIN_FILENO)) {
        if (!interrupted()) ended_ = true;  // the poll failed
        continue;
      }
      char buf[1 << 16];
      const ssize_t n = read(STDIN_FILENO, buf, sizeof buf);
      if (n > 0) pending_.append(buf, size_t(n));
      else if (n == 0 || (errno != EINTR && errno != EAGAIN)) ended_ = true;
    }
  }

  bool tty_;
  std::string history_;
  std::string pending_;  // piped input read but not yet returned as lines
  bool ended_ = false;
};

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

class Chat {
 public:
  Chat(const ChatOpts& o, Loaded& m, std::shared_ptr<const Grammar> grammar)
      : o_(o), m_(m), prompter_(*m.pipe, o.sampling.chat_template), engine_(*m.pipe, *m.vocab, engine_options(o.sampling, o.model, *m.pipe)),
        tty_(stdin_is_tty() && isatty(STDOUT_FILENO)), input_(stdin_is_tty()) {
    system_ = o.sampling.system;
    grammar_ = std::move(grammar);
    params_ = o.sampling.params;
    seed_ = o.sampling.seed;
    max_tokens_ = o.sampling.max_tokens;
  }

  int loop() {
    if (tty_)
      std::printf("baton chat: %s (template %s, context %d). /help for commands, Ctrl-D or /exit to leave.\n",
                  m_.path.c_str(), prompter_.template_name().c_str(), engine_.n_ctx());
    // The Ctrl-C flag is lowered only where a press is dealt with (here at the prompt, or by
    // stopping a reply), never before waiting for input: a press that came in between would be lost.
    for (;;) {
      std::optional<std::string> msg = read_message();
      if (!msg) {
        if (interrupted()) {  // Ctrl-C at the prompt
          if (tty_) std::printf("\n");
          say("(to leave, type /exit or press Ctrl-D)");
          clear_interrupt();
          continue;
        }
        if (tty_) std::printf("\n");
        return 0;
      }
      std::string text = *msg;
      if (trim(text).empty()) continue;
      if (text[0] == '/') {
        if (!command(trim(text))) return 0;
        continue;
      }
      reply(text);
    }
  }

 private:
  // One user message: a line, a line continued with trailing '\', or a """ block.
  std::optional<std::string> read_message() {
    std::optional<std::string> first = input_.line(tty_ ? ">>> " : "");
    if (!first) return std::nullopt;
    std::string msg;
    if (trim(*first).rfind("\"\"\"", 0) == 0) {
      std::string rest = trim(*first).substr(3);
      bool closed_on_first = rest.size() >= 3 && rest.compare(rest.size() - 3, 3, "\"\"\"") == 0;
      if (closed_on_first) {
        msg = rest.substr(0, rest.size() - 3);
      } else {
        msg = rest;
        for (bool first_line = rest.empty();;) {
          std::optional<std::string> l = input_.line(tty_ ? "... " : "");
          if (!l) {
            if (interrupted()) return std::nullopt;  // Ctrl-C cancels the block being typed
            // The input ended inside the block: what was typed is the last message, sent as it is
            // (a script that forgot the closing quotes still gets its answer), with a note.
            if (trim(msg).empty()) return std::nullopt;
            std::fprintf(stderr, "[the input ended inside a \"\"\" block: sending what it holds]\n");
            break;
          }
          std::string t = trim(*l);
          if (t.size() >= 3 && t.compare(t.size() - 3, 3, "\"\"\"") == 0) {
            std::string before = l->substr(0, l->rfind("\"\"\""));
            if (!before.empty()) msg += (first_line ? "" : "\n") + before;
            break;
          }
          msg += (first_line ? "" : "\n") + *l;
          first_line = false;
        }
      }
    } else {
      msg = *first;
      while (!msg.empty() && msg.back() == '\\') {
        msg.back() = '\n';
        std::optional<std::string> l = input_.line(tty_ ? "... " : "");
        if (!l) break;
        msg += *l;
      }
    }
    input_.remember(msg);
    return msg;
  }

  std::vector<Message> conversation() const {
    std::vector<Message> all;
    if (!system_.empty()) all.push_back({"system", system_});
    all.insert(all.end(), turns_.begin(), turns_.end());
    return all;
  }

  // The prompt for the conversation so far; when it does not fit, oldest turns go first (whole
  // user+assistant pairs, the system prompt stays) or, with --on-context-full=stop, nothing fits.
  std::optional<std::vector<int32_t>> fitting_prompt() {
    const int room = engine_.n_ctx() - std::max(16, engine_.n_ctx() / 8);  // leave space for a reply
    int dropped = 0;
    for (;;) {
      std::vector<int32_t> p = prompter_.chat(conversation());
      if (int(p.size()) <= room || (o_.on_context_full == "stop" && int(p.size()) <= engine_.n_ctx()))
      {
        if (dropped > 0)
          std::fprintf(stderr, "[context full: dropped the %d oldest exchange%s]\n", dropped, dropped > 1 ? "s" : "");
        return p;
      }
      if (turns_.size() <= 1) {  // the message alone: /reset would not help
        if (int(p.size()) < engine_.n_ctx()) return p;  // the reply gets the room that is left
        std::fprintf(stderr, "[the message is %zu tokens with the chat template%s; the context holds %d: shorten it, "
                     "or start with a larger --ctx]\n", p.size(), system_.empty() ? "" : " and the system prompt",
                     engine_.n_ctx());
        return std::nullopt;
      }
      if (o_.on_context_full == "stop") {
        std::fprintf(stderr, "[context full: the conversation is %zu tokens, the context %d. /reset starts over]\n",
                     p.size(), engine_.n_ctx());
        return std::nullopt;
      }
      turns_.erase(turns_.begin(), turns_.begin() + std::min<size_t>(2, turns_.size() - 1));
      dropped++;
    }
  }

  void reply(const std::string& text) {
    turns_.push_back({"user", text});
    std::optional<std::vector<int32_t>> prompt = fitting_prompt();
    if (!prompt) {
      turns_.pop_back();
      return;
    }
    Request r;
    r.prompt = std::move(*prompt);
    r.sampling = params_;
    r.sampling.seed = resolve_seed(seed_);
    r.max_tokens = max_tokens_;
    r.ignore_eos = o_.sampling.ignore_eos;
    r.stop = o_.sampling.stop;
    r.grammar = grammar_;
    ReplyPrinter printer(!o_.sampling.hide_thinking, isatty(STDOUT_FILENO) == 1);
    printer.attach(r);
    Result res = engine_.generate(std::move(r), &interrupted());
    printer.end();
    check_stdout();  // a reply stopped because stdout failed ends the chat with that error
    if (!res.error.empty()) {
      turns_.pop_back();
      std::fprintf(stderr, "error: %s\n", res.error.c_str());
      return;
    }
    if (res.finish == FinishReason::Cancelled && res.text.empty()) {
      turns_.pop_back();  // stopped before a word of the reply: as if the message was not sent
      std::printf("\n");
      flush_stdout();
      std::fprintf(stderr, "[interrupted]\n");
      clear_interrupt();
      return;
    }
    turns_.push_back({"assistant", res.text});  // the answer only: gpt-oss's template drops past reasoning
    std::printf("\n");
    flush_stdout();
    if (res.finish == FinishReason::Cancelled) {
      std::fprintf(stderr, "[interrupted]\n");
      clear_interrupt();
    }
    if (res.finish == FinishReason::Context)
      std::fprintf(stderr, "[context full (%d tokens): %s]\n", res.n_ctx,
                   o_.on_context_full == "stop" ? "/reset to start over" : "the oldest exchanges go next turn");
    if (show_stats_)
      std::fprintf(stderr, "[%s | context %d/%d | seed %llu]\n",
                   speed_stats(res, fmt::format(" ({} new)", res.prompt_evaluated)).c_str(),
                   res.ctx_used, res.n_ctx, static_cast<unsigned long long>(res.seed));
    if (!tty_) std::printf("\n");  // scripts split answers on the blank line
    flush_stdout();
  }

  // Command feedback: on the terminal with the conversation; piped, on stderr so stdout is answers only.
  void say(const std::string& s) {
    std::FILE* f = tty_ ? stdout : stderr;
    std::fprintf(f, "%s\n", s.c_str());
    std::fflush(f);
  }

  // A slash command; false means leave.
  bool command(const std::string& line) {
    std::istringstream in(line);
    std::string cmd, rest;
    in >> cmd;
    std::getline(in, rest);
    rest = trim(rest);
    if (cmd == "/exit" || cmd == "/quit" || cmd == "/bye") return false;
    if (cmd == "/help") {
      say(kHelp);
    } else if (cmd == "/reset") {
      turns_.clear();
      say("(conversation cleared)");
    } else if (cmd == "/system") {
      system_ = rest;
      say(rest.empty() ? "(system prompt removed)" : "(system prompt set)");
    } else if (cmd == "/stats") {
      show_stats_ = !show_stats_;
      say(show_stats_ ? "(stats on)" : "(stats off)");
    } else if (cmd == "/set") {
      set(rest);
    } else if (cmd == "/save") {
      save(rest);
    } else if (cmd == "/load") {
      load(rest);
    } else {
      say(fmt::format("unknown command {} (/help lists them)", cmd));
    }
    return true;
  }

  void set(const std::string& args) {
    std::istringstream in(args);
    std::string name, value;
    in >> name >> value;
    if (name == "noformat" || (name == "format" && (value == "off" || value == "none"))) {
      grammar_ = nullptr;
      return say("(replies are free text)");
    }
    if (name == "format") {
      if (value != "json") return say("usage: /set format json (or /set noformat)");
      grammar_ = compile_constraint("format", "json", "/set format");
      return say("(replies are JSON objects)");
    }
    const char* usage =
        "usage: /set temp|top_p|top_k|min_p|typical_p|top_n_sigma|xtc_probability|xtc_threshold|mirostat|"
        "mirostat_tau|mirostat_eta|repeat_penalty|presence_penalty|frequency_penalty|dry_multiplier|seed|max_tokens "
        "VALUE, "
        "/set format json, /set noformat";
    if (name.empty()) return say(usage);
    static const std::set<std::string> kNames = {
        "temp",           "temperature",      "top_p",          "top_k",           "min_p",
        "typical_p",      "top_n_sigma",      "xtc_probability", "xtc_threshold",  "mirostat",
        "mirostat_tau",   "mirostat_eta",     "repeat_penalty", "presence_penalty", "frequency_penalty",
        "dry_multiplier", "seed",             "max_tokens"};
    if (!kNames.count(name))
      return say(fmt::format(
          "/set: '{}' is not a setting (temp, top_p, top_k, min_p, typical_p, top_n_sigma, xtc_probability, "
          "xtc_threshold, mirostat, mirostat_tau, mirostat_eta, repeat_penalty, presence_penalty, frequency_penalty, "
          "dry_multiplier, seed, max_tokens, format)",
          name));
    SamplingParams p = params_;
    int max_tokens = max_tokens_;
    if (name == "seed") {  // as --seed: -1 is a random seed each reply (std::stoull would wrap it to 2^64-1)
      if (std::string e = check_seed(value); !e.empty()) return say(fmt::format("/set seed: {}", e));
      seed_ = parse_seed(value);
      return say(seed_ ? fmt::format("(seed = {})", *seed_) : "(seed = -1: a random one each reply, /stats shows it)");
    }
    try {
      size_t used = 0;
      if (name == "temp" || name == "temperature") p.temperature = std::stof(value, &used);
      else if (name == "top_p") p.top_p = std::stof(value, &used);
      else if (name == "top_k") p.top_k = std::stoi(value, &used);
      else if (name == "min_p") p.min_p = std::stof(value, &used);
      else if (name == "typical_p") p.typical_p = std::stof(value, &used);
      else if (name == "top_n_sigma") p.top_n_sigma = std::stof(value, &used);
      else if (name == "xtc_probability") p.xtc_probability = std::stof(value, &used);
      else if (name == "xtc_threshold") p.xtc_threshold = std::stof(value, &used);
      else if (name == "mirostat") p.mirostat = std::stoi(value, &used);
      else if (name == "mirostat_tau") p.mirostat_tau = std::stof(value, &used);
      else if (name == "mirostat_eta") p.mirostat_eta = std::stof(value, &used);
      else if (name == "repeat_penalty") p.repeat_penalty = std::stof(value, &used);
      else if (name == "presence_penalty") p.presence_penalty = std::stof(value, &used);
      else if (name == "frequency_penalty") p.frequency_penalty = std::stof(value, &used);
      else if (name == "dry_multiplier") p.dry_multiplier = std::stof(value, &used);
      else max_tokens = std::stoi(value, &used);
      if (used != value.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::out_of_range&) {
      return say(fmt::format("/set {}: {} is out of range", name, value));
    } catch (const std::exception&) {
      return say(fmt::format("/set {}: '{}' is not a number", name, value));
    }
    if (std::string e = p.validate(); !e.empty()) return say("/set: " + e);
    params_ = p;
    max_tokens_ = max_tokens;
    say(fmt::format("({} = {})", name, value));
  }

  void save(const std::string& path) {
    if (path.empty()) return say("usage: /save FILE");
    if (const std::string what = model_clash(path, o_.model.model, o_.sampling.draft_model); !what.empty())
      return say(fmt::format("/save: {} is {}: writing it would destroy the model", path, what));
    json msgs = json::array();
    for (const auto& t : turns_) msgs.push_back({{"role", t.role}, {"content", t.content}});
    const std::string text =
        json{{"system", system_}, {"messages", msgs}}.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
    // Every step checked, the close too: a full disk shows only when the buffer goes out.
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) return say(fmt::format("/save: cannot write {}: {}", path, std::strerror(errno)));
    const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    int why = wrote ? 0 : errno;
    if (std::fclose(f) != 0 && why == 0) why = errno ? errno : EIO;
    if (!wrote || why != 0) return say(fmt::format("/save: writing {} failed: {}", path, std::strerror(why ? why : EIO)));
    say(fmt::format("(saved {} messages to {})", turns_.size(), path));
  }

  void load(const std::string& path) {
    if (path.empty()) return say("usage: /load FILE");
    std::string text;
    try {
      text = read_text(path);  // a directory or an unreadable file: its reason
    } catch (const Error& e) {
      return say(std::string("/load: ") + e.what());
    }
    json j = json::parse(text, nullptr, false);
    std::vector<Message> turns;
    bool ok = j.is_object() && j.contains("messages") && j["messages"].is_array() &&
              (!j.contains("system") || j["system"].is_string());
    if (ok)
      for (const auto& m : j["messages"]) {
        if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
            !m["content"].is_string()) { ok = false; break; }
        turns.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
      }
    if (!ok) return say(path + " is not a conversation saved by /save");
    system_ = j.value("system", "");
    turns_ = std::move(turns);
    say(fmt::format("(loaded {} messages from {})", turns_.size(), path));
  }

  const ChatOpts& o_;
  Loaded& m_;
  Prompter prompter_;
  Engine engine_;
  bool tty_;
  LineSource input_;
  std::string system_;
  std::vector<Message> turns_;  // user and assistant messages, alternating
  SamplingParams params_;
  std::optional<uint64_t> seed_;
  int max_tokens_ = -1;
  bool show_stats_ = false;
  std::shared_ptr<const Grammar> grammar_;  // every reply's, if the flags gave one
};

int run(const ChatOpts& o) {
  if (std::string e = o.sampling.params.validate(); !e.empty()) fail(ErrorKind::Usage, "{}", e);
  std::shared_ptr<const Grammar> grammar = reply_grammar(o.sampling, o.model.verbose);  // a bad one fails before loading
  Loaded m = load_model(o.model, 1, generation_outputs(o.sampling, 1));
  install_interrupt_handler();
  Chat chat(o, m, std::move(grammar));
  return chat.loop();
}

Register reg{{"chat", "Talk with a model (a REPL on a terminal; one message per line when piped)", [](CLI::App& app) {
  auto o = std::make_shared<ChatOpts>();
  add_model_flags(app, o->model);
  add_sampling_flags(app, o->sampling);
  app.add_option("--on-context-full", o->on_context_full, "when the conversation outgrows the context: drop-oldest (keeps the system prompt) or stop")
      ->check(CLI::IsMember({"stop", "drop-oldest"}))
      ->capture_default_str();
  return [o] { return run(*o); };
}}};

}  // namespace
}  // namespace baton::cli
