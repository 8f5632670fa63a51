// Running the built `baton` binary from a test (BATON_BINARY, set by tests/CMakeLists.txt, which
// also builds the binary before a test that includes this header).
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/helpers.h"

namespace baton::test {

struct Out {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs a shell command line with stdin_text as its input; its exit code (128 + signal when
// killed), stdout and stderr. stdout_to, when given, is the shell redirection stdout gets instead
// of a file read back (">/dev/full", ">&-"); `out` is then empty.
inline Out run_command(const std::string& command, const std::string& stdin_text = "", const std::string& stdout_to = "") {
  static const std::string dir = temp_dir();
  Out o;
  const std::string in = dir + "/stdin", out = dir + "/stdout", err = dir + "/stderr";
  std::ofstream(in) << stdin_text;
  const std::string redirect = stdout_to.empty() ? ">" + out : stdout_to;
  const int st = std::system((command + " <" + in + " " + redirect + " 2>" + err).c_str());
  o.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  if (stdout_to.empty()) o.out = slurp(out);
  o.err = slurp(err);
  return o;
}

// `baton ARGS` through the shell (so tests can pipe into it), as run_command.
inline Out run_baton(const std::string& args, const std::string& stdin_text = "", const std::string& stdout_to = "") {
  return run_command(std::string(BATON_BINARY) + " " + args, stdin_text, stdout_to);
}

// In a forked child: becomes `baton ARGS` (exit 127 if it cannot).
[[noreturn]] inline void exec_baton(const std::vector<std::string>& args) {
  std::vector<char*> argv{const_cast<char*>(BATON_BINARY)};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execv(BATON_BINARY, argv.data());
  _exit(127);
}

// The JSON objects of JSONL text, one per non-empty line.
inline std::vector<nlohmann::json> jsonl(const std::string& text) {
  std::vector<nlohmann::json> v;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) v.push_back(nlohmann::json::parse(l));
  return v;
}

}  // namespace baton::test
