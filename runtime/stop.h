// Stop strings for streamed text. Text that could still turn into a stop string is held back and
// only released once it cannot, so a partial match is never printed; when a stop string completes,
// the text before it is released and everything from the stop string on is dropped.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace baton {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops = {});

  // Adds generated text; returns the part that is now safe to show. After a stop string completes,
  // stopped() is true and later calls return "".
  std::string push(std::string_view text);
  // Generation ended for another reason: whatever was held back is plain text after all.
  std::string flush();

  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }  // the stop string that ended it
  size_t held() const { return pending_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string pending_;  // text not yet released
  std::string matched_;
  bool stopped_ = false;
};

}  // namespace baton
