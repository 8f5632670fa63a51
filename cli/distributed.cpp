#include "cli/distributed.h"

#include <vector>

namespace baton::cli {
namespace {
struct Entry {
  bool* flag;
  std::function<WorkerArgs()> worker;
};
// One entry per subcommand that has the flag; only the parsed subcommand's flag can be set.
std::vector<Entry>& entries() {
  static std::vector<Entry> e;
  return e;
}
}  // namespace

void add_distributed_flag(CLI::App& app, bool& flag, std::function<WorkerArgs()> worker) {
  app.add_flag("--distributed", flag,
               "spread the pipeline over the ranks of an MPI job (mpirun -np N baton ... --distributed); "
               "rank 0 is the front end");
  entries().push_back({&flag, std::move(worker)});
}

std::optional<int> distributed_main() {
  for (const auto& e : entries()) {
    if (!*e.flag) continue;
    if (distributed_init() == 0) return std::nullopt;
    return distributed_serve(e.worker());
  }
  return std::nullopt;
}

}  // namespace baton::cli
