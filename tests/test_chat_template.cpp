// Chat templates against the real Jinja templates: tests/data/chat_templates/expected.json holds
// what Jinja2 renders for each family's published template (tools/gen_chat_fixtures.py). A
// template that writes today's date (gpt-oss, Granite, SmolLM3) was rendered with the fixture's "date".
#include <cctype>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "helpers.h"
#include "runtime/chat_template.h"

using namespace baton;

namespace {

std::string dir() { return std::string(BATON_TEST_DATA) + "/chat_templates/"; }

// Role and content; a reply's "thinking" (gpt-oss fixtures) is what the template drops.
std::vector<ChatMessage> messages_of(const nlohmann::json& j) {
  std::vector<ChatMessage> out;
  for (const auto& m : j) out.push_back({m["role"], m["content"]});
  return out;
}

// The fixture's template, dated as the fixture was rendered.
ChatTemplate fixture_template(const std::string& name, const nlohmann::json& fx, std::string* warning = nullptr) {
  ChatTemplate t = ChatTemplate::detect(test::read_all(dir() + name + ".jinja"), fx["bos_token"], fx["eos_token"], warning);
  if (fx.contains("date")) t.set_date(fx["date"]);
  return t;
}

ChatFamily family_of_fixture(const std::string& name) {
  if (name == "smollm2") return ChatFamily::ChatML;
  if (name == "gemma3") return ChatFamily::Gemma;
  auto f = chat_family_from_name(name);
  REQUIRE(f);
  return *f;
}

}  // namespace

TEST_CASE("each family renders exactly what its Jinja template renders") {
  auto j = nlohmann::json::parse(test::read_all(dir() + "expected.json"));
  REQUIRE(j.size() == 14);
  size_t compared = 0;
  for (const auto& [name, fx] : j.items()) {
    std::string warning;
    ChatTemplate t = fixture_template(name, fx, &warning);
    INFO("template " << name);
    CHECK(warning.empty());
    CHECK(t.family() == family_of_fixture(name));
    for (const auto& c : fx["cases"]) {
      if (c["expected"].is_null()) continue;  // the template refuses this conversation
      auto msgs = messages_of(c["messages"]);
      std::string want = c["expected"];
      std::string got = t.render(msgs, c["add_generation_prompt"]);
      INFO("messages: " << c["messages"].dump());
      CHECK(got == want);
      ++compared;
    }
  }
  CHECK(compared >= 56);
}

TEST_CASE("a new turn after a rendered history is exactly the tail of the full rendering") {
  auto j = nlohmann::json::parse(test::read_all(dir() + "expected.json"));
  for (const auto& [name, fx] : j.items()) {
    ChatTemplate t = fixture_template(name, fx);
    auto all = messages_of(fx["cases"][0]["messages"]);  // system, user, assistant, user
    std::vector<ChatMessage> history(all.begin(), all.end() - 1);
    auto tail = t.render_continuation(history, {all.back()});
    INFO("template " << name);
    REQUIRE(tail);
    // What a REPL feeds: the history as rendered (without any closing token), then the tail.
    std::string fed = t.render(history, false);
    if (t.family() == ChatFamily::Phi3 || t.family() == ChatFamily::Phi4Mini) fed.resize(fed.size() - std::string(fx["eos_token"]).size());
    // gpt-oss closes a conversation's last reply with <|return|>, an earlier one with <|end|>.
    if (t.family() == ChatFamily::GptOss) fed.replace(fed.rfind("<|return|>"), std::string::npos, "<|end|>");
    CHECK(fed + *tail == t.render(all, true));
    if (!fx["cases"][0]["expected"].is_null()) CHECK(fed + *tail == std::string(fx["cases"][0]["expected"]));
  }
}

