// OpenAI's harmony reply format (gpt-oss, the o200k_harmony vocabulary). A reply is a sequence of
// messages, each a header and a body:
//
//   <|channel|>analysis<|message|>…reasoning…<|end|><|start|>assistant<|channel|>final<|message|>…answer…<|return|>
//
// (the generation prompt `<|start|>assistant` opened the first header already). HarmonyParser is a
// streaming state machine fed the reply's text piece by piece, the markers written out as their
// token texts; it hands back the bodies, each tagged as reasoning (the analysis channel, or any
// other channel but final) or answer (the final channel), and never a marker or a header.
// Markers may arrive cut across pieces: a tail that could still become one is held back.
// Text before any marker is answer, so a reply that is not harmony at all passes through unchanged.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace baton {

enum class ReplyPart { Reasoning, Answer };

struct ReplyChunk {
  ReplyPart part;
  std::string text;
  bool operator==(const ReplyChunk& o) const { return part == o.part && text == o.text; }
};

// The format's marker tokens, as their texts.
inline constexpr std::string_view kHarmonyMarkers[] = {"<|start|>",  "<|channel|>", "<|constrain|>", "<|message|>",
                                                       "<|end|>",    "<|return|>",  "<|call|>"};

class HarmonyParser {
 public:
  // The bodies' text that is certain now, in order (consecutive text of one part in one chunk).
  std::vector<ReplyChunk> push(std::string_view text);
  // The reply ended: text held back as a possible marker is body text after all; an unfinished
  // header is dropped.
  std::vector<ReplyChunk> flush();
  // <|return|> or <|call|> was seen: the reply is over and later text is ignored.
  bool ended() const { return state_ == State::Ended; }

 private:
  enum class State { Body, Header, Ended };
  void text(std::string_view s, std::vector<ReplyChunk>& out);
  void marker(std::string_view m);

  State state_ = State::Body;
  ReplyPart part_ = ReplyPart::Answer;  // what the current body is
  std::string header_;                  // the current header's text, markers included
  std::string pending_;                 // a tail that may be the start of a marker
};

// A whole reply at once: {reasoning, answer}.
struct SplitReply {
  std::string reasoning, answer;
};
SplitReply split_harmony(std::string_view reply);

}  // namespace baton
