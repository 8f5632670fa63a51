// --distributed (docs/DISTRIBUTED.md): under `mpirun -np N baton <cmd> ... --distributed` every rank
// parses the same command line. main() then starts MPI; rank 0 goes on with the subcommand (its
// pipeline comes from load_distributed), every other rank only serves its stage.
#pragma once
#include <functional>
#include <optional>

#include <CLI/CLI.hpp>

#include "runtime/distributed.h"

namespace baton::cli {

// Adds --distributed to a subcommand. `worker` reads what a worker rank needs from the
// subcommand's parsed flags (model, devices, threads).
void add_distributed_flag(CLI::App& app, bool& flag, std::function<WorkerArgs()> worker);

// After parsing: nullopt on a plain run or on rank 0 (run the subcommand); on a worker rank, its
// stage service runs here and the result is the process's exit code.
std::optional<int> distributed_main();

}  // namespace baton::cli
