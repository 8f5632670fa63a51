#include "cli/command.h"

namespace baton::cli {
std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}
}  // namespace baton::cli
