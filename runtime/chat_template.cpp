#include "runtime/chat_template.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <ctime>

#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

namespace baton {
namespace {

struct Named {
  const char* name;
  ChatFamily family;
};
const Named kNames[] = {
    {"chatml", ChatFamily::ChatML}, {"llama2", ChatFamily::Llama2}, {"llama3", ChatFamily::Llama3},
    {"mistral", ChatFamily::Mistral}, {"gemma", ChatFamily::Gemma}, {"phi3", ChatFamily::Phi3},
    {"zephyr", ChatFamily::Zephyr}, {"phi4", ChatFamily::Phi4}, {"phi4-mini", ChatFamily::Phi4Mini},
    {"gpt-oss", ChatFamily::GptOss}, {"granite", ChatFamily::Granite}, {"smollm3", ChatFamily::SmolLM3},
    {"olmo2", ChatFamily::Olmo2}, {"glm4", ChatFamily::Glm4},
};

bool contains(std::string_view s, std::string_view what) { return s.find(what) != std::string_view::npos; }

// The local date as strftime("%Y-%m-%d") writes it.
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &local);
  return buf;
}

// Jinja's `trim` / Python's str.strip(): whitespace off both ends.
std::string trim(const std::string& s) {
  auto space = [](uint32_t c) { return unicode::is_whitespace(c) || (c >= 0x1C && c <= 0x1F); };
  const auto cps = unicode::decode(s);
  size_t b = 0, e = cps.size();
  while (b < e && space(cps[b])) ++b;
  while (e > b && space(cps[e - 1])) --e;
  return unicode::encode(std::vector<uint32_t>(cps.begin() + long(b), cps.begin() + long(e)));
}

// Python's str.rstrip(): whitespace off the end only.
std::string rstrip(const std::string& s) {
  auto space = [](uint32_t c) { return unicode::is_whitespace(c) || (c >= 0x1C && c <= 0x1F); };
  auto cps = unicode::decode(s);
  while (!cps.empty() && space(cps.back())) cps.pop_back();
  return unicode::encode(cps);
}

// Python's str.replace(what, ""): every occurrence of `what` taken out, left to right.
std::string erase_all(std::string s, std::string_view what) {
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p)) s.erase(p, what.size());
  return s;
}

// A ChatML template that opens with its own system prompt when the conversation has none (SmolLM2:
// `{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n...<|im_end|>\n' }}`).
std::string chatml_default_system(std::string_view src) {
  if (!contains(src, "!= 'system'") && !contains(src, "!= \"system\"")) return "";
  for (std::string_view open : {"<|im_start|>system\n", "<|im_start|>system\\n"}) {
    size_t p = src.find(open);
    if (p == std::string_view::npos) continue;
    p += open.size();
    size_t e = src.find("<|im_end|>", p);
    if (e == std::string_view::npos) return "";
    std::string_view text = src.substr(p, e - p);
    if (contains(text, "{") || contains(text, "'") || contains(text, "\"")) return "";  // not a literal
    std::string out;  // undo the \n escapes of a Jinja string literal
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == 'n') {
        out += '\n';
        ++i;
      } else {
        out += text[i];
      }
    }
    return out;
  }
  return "";
}

// A Jinja string literal at s[i] ('...' or "...", Python's escapes): its value, i moved past it.
std::optional<std::string> jinja_literal(std::string_view s, size_t& i) {
  if (i >= s.size() || (s[i] != '"' && s[i] != '\'')) return std::nullopt;
  const char quote = s[i++];
  std::string out;
  for (; i < s.size(); ++i) {
    if (s[i] == quote) {
      ++i;
      return out;
    }
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char e = s[++i];
      out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      continue;
    }
    out += s[i];
  }
  return std::nullopt;
}

void skip_space(std::string_view s, size_t& i) {
  while (i < s.size() && std::isspace(uint8_t(s[i]))) ++i;
}

