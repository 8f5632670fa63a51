// The distributed pipeline: one Baton process per node (or per GPU) under an MPI launcher, the
// stages of one pipeline spread over them (docs/DISTRIBUTED.md).
//
//   mpirun -np 3 baton batch -m MODEL ... --distributed
//
// Every rank starts the same command. Rank 0 is the front end: it owns the tokenizer, sampling,
// scheduling and output, and drives the pipeline through the ordinary Pipeline interface. The
// other ranks only serve their stage (distributed_serve). Setup, in order, before any weights
// load: each worker sends rank 0 its host, its file facts (size and a hash of the header) and its
// local devices; rank 0 checks the files agree, plans over every rank's devices (stage k on rank
// k) and sends each worker its stage; every rank then loads only its own layers from its own copy
// of the file. Per micro-batch, hidden-state rows go rank k -> k+1 and the last rank sends the
// logits rows back to rank 0. A lost rank becomes an Error naming it (runtime/mpi_comm.h).
#pragma once
#include <memory>
#include <string>

#include "runtime/pipeline.h"
#include "runtime/planner.h"

namespace baton {

// Compiled with MPI (BATON_MPI)?
bool distributed_available();

// What a worker rank knows from its own command line.
struct WorkerArgs {
  std::string model;        // -m as given on this rank (resolved here: each rank has its own copy)
  std::string devices = "cpu";
  int n_threads = 0;
  int threads_per_stage = 0;
};

// Starts MPI in this process (once) and returns its rank. Error(Usage) when built without MPI, or
// when the job has a single rank (a pipeline across processes needs at least two).
int distributed_init();

// Worker ranks (rank > 0): serve this rank's stage until rank 0 ends the job. Returns the exit
// code. Errors on this rank are sent to rank 0, which reports them.
int distributed_serve(const WorkerArgs& args);

// Rank 0: gather the workers, check their files, plan, load, and return the pipeline the engine
// drives. Errors (mismatched files, a plan that does not fit, a worker that failed to load) are
// thrown before any weights load where possible, and the workers are told to stop.
std::unique_ptr<Pipeline> load_distributed(const std::string& path, const LoadOptions& opt);

// Rank 0, `baton plan --distributed`: the plan over every rank's devices (device labels name the
// rank: "rank1:cpu"). `path` may be empty (planning a preset shape; no file check then).
Plan plan_distributed(const ModelShape& shape, const std::string& path, const std::string& devices,
                      const PlanOptions& options);

// Rank 0: tell the workers the job is over (also done at exit). Harmless when nothing is running.
void distributed_shutdown(bool failed);

}  // namespace baton
