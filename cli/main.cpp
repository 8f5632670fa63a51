// baton: run quantized LLMs from GGUF files across devices. Exit codes: 0 ok, 1 usage error,
// 2 model/file error (an input that cannot be read, an output that cannot be written), 3 out of
// memory / does not fit, 130 interrupted.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include "cli/command.h"
#include "cli/distributed.h"
#include "cli/options.h"
#include "gguf/error.h"

namespace {

// A standard stream closed by the caller (`baton run ... >&-`) would be taken by the first file
// Baton opens, and stdout's text would land in it. /dev/null takes its place instead; stdout is
// opened read-only, so writes to it still fail (EBADF) as to a closed stdout, and are reported.
void occupy_closed_std_fds() {
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    const int got = ::open("/dev/null", fd == STDERR_FILENO ? O_WRONLY : O_RDONLY);
    if (got >= 0 && got != fd) {
      ::dup2(got, fd);
      ::close(got);
    }
  }
}

// CLI11's parse errors as Baton's errors: one line, `error: ...`, pointing at the help of the
// command that was being parsed (docs/CLI.md).
int parse_error(CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version: printed, success
  std::string where = "baton";
  for (const CLI::App* sub : app.get_subcommands()) where += " " + sub->get_name();
  if (app.get_subcommands().empty()) {
    // CLI11 says "A subcommand is required" about `baton frobnicate`: name the word it did not know.
    for (int i = 1; i < argc; ++i)
      if (argv[i][0] != '-') {
        std::fprintf(stderr, "error: unknown command '%s' (see baton --help)\n", argv[i]);
        return 1;
      }
  }
  std::fprintf(stderr, "error: %s (see %s --help)\n", e.what(), where.c_str());
  return 1;
}

// CLI11 reads '' as 0 for a number (`-n ''`, `--temp "$T"` with T unset): every numeric option of
// every command refuses it instead, as the options with a range check (at_least, in_range) do.
void refuse_empty_numbers(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_min() == 0) continue;  // a flag
    const std::string type = opt->get_type_name().substr(0, opt->get_type_name().find(':'));
    const bool whole = type == "INT" || type == "UINT";
    if (!whole && type != "FLOAT" && type != "NUMBER") continue;
    opt->check(CLI::Validator(
        [whole](std::string& s) { return s.empty() ? whole ? "'' is not a whole number" : "'' is not a number" : ""; },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands({})) refuse_empty_numbers(*sub);
}

// A command's output that could not be written fails the command, whatever it returned.
int finish(int code) {
  if (baton::cli::flush_stdout()) return code;
  std::fprintf(stderr, "error: %s\n", baton::cli::stdout_failure().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace baton;
  occupy_closed_std_fds();
  CLI::App app{"baton: run quantized LLMs (GGUF) on CPUs and GPUs, split into pipeline stages", "baton"};
  app.set_version_flag("--version", "baton 0.1.0");
  app.require_subcommand(1);
  // A repeated option takes its last value, as in llama.cpp (a script appends its overrides); the
  // options that take several (--stop, embed's -p, bench-kernels' -t 1 2) keep them all.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto& cmds = cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::function<int()> run;
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    auto fn = c.setup(*sub);
    sub->callback([&run, fn] { run = fn; });
    refuse_empty_numbers(*sub);
  }
  if (argc == 1) {  // bare `baton`: the overview of the commands rather than a one-line complaint
    std::fputs(app.help().c_str(), stdout);
    return finish(1);
  }
  // llama.cpp's -ngl N: CLI11 takes one-dash names of one letter only (it would read "-n gl").
  std::vector<char*> args(argv, argv + argc);
  static char ngl_long[] = "--n-gpu-layers";
  for (auto& a : args)
    if (std::strcmp(a, "-ngl") == 0) a = ngl_long;
  try {
    app.parse(argc, args.data());
  } catch (const CLI::ParseError& e) {
    return finish(parse_error(app, e, argc, args.data()));
  }
  try {
    if (auto code = cli::distributed_main()) return finish(*code);  // a worker rank of --distributed
    return finish(run ? run() : 0);
  } catch (const Error& e) {
    cli::flush_stdout();  // what was printed before the error comes first
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::bad_alloc&) {
    cli::flush_stdout();
    std::fprintf(stderr, "error: out of memory\n");
    return 3;
  } catch (const std::system_error& e) {
    // fmt::print throws this when its write to stdout fails; say so the way every command does.
    if (!cli::flush_stdout())
      std::fprintf(stderr, "error: writing to standard output failed: %s\n", e.code().message().c_str());
    else
      std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    cli::flush_stdout();
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
