#include "runtime/stop.h"

#include <algorithm>

namespace baton {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return "";
  pending_.append(text);

  // The earliest complete stop string wins (text before it is the answer).
  size_t first = std::string::npos;
  for (const auto& s : stops_) {
    size_t at = pending_.find(s);
    if (at != std::string::npos && (first == std::string::npos || at < first)) {
      first = at;
      matched_ = s;
    }
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }

  // Hold back the longest tail of pending_ that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    size_t most = std::min(s.size() - 1, pending_.size());
    for (size_t n = most; n > hold; n--) {
      if (std::string_view(pending_).substr(pending_.size() - n) == std::string_view(s).substr(0, n)) {
        hold = n;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return "";
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace baton