// Granite 3.1+'s own system prompt, for conversations without one: the plain literal of
// `set system_message = "..." + strftime_now('FMT') + "..."` (the date's place and format), and
// what the branch for no tools, documents or thinking appends (`{%- else %}` then
// `set system_message = system_message + "..."`: 3.2, 3.3). Granite 3.0's template has none.
struct GraniteSystem {
  std::string text;
  size_t date_at = std::string::npos;
  std::string date_format;
};
GraniteSystem granite_default_system(std::string_view src) {
  GraniteSystem g;
  constexpr std::string_view kSet = "set system_message = ";
  for (size_t p = src.find(kSet); p != std::string_view::npos; p = src.find(kSet, p + 1)) {
    size_t i = p + kSet.size();
    if (i >= src.size() || (src[i] != '"' && src[i] != '\'')) continue;  // messages[0]['content'], or an append
    GraniteSystem cand;
    while (true) {  // literal | strftime_now('FMT'), joined by +, up to the tag's end
      skip_space(src, i);
      if (auto lit = jinja_literal(src, i)) {
        cand.text += *lit;
      } else if (src.substr(i, 13) == "strftime_now(" && cand.date_at == std::string_view::npos) {
        i += 13;
        auto fmt = jinja_literal(src, i);
        skip_space(src, i);
        if (!fmt || i >= src.size() || src[i] != ')') return {};
        ++i;
        cand.date_at = cand.text.size();
        cand.date_format = *fmt;
      } else {
        return {};  // not a plain expression
      }
      skip_space(src, i);
      if (i < src.size() && src[i] == '+') {
        ++i;
        continue;
      }
      if (src.substr(i, 2) != "%}" && src.substr(i, 3) != "-%}") return {};
      break;
    }
    g = cand;
    break;
  }
  if (g.text.empty()) return g;
  constexpr std::string_view kAppend = "set system_message = system_message + ";
  for (size_t p = src.find(kAppend); p != std::string_view::npos; p = src.find(kAppend, p + 1)) {
    size_t b = p;  // the tag opening this set, and what comes before it
    while (b > 0 && src[b - 1] != '{') --b;
    if (b < 2) continue;
    std::string_view before = src.substr(0, b - 1);
    while (!before.empty() && std::isspace(uint8_t(before.back()))) before.remove_suffix(1);
    if (!before.ends_with("else %}") && !before.ends_with("else -%}")) continue;
    size_t i = p + kAppend.size();
    if (auto lit = jinja_literal(src, i)) g.text += *lit;
    break;
  }
  return g;
}

// strftime's %B %b %d %m %Y %y %% for a YYYY-MM-DD date (English month names, as Python's C locale).
std::string format_date(std::string_view fmt, const std::string& ymd) {
  static const char* kMonths[] = {"January", "February", "March",     "April",   "May",      "June",
                                  "July",    "August",   "September", "October", "November", "December"};
  const int month = ymd.size() >= 7 ? std::clamp(std::atoi(ymd.c_str() + 5), 1, 12) : 1;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%' || i + 1 == fmt.size()) {
      out += fmt[i];
      continue;
    }
    switch (fmt[++i]) {
      case 'B': out += kMonths[month - 1]; break;
      case 'b': out += std::string(kMonths[month - 1]).substr(0, 3); break;
      case 'd': out += ymd.substr(8, 2); break;
      case 'm': out += ymd.substr(5, 2); break;
      case 'Y': out += ymd.substr(0, 4); break;
      case 'y': out += ymd.substr(2, 2); break;
      case '%': out += '%'; break;
      default: out += '%', out += fmt[i];
    }
  }
  return out;
}

// SmolLM3's system block. Reasoning off unless the system message says /think (a /no_think in it
// wins; the template's enable_thinking, which Baton leaves false); the markers taken out of the
// instructions. /system_override: the instructions alone, no metadata. The default instructions
// are the template's literals (its /think one asks for the <think> Thought </think> Solution form).
constexpr const char* kSmolThinkInstructions =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves "
    "thoroughly exploring questions through a systematic thinking process before providing the final precise and "
    "accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, "
    "reassessment, reflection, backtracking, and iteration to develop well-considered thinking process. Please "
    "structure your response into two main sections: Thought and Solution using the specified format: <think> "
    "Thought section </think> Solution section. In the Thought section, detail your reasoning process in steps. Each "
    "step should include detailed considerations such as analysing questions, summarizing relevant findings, "
    "brainstorming new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting "
    "previous steps. In the Solution section, based on various attempts, explorations, and reflections from the "
    "Thought section, systematically present the final solution that you deem correct. The Solution section should "
    "be logical, accurate, and concise and detail necessary steps needed to reach the conclusion.";
constexpr const char* kSmolInstructions = "You are a helpful AI assistant named SmolLM, trained by Hugging Face.";

