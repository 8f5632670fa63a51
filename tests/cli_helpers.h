// Running the built `baton` binary from a test (BATON_BINARY, set by tests/CMakeLists.txt, which
// also builds the binary before a test that includes this header).
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

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

// Runs `baton ARGS` through the shell (so tests can pipe into it) with stdin_text as its input;
// its exit code (128 + signal when killed), stdout and stderr.
inline Out run_baton(const std::string& args, const std::string& stdin_text = "") {
  static const std::string dir = temp_dir();
  Out o;
  const std::string in = dir + "/stdin", out = dir + "/stdout", err = dir + "/stderr";
  std::ofstream(in) << stdin_text;
  const std::string cmd = std::string(BATON_BINARY) + " " + args + " <" + in + " >" + out + " 2>" + err;
  const int st = std::system(cmd.c_str());
  o.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  o.out = slurp(out);
  o.err = slurp(err);
  return o;
}

}  // namespace baton::test
