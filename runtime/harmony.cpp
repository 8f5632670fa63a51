#include "runtime/harmony.h"

#include <algorithm>

namespace baton {
namespace {

// The channel a header names: the word after <|channel|> ("analysis", "final", "commentary"), ""
// when the header has none.
std::string_view channel_of(std::string_view header) {
  constexpr std::string_view kChannel = "<|channel|>";
  const size_t at = header.find(kChannel);
  if (at == std::string_view::npos) return {};
  std::string_view rest = header.substr(at + kChannel.size());
  const size_t end = rest.find_first_of(" \t\n<");
  return rest.substr(0, end);
}

// How many bytes at the end of `s` are a proper prefix of some marker (they wait for more text).
size_t marker_prefix_tail(std::string_view s) {
  size_t best = 0;
  for (std::string_view m : kHarmonyMarkers)
    for (size_t n = std::min(m.size() - 1, s.size()); n > best; --n)
      if (s.substr(s.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
  return best;
}

}  // namespace

void HarmonyParser::text(std::string_view s, std::vector<ReplyChunk>& out) {
  if (s.empty()) return;
  switch (state_) {
    case State::Body:
      if (!out.empty() && out.back().part == part_) out.back().text += s;
      else out.push_back({part_, std::string(s)});
      break;
    case State::Header:
      header_ += s;  // a role ("assistant"), a channel name, "to=…", a constraint: never shown
      break;
    case State::Ended:
      break;
  }
}

void HarmonyParser::marker(std::string_view m) {
  if (state_ == State::Ended) return;
  if (m == "<|return|>" || m == "<|call|>") {
    state_ = State::Ended;
  } else if (m == "<|start|>" || m == "<|end|>") {
    // A new message opens (or the last one closed and the next one's <|start|> follows).
    state_ = State::Header;
    header_.clear();
  } else if (m == "<|channel|>" || m == "<|constrain|>") {
    if (state_ == State::Body) header_.clear();  // a header without <|start|>: lenient
    state_ = State::Header;
    header_ += m;
  } else if (m == "<|message|>" && state_ == State::Header) {
    // The body that follows: the final channel (or none named) is the answer, the rest reasoning.
    const std::string_view ch = channel_of(header_);
    part_ = ch.empty() || ch == "final" ? ReplyPart::Answer : ReplyPart::Reasoning;
    state_ = State::Body;
    header_.clear();
  }
  // A <|message|> inside a body is out of place: dropped like every marker.
}

std::vector<ReplyChunk> HarmonyParser::push(std::string_view s) {
  std::vector<ReplyChunk> out;
  pending_.append(s);
  std::string_view rest = pending_;
  for (;;) {
    // The earliest complete marker.
    size_t at = std::string_view::npos;
    std::string_view found;
    for (std::string_view m : kHarmonyMarkers) {
      const size_t p = rest.find(m);
      if (p < at) {
        at = p;
        found = m;
      }
    }
    if (at == std::string_view::npos) break;
    text(rest.substr(0, at), out);
    marker(found);
    rest.remove_prefix(at + found.size());
  }
  const size_t hold = marker_prefix_tail(rest);
  text(rest.substr(0, rest.size() - hold), out);
  pending_ = std::string(rest.substr(rest.size() - hold));
  return out;
}

std::vector<ReplyChunk> HarmonyParser::flush() {
  std::vector<ReplyChunk> out;
  text(pending_, out);
  pending_.clear();
  header_.clear();
  return out;
}

SplitReply split_harmony(std::string_view reply) {
  HarmonyParser p;
  std::vector<ReplyChunk> chunks = p.push(reply);
  for (ReplyChunk& c : p.flush()) chunks.push_back(std::move(c));
  SplitReply r;
  for (const ReplyChunk& c : chunks) (c.part == ReplyPart::Answer ? r.answer : r.reasoning) += c.text;
  return r;
}

}  // namespace baton