std::optional<ChatFamily> family_from_markers(std::string_view s) {
  if (contains(s, "<|channel|>")) return ChatFamily::GptOss;
  if (contains(s, "<|im_start|>") && contains(s, "Reasoning Mode: ")) return ChatFamily::SmolLM3;
  if (contains(s, "<|start_of_role|>")) return ChatFamily::Granite;
  if (contains(s, "<|im_sep|>")) return ChatFamily::Phi4;
  if (contains(s, "<|im_start|>")) return ChatFamily::ChatML;
  if (contains(s, "<start_of_turn>")) return ChatFamily::Gemma;
  if (contains(s, "<|start_header_id|>")) return ChatFamily::Llama3;
  if (contains(s, "[gMASK]<sop>")) return ChatFamily::Glm4;  // (before Zephyr: it has <|user|> and <|assistant|> too)
  const bool user_or_assistant = contains(s, "<|user|>") || contains(s, "<|assistant|>");
  if (user_or_assistant && contains(s, "<|end|>")) return ChatFamily::Phi3;
  // Tülu 3 / OLMo 2 Instruct: Zephyr's markers, but BOS first and turns that end in a newline, not EOS.
  if (user_or_assistant && contains(s, "bos_token") &&
      (contains(s, "message['content'] + '\n'") || contains(s, "message['content'] + '\\n'")))
    return ChatFamily::Olmo2;
  if (user_or_assistant) return ChatFamily::Zephyr;
  if (contains(s, "[INST]")) return contains(s, "<<SYS>>") ? ChatFamily::Llama2 : ChatFamily::Mistral;
  return std::nullopt;
}

}  // namespace

const char* chat_family_name(ChatFamily f) {
  for (const Named& n : kNames)
    if (n.family == f) return n.name;
  return "?";
}

std::string chat_family_names() {
  std::string s;
  for (const Named& n : kNames) s += std::string(s.empty() ? "" : ", ") + n.name;
  return s;
}

std::optional<ChatFamily> chat_family_from_name(std::string_view name) {
  auto key = [](std::string_view s) {  // "Phi-4_mini" and "phi4mini" are the same name
    std::string k;
    for (char c : s)
      if (c != '-' && c != '_' && c != '.') k += char(std::tolower(uint8_t(c)));
    return k;
  };
  std::string k = key(name);
  if (k == "gemma3" || k == "gemma2") k = "gemma";
  if (k == "llama") k = "llama2";
  if (k == "phi") k = "phi3";
  if (k == "harmony") k = "gptoss";
  if (k == "tulu" || k == "tulu3" || k == "olmo") k = "olmo2";
  if (k == "glm" || k == "glmz1" || k == "chatglm4") k = "glm4";
  for (const Named& n : kNames)
    if (k == key(n.name)) return n.family;
  return std::nullopt;
}

ChatTemplate::ChatTemplate(ChatFamily family, std::string bos_text, std::string eos_text, std::string default_system)
    : family_(family), bos_(std::move(bos_text)), eos_(std::move(eos_text)), default_system_(std::move(default_system)),
      date_(today()) {}

std::string ChatTemplate::default_system() const {
  if (date_at_ == std::string::npos) return default_system_;
  return default_system_.substr(0, date_at_) + format_date(date_format_, date_) + default_system_.substr(date_at_);
}

void ChatTemplate::take_default_system(std::string_view src) {
  if (family_ == ChatFamily::ChatML) default_system_ = chatml_default_system(src);
  if (family_ == ChatFamily::SmolLM3) {  // HuggingFaceTB's template dates its system block; some copies do not
    size_t i = src.find("strftime_now(");
    if (i == std::string_view::npos) {  // (chosen by name for a file with another template: dated, as HF's)
      if (!contains(src, "Reasoning Mode: ")) date_format_ = "%d %B %Y";
      return;
    }
    i += 13;
    if (auto fmt = jinja_literal(src, i)) date_format_ = *fmt;
    return;
  }
  if (family_ == ChatFamily::Glm4) {
    // The generation prompt's text after <|assistant|>: "{% if add_generation_prompt %}<|assistant|>TEXT{% endif %}"
    // (GLM-Z1: a newline and <think>). A template without that literal keeps the newline.
    const std::string_view open = "add_generation_prompt %}<|assistant|>";
    if (const size_t i = src.find(open); i != std::string_view::npos) {
      const size_t from = i + open.size(), to = src.find("{%", from);
      if (to != std::string_view::npos) glm_reply_open_ = std::string(src.substr(from, to - from));
    }
    glm_visible_ = contains(src, "split('</think>')");
    return;
  }
  if (family_ != ChatFamily::Granite) return;
  GraniteSystem g = granite_default_system(src);
  default_system_ = std::move(g.text);
  date_at_ = g.date_at;
  date_format_ = std::move(g.date_format);
}

