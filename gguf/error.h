// Two error tiers. Bad input (files, flags, prompts, budgets) throws baton::Error with a message
// that names the problem; the CLI maps its kind to an exit code. Broken internal invariants abort.
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace baton {

enum class ErrorKind {
  Usage = 1,         // bad flags or arguments
  Model = 2,         // model file / input file problems
  OutOfMemory = 3,   // the plan does not fit, or an allocation failed
  Interrupted = 130, // Ctrl-C
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return int(kind_); }

 private:
  ErrorKind kind_;
};

template <class... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(kind, fmt::format(f, std::forward<Args>(args)...));
}

// Internal invariant: print and abort (never for input checking).
[[noreturn]] void panic(const char* file, int line, const std::string& msg);
#define BATON_CHECK(cond)                                                      \
  do {                                                                         \
    if (!(cond)) ::baton::panic(__FILE__, __LINE__, "check failed: " #cond);   \
  } while (0)

}  // namespace baton
