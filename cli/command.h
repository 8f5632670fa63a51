// Subcommand registry. Each cli/<name>.cpp defines one subcommand and registers it with a static
// Register object, so adding a subcommand touches no other file.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace baton::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `sub` and returns the function to run once parsing succeeded. Return value is the
  // process exit code.
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

std::vector<Command>& registry();

struct Register {
  explicit Register(Command c) { registry().push_back(std::move(c)); }
};

}  // namespace baton::cli