ChatTemplate ChatTemplate::detect(std::string_view jinja, std::string bos_text, std::string eos_text,
                                  std::string* warning) {
  if (auto f = family_from_markers(jinja)) {
    // Phi-4-mini writes Phi-3's turns with no newline anywhere (neither a real one nor a "\n" escape).
    if (*f == ChatFamily::Phi3 && !contains(jinja, "\n") && !contains(jinja, "\\n")) f = ChatFamily::Phi4Mini;
    ChatTemplate t(*f, std::move(bos_text), std::move(eos_text));
    t.take_default_system(jinja);
    return t;
  }
  if (warning)
    *warning = jinja.empty() ? "the model has no chat template; using chatml (choose another with --chat-template NAME)"
                             : "unrecognised chat template; using chatml (choose another with --chat-template NAME: " +
                                   chat_family_names() + ")";
  return ChatTemplate(ChatFamily::ChatML, std::move(bos_text), std::move(eos_text));
}

ChatTemplate ChatTemplate::for_model(const gguf::File& f, const Tokenizer& tok, const std::string& override_name,
                                     std::string* warning) {
  const std::string bos(tok.bos() >= 0 ? tok.token_text(tok.bos()) : "");
  const std::string eos(tok.eos() >= 0 ? tok.token_text(tok.eos()) : "");
  const std::string src = f.get_or<std::string>("tokenizer.chat_template", "");
  if (!override_name.empty()) {
    auto fam = chat_family_from_name(override_name);
    if (!fam) fail(ErrorKind::Usage, "--chat-template {}: unknown template (known: {})", override_name, chat_family_names());
    ChatTemplate t(*fam, bos, eos);
    t.take_default_system(src);
    return t;
  }
  if (!src.empty()) return detect(src, bos, eos, warning);
  // No template in the file (the Gemma 3 270M GGUF has none): the vocabulary's markers tell.
  for (const char* marker : {"<|channel|>", "<|im_start|>", "<start_of_turn>", "<|start_header_id|>", "<|start_of_role|>",
                             "[gMASK]", "<|user|>", "[INST]"}) {
    auto id = tok.find_token(marker);
    if (!id) continue;
    std::string probe = marker;
    if (probe == "<|user|>" && tok.find_token("<|end|>")) probe += "<|end|>";
    if (probe == "[gMASK]") probe += "<sop>";  // (GLM-4's vocabulary)
    if (auto fam = family_from_markers(probe)) return ChatTemplate(*fam, bos, eos);
  }
  return detect("", bos, eos, warning);
}

bool ChatTemplate::starts_with_bos() const {
  switch (family_) {
    case ChatFamily::Llama2: case ChatFamily::Llama3: case ChatFamily::Mistral: case ChatFamily::Gemma:
    case ChatFamily::Phi3: case ChatFamily::Olmo2:
      return !bos_.empty();
    case ChatFamily::ChatML: case ChatFamily::Zephyr: case ChatFamily::Phi4: case ChatFamily::Phi4Mini:
    case ChatFamily::GptOss: case ChatFamily::Granite: case ChatFamily::SmolLM3: case ChatFamily::Glm4:
      return false;
  }
  return false;
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  return render_impl(messages, add_generation_prompt, /*closing=*/true);
}

std::optional<std::string> ChatTemplate::render_continuation(const std::vector<ChatMessage>& history,
                                                             const std::vector<ChatMessage>& added,
                                                             bool add_generation_prompt) const {
  std::vector<ChatMessage> all = history;
  all.insert(all.end(), added.begin(), added.end());
  const std::string full = render_impl(all, add_generation_prompt, true);
  const std::string base = render_impl(history, false, /*closing=*/false);
  if (full.compare(0, base.size(), base) != 0) return std::nullopt;
  return full.substr(base.size());
}

