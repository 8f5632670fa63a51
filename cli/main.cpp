// baton: run quantized LLMs from GGUF files across devices. Exit codes: 0 ok, 1 usage error,
// 2 model/file error, 3 out of memory / does not fit, 130 interrupted.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cli/command.h"
#include "cli/distributed.h"
#include "gguf/error.h"

int main(int argc, char** argv) {
  using namespace baton;
  CLI::App app{"baton: run quantized LLMs (GGUF) on CPUs and GPUs, split into pipeline stages", "baton"};
  app.set_version_flag("--version", "baton 0.1.0");
  app.require_subcommand(1);
  auto& cmds = cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::function<int()> run;
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    auto fn = c.setup(*sub);
    sub->callback([&run, fn] { run = fn; });
  }
  if (argc == 1) {  // bare `baton`: the overview of the commands rather than a one-line complaint
    std::fputs(app.help().c_str(), stdout);
    return 1;
  }
  // llama.cpp's -ngl N: CLI11 takes one-dash names of one letter only (it would read "-n gl").
  std::vector<char*> args(argv, argv + argc);
  static char ngl_long[] = "--n-gpu-layers";
  for (auto& a : args)
    if (std::strcmp(a, "-ngl") == 0) a = ngl_long;
  try {
    app.parse(argc, args.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;
  }
  try {
    if (auto code = cli::distributed_main()) return *code;  // a worker rank of --distributed
    return run ? run() : 0;
  } catch (const Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: out of memory\n");
    return 3;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
