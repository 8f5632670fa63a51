// Chat templates: the prompt formats of the common instruct model families, written out in C++
// (no Jinja engine) so that they render exactly what the model's own Jinja template renders for
// plain system/user/assistant conversations. The family is detected from `tokenizer.chat_template`
// (or, when a file has none, from the vocabulary's turn markers), or chosen by name.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace baton {
namespace gguf { class File; }
class Tokenizer;

// Phi4: ChatML's turns with <|im_sep|> after the role (Phi-4 14B). Phi4Mini: Phi-3's turns without
// the newlines (Phi-4-mini). GptOss: OpenAI's harmony format (gpt-oss; replies: runtime/harmony.h).
// Granite: IBM Granite 3's <|start_of_role|>ROLE<|end_of_role|>...<|end_of_text|> turns. SmolLM3:
// ChatML's turns after a system block of its own (metadata, the reasoning mode, the instructions),
// replies opened with an empty <think> block while reasoning is off. Olmo2: AllenAI's Tülu 3 turns
// (OLMo 2 Instruct): BOS, then <|system|>/<|user|> turns ending in a newline, replies ending in EOS.
// Glm4: GLM-4-0414 / GLM-Z1: [gMASK]<sop>, the system messages first, then <|user|>/<|assistant|>
// turns with no end marker; GLM-Z1's drops a reply's reasoning (up to </think>) and opens <think>.
enum class ChatFamily { ChatML, Llama2, Llama3, Mistral, Gemma, Phi3, Zephyr, Phi4, Phi4Mini, GptOss, Granite, SmolLM3,
                        Olmo2, Glm4 };

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

const char* chat_family_name(ChatFamily f);  // "chatml", "llama2", ...
// By name (case-insensitive; "gemma3", "llama-3", "phi-3" ... accepted too).
std::optional<ChatFamily> chat_family_from_name(std::string_view name);
// All names, for help texts and error messages: "chatml, llama2, ...".
std::string chat_family_names();

class ChatTemplate {
 public:
  // bos/eos: the texts of the model's BOS and EOS tokens (some templates write them out).
  ChatTemplate(ChatFamily family, std::string bos_text, std::string eos_text, std::string default_system = "");

  // Detects the family from Jinja source. An empty or unrecognised source gives ChatML and sets
  // *warning to a sentence naming the fallback.
  static ChatTemplate detect(std::string_view jinja, std::string bos_text, std::string eos_text,
                             std::string* warning = nullptr);
  // For a model: `override_name` (from --chat-template; Error(Usage) if unknown) wins; otherwise
  // `tokenizer.chat_template`; otherwise the vocabulary's markers (<|im_start|>, <start_of_turn>, ...).
  static ChatTemplate for_model(const gguf::File& f, const Tokenizer& tok, const std::string& override_name = "",
                                std::string* warning = nullptr);

  ChatFamily family() const { return family_; }
  const char* name() const { return chat_family_name(family_); }
  // ChatML templates such as SmolLM2's insert their own system prompt when the conversation has none;
  // so do Granite 3.1+'s, with today's date in it (date_format: strftime's, e.g. "%B %d, %Y").
  std::string default_system() const;
  // gpt-oss's system message states today's date (the template's strftime_now("%Y-%m-%d")): the
  // local date when the template was made, kept for its lifetime so that a conversation's prompt
  // does not change under its KV cache at midnight. Tests fix it.
  const std::string& date() const { return date_; }
  void set_date(std::string yyyy_mm_dd) { date_ = std::move(yyyy_mm_dd); }

  // The whole conversation; with add_generation_prompt the assistant's turn is opened at the end.
  // The text may contain BOS/special-token text: tokenize it with parse_special and without adding
  // another BOS when it already starts with one (starts_with_bos()).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  // Whether render() output begins with the BOS text (Llama 2/3, Mistral, Gemma, Phi-3 do).
  bool starts_with_bos() const;

  // For a chat that keeps its KV cache: the text to append after `history` (which was rendered
  // with render(history, false), i.e. it ends after the last reply's end-of-turn) to add `added`
  // and open the next reply. nullopt when this template cannot extend the history in place (the
  // caller then re-renders everything).
  std::optional<std::string> render_continuation(const std::vector<ChatMessage>& history,
                                                 const std::vector<ChatMessage>& added,
                                                 bool add_generation_prompt = true) const;

 private:
  std::string render_impl(const std::vector<ChatMessage>& messages, bool add_generation_prompt, bool closing) const;
  // The template's own system prompt, when its family has one (ChatML: SmolLM2's; Granite 3.1+'s, dated).
  void take_default_system(std::string_view src);

  ChatFamily family_;
  std::string bos_, eos_, default_system_;
  std::string date_;
  // Granite: today's date, formatted by date_format_, goes into default_system_ at date_at_ (npos: no date).
  // SmolLM3: its system block's "Today Date" line, formatted by date_format_ (empty: the template has none).
  size_t date_at_ = std::string::npos;
  std::string date_format_;
  // Glm4: what the generation prompt writes after <|assistant|> (GLM-Z1's "\n<think>"), and whether
  // each message's text is its part after the last </think>, stripped (GLM-Z1's `visible`).
  std::string glm_reply_open_ = "\n";
  bool glm_visible_ = false;
};

}  // namespace baton