TEST_CASE("SmolLM2's template brings its own system prompt") {
  ChatTemplate t = ChatTemplate::detect(test::read_all(dir() + "smollm2.jinja"), "<|im_start|>", "<|im_end|>");
  CHECK(t.default_system() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  CHECK(t.render({{"user", "Hi"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // A plain ChatML template has none.
  CHECK(ChatTemplate::detect(test::read_all(dir() + "chatml.jinja"), "", "").default_system().empty());
}

TEST_CASE("Mistral folds a system prompt into the first user message") {
  ChatTemplate t(ChatFamily::Mistral, "<s>", "</s>");
  CHECK(t.render({{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}}, true) ==
        "<s>[INST] Be brief.\n\nHi [/INST]Hello</s>[INST] Bye [/INST]");
  CHECK(t.starts_with_bos());
}

TEST_CASE("detection, names and the fallback warning") {
  CHECK(chat_family_from_name("ChatML") == ChatFamily::ChatML);
  CHECK(chat_family_from_name("gemma3") == ChatFamily::Gemma);
  CHECK(chat_family_from_name("llama-3") == ChatFamily::Llama3);
  CHECK(chat_family_from_name("phi-3") == ChatFamily::Phi3);
  CHECK(chat_family_from_name("phi-4-mini") == ChatFamily::Phi4Mini);
  CHECK(chat_family_from_name("harmony") == ChatFamily::GptOss);
  CHECK(chat_family_from_name("gpt_oss") == ChatFamily::GptOss);
  CHECK_FALSE(chat_family_from_name("vicuna"));
  for (ChatFamily f : {ChatFamily::ChatML, ChatFamily::Llama2, ChatFamily::Llama3, ChatFamily::Mistral,
                       ChatFamily::Gemma, ChatFamily::Phi3, ChatFamily::Zephyr, ChatFamily::Phi4, ChatFamily::Phi4Mini,
                       ChatFamily::GptOss, ChatFamily::Granite, ChatFamily::SmolLM3, ChatFamily::Olmo2, ChatFamily::Glm4})
    CHECK(chat_family_from_name(chat_family_name(f)) == f);

  std::string warning;
  ChatTemplate t = ChatTemplate::detect("{{ 'USER: ' + messages[0]['content'] }}", "<s>", "</s>", &warning);
  CHECK(t.family() == ChatFamily::ChatML);
  CHECK_THAT(warning, Catch::Contains("chatml"));
  warning.clear();
  ChatTemplate::detect("", "", "", &warning);
  CHECK_THAT(warning, Catch::Contains("no chat template"));
}

// GLM-4-0414 / GLM-Z1 (no fixture: its Jinja source is not in tests/data). The expected strings
// follow from the template's semantics as transformers renders it (trim_blocks, lstrip_blocks):
// "[gMASK]<sop>", then "<|system|>\n" + content for every system message, then for each other
// message "<|user|>\n" or "<|assistant|>\n" + its text (GLM-Z1: content.split('</think>')[-1].strip()),
// nothing closing a turn, and the generation prompt "<|assistant|>" followed by the literal the
// template puts there (GLM-Z1: "\n<think>"). Below, fragments with those features, not the template.
TEST_CASE("GLM-4: [gMASK]<sop>, system messages first, open turns; GLM-Z1's visible text and <think>") {
  const std::string z1 = "[gMASK]<sop>\n{%- for msg in messages %}...{%- endfor %}\n"
                         "{%- set visible = content.split('</think>')[-1].strip() %}<|user|>\n{{ visible }}\n"
                         "{% if add_generation_prompt %}<|assistant|>\n<think>{% endif %}";
  std::string warning;
  ChatTemplate t = ChatTemplate::detect(z1, "<|endoftext|>", "<|endoftext|>", &warning);
  REQUIRE(t.family() == ChatFamily::Glm4);  // (not Zephyr, whose <|user|> and <|assistant|> it shares)
  CHECK(warning.empty());
  CHECK_FALSE(t.starts_with_bos());
  const std::vector<ChatMessage> history = {
      {"user", "Hi "}, {"system", "Be brief."}, {"assistant", "<think>plan</think>\n\nHello!\n"}};
  CHECK(t.render(history, false) == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello!");
  CHECK(t.render({{"user", "2+2?"}}, true) == "[gMASK]<sop><|user|>\n2+2?<|assistant|>\n<think>");
  const auto tail = t.render_continuation({{"user", "Hi"}, {"assistant", "Hello!"}}, {{"user", "2+2?"}});
  REQUIRE(tail);
  CHECK(*tail == "<|user|>\n2+2?<|assistant|>\n<think>");
  // GLM-4-0414's own: the text as it is, the generation prompt's literal as the template has it.
  const std::string plain = "[gMASK]<sop>{%- for msg in messages %}...{%- endfor %}"
                            "{% if add_generation_prompt %}<|assistant|>{% endif %}";
  t = ChatTemplate::detect(plain, "<|endoftext|>", "<|endoftext|>");
  REQUIRE(t.family() == ChatFamily::Glm4);
  CHECK(t.render({{"user", " a "}, {"assistant", "<think>x</think> y"}, {"user", "b"}}, true) ==
        "[gMASK]<sop><|user|>\n a <|assistant|>\n<think>x</think> y<|user|>\nb<|assistant|>");
  // By name, without the template: a newline after <|assistant|>, as llama.cpp's chatglm4 writes it.
  CHECK(chat_family_from_name("GLM-Z1") == ChatFamily::Glm4);
  CHECK(ChatTemplate(ChatFamily::Glm4, "", "").render({{"user", "q"}}, true) == "[gMASK]<sop><|user|>\nq<|assistant|>\n");
}

TEST_CASE("Granite: its own system prompt, dated as strftime('%B %d, %Y'), only without a system message") {
  ChatTemplate t = ChatTemplate::detect(test::read_all(dir() + "granite.jinja"), "<|end_of_text|>", "<|end_of_text|>");
  REQUIRE(t.family() == ChatFamily::Granite);
  CHECK_FALSE(t.starts_with_bos());
  t.set_date("2024-12-06");
  CHECK(t.default_system() ==
        "Knowledge Cutoff Date: April 2024. Today's Date: December 06, 2024. You are Granite, developed by IBM. "
        "You are a helpful AI assistant.");
  CHECK(t.render({{"user", "Hi"}}, true) ==
        "<|start_of_role|>system<|end_of_role|>" + t.default_system() + "<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>");
  // A template whose prompt is other literals around the date (escaped newlines), with no else branch.
  const std::string other =
      "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}{%- else %}"
      "{%- set system_message = \"Cutoff.\\nToday: \" + strftime_now('%Y-%m-%d') + '.\\nGranite.' %}{%- endif %}"
      "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}";
  ChatTemplate o = ChatTemplate::detect(other, "", "");
  o.set_date("2025-01-31");
  CHECK(o.default_system() == "Cutoff.\nToday: 2025-01-31.\nGranite.");
  // Granite 3.0's template writes the conversation's messages and nothing of its own.
  ChatTemplate plain = ChatTemplate::detect(
      "{%- for message in messages %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + "
      "message['content'] + '<|end_of_text|>\n' }}{%- endfor %}", "", "");
  CHECK(plain.default_system().empty());
  CHECK(plain.render({{"user", "Hi"}}, true) ==
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>");
  CHECK(chat_family_from_name("Granite") == ChatFamily::Granite);
}

// (The fixtures cover the /think, /no_think and /system_override system messages.)
TEST_CASE("SmolLM3: its system block dated as strftime('%d %B %Y'), reasoning off unless the system says /think") {
  const std::string src = test::read_all(dir() + "smollm3.jinja");
  ChatTemplate t = ChatTemplate::detect(src, "<|begin_of_text|>", "<|im_end|>");
  REQUIRE(t.family() == ChatFamily::SmolLM3);
  CHECK_FALSE(t.starts_with_bos());
  t.set_date("2025-12-06");
  const std::string head = "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n";
  const std::string off = "Reasoning Mode: /no_think\n\n## Custom Instructions\n\nYou are a helpful AI assistant named "
                          "SmolLM, trained by Hugging Face.\n\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n";
  CHECK(t.render({{"user", "Hi"}}, true) == head + "Today Date: 06 December 2025\n" + off);
  CHECK_THAT(t.render({{"system", "/think"}, {"user", "Hi"}}, true),
             Catch::EndsWith("Thought section </think> Solution section. In the Thought section, detail your "
                             "reasoning process in steps. Each step should include detailed considerations such as "
                             "analysing questions, summarizing relevant findings, brainstorming new ideas, verifying "
                             "the accuracy of the current steps, refining any errors, and revisiting previous steps. In "
                             "the Solution section, based on various attempts, explorations, and reflections from the "
                             "Thought section, systematically present the final solution that you deem correct. The "
                             "Solution section should be logical, accurate, and concise and detail necessary steps "
                             "needed to reach the conclusion.\n\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                             "<|im_start|>assistant\n"));
  // A copy without the date (llama.cpp's models/templates has one): no "Today Date" line.
  std::string undated = src;
  const size_t a = undated.find("  {%- set today"), b = undated.find("  {{- \"Reasoning Mode");
  REQUIRE(a != std::string::npos);
  REQUIRE(b > a);
  undated.erase(a, b - a);
  ChatTemplate u = ChatTemplate::detect(undated, "", "");
  REQUIRE(u.family() == ChatFamily::SmolLM3);
  CHECK(u.render({{"user", "Hi"}}, true) == head + off);
  CHECK(chat_family_from_name("SmolLM3") == ChatFamily::SmolLM3);
}

TEST_CASE("OLMo 2 (Tulu 3 turns): BOS written by the template, told apart from Zephyr's, continued after a reply") {
  ChatTemplate t = ChatTemplate::detect(test::read_all(dir() + "olmo2.jinja"), "<|endoftext|>", "<|endoftext|>");
  REQUIRE(t.family() == ChatFamily::Olmo2);
  CHECK(t.starts_with_bos());
  CHECK(ChatTemplate::detect(test::read_all(dir() + "zephyr.jinja"), "<s>", "</s>").family() == ChatFamily::Zephyr);
  // A chat that keeps its cache: the reply's newline comes with the next turn.
  const std::vector<ChatMessage> history = {{"user", "Hi"}, {"assistant", "Hello"}};
  CHECK(t.render(history, false) == "<|endoftext|><|user|>\nHi\n<|assistant|>\nHello<|endoftext|>");
  CHECK(t.render_continuation(history, {{"user", "Bye"}}) == std::optional<std::string>("\n<|user|>\nBye\n<|assistant|>\n"));
  CHECK(chat_family_from_name("tulu") == ChatFamily::Olmo2);
}

TEST_CASE("gpt-oss: today's date in the system message, instructions in a developer message, no BOS") {
  ChatTemplate t = ChatTemplate::detect(test::read_all(dir() + "gpt-oss.jinja"), "<|startoftext|>", "<|return|>");
  REQUIRE(t.family() == ChatFamily::GptOss);
  CHECK_FALSE(t.starts_with_bos());
  // The clock's date, as strftime_now("%Y-%m-%d") writes it.
  const std::string& d = t.date();
  REQUIRE(d.size() == 10);
  CHECK((d[4] == '-' && d[7] == '-' && std::isdigit(uint8_t(d[0])) && std::isdigit(uint8_t(d[9]))));
  const std::string prompt = t.render({{"user", "Hi"}}, true);
  CHECK_THAT(prompt, Catch::Contains("Current date: " + d + "\n"));
  CHECK_THAT(prompt, Catch::EndsWith("<|start|>user<|message|>Hi<|end|><|start|>assistant"));
  // An empty system prompt writes no developer message, as the template's `if developer_message`.
  CHECK(t.render({{"system", ""}, {"user", "Hi"}}, true) == prompt);
  CHECK_THAT(t.render({{"developer", "Be brief."}, {"user", "Hi"}}, true),
             Catch::Contains("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"));
}