// Each case mirrors its family's Jinja template; comments name the template's quirks.
std::string ChatTemplate::render_impl(const std::vector<ChatMessage>& msgs, bool gen, bool closing) const {
  std::string out;
  // Templates that fold the system prompt into the first turn take it off the front.
  const bool has_system = !msgs.empty() && msgs[0].role == "system";
  const std::string system = has_system ? msgs[0].content : "";
  const size_t first = has_system ? 1 : 0;

  switch (family_) {
    case ChatFamily::ChatML:
      if (!has_system && !default_system_.empty() && !msgs.empty())
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      for (const auto& m : msgs) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (gen) out += "<|im_start|>assistant\n";
      break;

    case ChatFamily::Llama2:
      // <<SYS>> block inside the first [INST]; every user turn starts with BOS; content is stripped.
      for (size_t i = first; i < msgs.size(); ++i) {
        std::string content = msgs[i].content;
        if (i == first && has_system) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
        if (msgs[i].role == "user")
          out += bos_ + "[INST] " + trim(content) + " [/INST]";
        else if (msgs[i].role == "assistant")
          out += " " + trim(content) + " " + eos_;
      }
      break;

    case ChatFamily::Llama3:
      for (size_t i = 0; i < msgs.size(); ++i) {
        if (i == 0) out += bos_;
        out += "<|start_header_id|>" + msgs[i].role + "<|end_header_id|>\n\n" + trim(msgs[i].content) + "<|eot_id|>";
      }
      if (gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;

    case ChatFamily::Mistral:
      // Mistral's v0.1/v0.2 template has no system role (it raises); like later Mistral templates
      // we put the system prompt in front of the first user message, separated by a blank line.
      out += bos_;
      for (size_t i = first; i < msgs.size(); ++i) {
        std::string content = msgs[i].content;
        if (i == first && has_system) content = system + "\n\n" + content;
        if (msgs[i].role == "user")
          out += "[INST] " + content + " [/INST]";
        else if (msgs[i].role == "assistant")
          out += content + eos_;
      }
      break;

    case ChatFamily::Gemma:
      // Gemma has no system turn: the system prompt opens the first turn. "assistant" is "model".
      out += bos_;
      for (size_t i = first; i < msgs.size(); ++i) {
        const std::string role = msgs[i].role == "assistant" ? "model" : msgs[i].role;
        out += "<start_of_turn>" + role + "\n";
        if (i == first && has_system) out += system + "\n\n";
        out += trim(msgs[i].content) + "<end_of_turn>\n";
      }
      if (gen) out += "<start_of_turn>model\n";
      break;

    case ChatFamily::Phi3:
      out += bos_;
      for (const auto& m : msgs) out += "<|" + m.role + "|>\n" + m.content + "<|end|>\n";
      if (gen)
        out += "<|assistant|>\n";
      else if (closing)
        out += eos_;  // the template ends a conversation without a generation prompt with EOS
      break;

    case ChatFamily::Phi4:  // only the three roles are written
      for (const auto& m : msgs)
        if (m.role == "system" || m.role == "user" || m.role == "assistant")
          out += "<|im_start|>" + m.role + "<|im_sep|>" + m.content + "<|im_end|>";
      if (gen) out += "<|im_start|>assistant<|im_sep|>";
      break;

    case ChatFamily::Phi4Mini:
      for (const auto& m : msgs) out += "<|" + m.role + "|>" + m.content + "<|end|>";
      if (gen)
        out += "<|assistant|>";
      else if (closing)
        out += eos_;  // as Phi-3's template
      break;

    case ChatFamily::Olmo2:
      // A reply ends with EOS, and a newline unless it is the conversation's last message; other
      // roles are not written.
      out += bos_;
      for (size_t i = 0; i < msgs.size(); ++i) {
        const ChatMessage& m = msgs[i];
        if (m.role == "system" || m.role == "user") out += "<|" + m.role + "|>\n" + m.content + "\n";
        else if (m.role == "assistant") out += "<|assistant|>\n" + m.content + eos_ + (i + 1 < msgs.size() ? "\n" : "");
      }
      if (gen && !msgs.empty()) out += "<|assistant|>\n";
      break;

    case ChatFamily::Zephyr:
      for (const auto& m : msgs)
        if (m.role == "user" || m.role == "system" || m.role == "assistant")
          out += "<|" + m.role + "|>\n" + m.content + eos_ + "\n";
      if (gen && !msgs.empty()) out += "<|assistant|>\n";
      break;

    case ChatFamily::Glm4: {
      // Every system message first (the template's own loop over them), then the other turns in
      // order, none closed; observation turns (tool results) as the template writes them, other
      // roles not at all. Tools (the template's system block listing them) are not supported.
      out += "[gMASK]<sop>";
      for (const auto& m : msgs)
        if (m.role == "system") out += "<|system|>\n" + m.content;
      for (const auto& m : msgs) {
        if (m.role != "user" && m.role != "assistant" && m.role != "observation") continue;
        std::string text = m.content;
        if (glm_visible_) {  // content.split('</think>')[-1].strip()
          const size_t end = text.rfind("</think>");
          text = trim(end == std::string::npos ? text : text.substr(end + 8));
        }
        out += "<|" + m.role + "|>\n" + text;
      }
      if (gen) out += "<|assistant|>" + glm_reply_open_;
      break;
    }

    case ChatFamily::Granite: {
      // A conversation's system message, else the template's own (Granite 3.1+: dated; 3.0: none).
      // The generation prompt opens only after a message other than the system one.
      const std::string sys = has_system ? system : default_system();
      if (has_system || !sys.empty()) out += "<|start_of_role|>system<|end_of_role|>" + sys + "<|end_of_text|>\n";
      for (size_t i = first; i < msgs.size(); ++i)
        out += "<|start_of_role|>" + msgs[i].role + "<|end_of_role|>" + msgs[i].content + "<|end_of_text|>\n";
      // (Granite 3.0's template, with no system prompt of its own, loops over the system message too.)
      if (gen && (msgs.size() > first || (has_system && default_system_.empty())))
        out += "<|start_of_role|>assistant<|end_of_role|>";
      break;
    }

    case ChatFamily::SmolLM3: {
      // Its system block always comes first (from the conversation's system message, if any, which
      // the turns then skip); reasoning_mode decides the replies' empty think blocks. Tool turns
      // are written as user turns, as the template does; tools themselves are not supported.
      bool think = false;
      std::string instructions;
      if (has_system) {
        if (contains(system, "/no_think")) think = false;
        else if (contains(system, "/think")) think = true;
        instructions = rstrip(erase_all(erase_all(system, "/no_think"), "/think"));
      }
      out += "<|im_start|>system\n";
      if (has_system && contains(system, "/system_override")) {
        out += rstrip(erase_all(instructions, "/system_override")) + "<|im_end|>\n";
      } else {
        out += "## Metadata\n\nKnowledge Cutoff Date: June 2025\n";
        if (!date_format_.empty()) out += "Today Date: " + format_date(date_format_, date_) + "\n";
        out += std::string("Reasoning Mode: ") + (think ? "/think" : "/no_think") + "\n\n## Custom Instructions\n\n";
        out += (!instructions.empty() ? instructions : think ? kSmolThinkInstructions : kSmolInstructions) + "\n\n";
        out += "<|im_end|>\n";
      }
      const char* open_reply = think ? "<|im_start|>assistant\n" : "<|im_start|>assistant\n<think>\n\n</think>\n";
      for (const auto& m : msgs) {
        if (m.role == "user" || m.role == "tool") {
          out += "<|im_start|>user\n" + m.content + "<|im_end|>\n";
        } else if (m.role == "assistant") {
          const size_t lead = m.content.find_first_not_of('\n');  // (the template's lstrip("\n"))
          out += open_reply + (lead == std::string::npos ? "" : m.content.substr(lead)) + "<|im_end|>\n";
        }
      }
      if (gen) out += open_reply;
      break;
    }

    case ChatFamily::GptOss: {
      // Harmony: the template's own system message (identity, knowledge cutoff, date, reasoning
      // effort, channels) always comes first; a system (or developer) message of the conversation
      // becomes the developer message's instructions. No tools, no reasoning_effort other than
      // the template's default.
      out += "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
             "Knowledge cutoff: 2024-06\nCurrent date: " + date_ + "\n\nReasoning: medium\n\n"
             "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>";
      const bool instructions = !msgs.empty() && (msgs[0].role == "system" || msgs[0].role == "developer");
      if (instructions && !msgs[0].content.empty())
        out += "<|start|>developer<|message|># Instructions\n\n" + msgs[0].content + "\n\n<|end|>";
      for (size_t i = instructions ? 1 : 0; i < msgs.size(); ++i) {
        const ChatMessage& m = msgs[i];
        if (m.role == "user") {
          out += "<|start|>user<|message|>" + m.content + "<|end|>";
        } else if (m.role == "assistant") {
          // Past replies keep only their final channel: the template drops their analysis. A
          // conversation that ends with a reply (no generation prompt) closes it with <|return|>,
          // as the model wrote it; a history to be continued keeps <|end|>, as the next render has it.
          const bool last = i + 1 == msgs.size() && !gen && closing;
          out += "<|start|>assistant<|channel|>final<|message|>" + m.content + (last ? "<|return|>" : "<|end|>");
        }
        // Other roles in the middle (a later system message) the template does not write either.
      }
      if (gen) out += "<|start|>assistant";
      break;
    }
  }
  return out;
}

}  // namespace baton
