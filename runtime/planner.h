// The planner: which device holds which contiguous block of layers, and how many bytes each needs.
// A pure function of the model's shape, the device list and the options; no GPU, no file data.
// docs/PLACEMENT.md explains the policy with worked examples.
//
// Per stage: weights(layers [+ embedding] [+ head]) + KV(layers) + scratch + reserve <= budget.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "quant/types.h"
#include "runtime/devices.h"
#include "runtime/shape.h"

namespace baton {

struct PlanOptions {
  uint32_t n_ctx = 4096;      // context per sequence (tokens)
  uint32_t n_parallel = 1;    // sequences held at once; KV cells = n_ctx × n_parallel
  uint32_t n_batch = 512;     // tokens per forward step (clamped to n_ctx × n_parallel)
  uint32_t n_outputs = 0;     // logit rows per step (the pipeline cuts a batch asking more); 0: n_batch
                              // (every token of a step); the plan's options hold the value used
  GgmlType kv_type = GgmlType::F16;  // F16 or Q8_0
  uint32_t n_threads = 0;     // CPU threads of a CPU stage at most (its attention buffers); 0: kPlanThreadsPerStage
  // User margin per device entry, on top of the device's runtime reserve. Empty: none; one value:
  // the same for every entry; otherwise one value per entry.
  std::vector<uint64_t> reserve;
  // Proportions per device entry (`--tensor-split 3,1`); entries past the end get 0. Empty: fill.
  std::vector<double> tensor_split;
  int n_gpu_layers = -1;      // at most this many layers on GPU entries (the first ones); -1: no cap
  bool no_cpu_spill = false;  // with GPU entries listed: fail instead of putting layers on the CPU
  bool spread = false;        // use every GPU entry (in proportion to memory) even if one would do
  // The entries came from `--devices auto` (GPUs by free memory, then the CPU): plan_pipeline fills
  // them in order, so a model one GPU holds stays on one GPU (docs/PLACEMENT.md). An explicit list
  // of GPUs asks for a pipeline over all of them: equal work each.
  bool auto_devices = false;
  // A mixture of experts with its stacked experts in host memory, run by the CPU kernels, whatever
  // device holds the rest of each layer (llama.cpp's --cpu-moe): the experts of every layer are
  // charged once to the first CPU entry (its budget for stages is what is left), and no stage's
  // weights count them.
  bool cpu_moe = false;
};

struct Stage {
  size_t device = 0;           // index into Plan::devices
  std::string label;           // the device's label
  uint32_t layer_begin = 0;    // layers [layer_begin, layer_end); may be empty for a head-only stage
  uint32_t layer_end = 0;
  bool has_embedding = false;  // holds token_embd for the input lookup (the first stage)
  bool has_output = false;     // holds output_norm + the head and produces logits (the last stage)
  uint64_t layer_weight_bytes = 0;  // blk.N.* of its layers
  uint64_t embedding_bytes = 0;
  uint64_t output_bytes = 0;        // output_norm + head (0 for a tied head on the embedding's stage)
  uint64_t shared_bytes = 0;        // tensors every stage keeps a copy of
  uint64_t kv_bytes = 0;
  uint64_t scratch_bytes = 0;       // scratch_bytes(shape, n_batch, has_output, kv_type, n_outputs, n_threads),
                                    // on a GPU without the CPU attention's buffers (ScratchLayout::att)
                                    // and + gpu_ops_scratch_bytes(shape, n_batch, has_output),
                                    // + gpu_link_bytes(shape, n_batch) on a GPU past layer 0
  uint64_t reserve_bytes = 0;       // device runtime reserve + user margin
  uint64_t budget = 0;

  uint32_t n_layers() const { return layer_end - layer_begin; }
  uint64_t weight_bytes() const { return layer_weight_bytes + embedding_bytes + output_bytes + shared_bytes; }
  uint64_t total_bytes() const { return weight_bytes() + kv_bytes + scratch_bytes + reserve_bytes; }
  int64_t free_bytes() const { return int64_t(budget) - int64_t(total_bytes()); }  // < 0: over budget
};

struct Shortfall {
  size_t device = 0;   // index into Plan::devices
  std::string label;
  uint64_t bytes = 0;  // how much more the device would need
};

struct Plan {
  std::string model;       // shape name
  uint32_t n_layer = 0;
  PlanOptions options;     // as used (n_batch clamped)
  std::vector<DeviceSpec> devices;
  std::vector<Stage> stages;     // in pipeline order; devices that got nothing have no stage
  std::string policy;            // "fill", "spread", "tensor-split", with "+ n-gpu-layers N"
  bool fits = false;
  std::vector<Shortfall> shortfalls;  // empty when it fits
  std::vector<std::string> notes;     // how the plan came about (an entry passed over, idle GPUs, ...)
  // GPUs `--devices auto` left without a stage because the ones before hold the model (a note
  // says so; loading for several sequences prints it, as a pipeline over them would add throughput).
  std::vector<std::string> idle_gpus;
  // What may go wrong although it fits (a budget above the memory free now, a context beyond the
  // trained one): loading prints these on stderr even without --verbose.
  std::vector<std::string> warnings;
  // --cpu-moe: the experts' bytes in host memory and the CPU entry charged for them (its budget in
  // `devices` is already lowered by them); 0 bytes: none.
  uint64_t host_expert_bytes = 0;
  size_t host_expert_device = 0;

  uint64_t total_bytes() const;
  uint64_t kv_bytes() const;
};

// Throws Error(Usage) for contradictory options (no CPU entry for the layers n_gpu_layers leaves,
// a tensor split that names no device, ...). A plan that does not fit is a result, not an error.
Plan plan(const ModelShape& shape, const std::vector<DeviceSpec>& devices, const PlanOptions& options);

// Layer counts for n pipeline stages of equal speed (CPU stages: the work follows the weight
// bytes each stage reads): contiguous blocks, each at least one layer, the output head counted with
// the last block, the largest block as small as possible. As PlanOptions::tensor_split the counts
// are taken as they are. n > n_layer: n equal proportions (the planner then reports the problem).
std::vector<double> balanced_split(const ModelShape& shape, size_t n);

// The plan a pipeline loads with (and `baton plan` shows): options.tensor_split or --spread when
// given; else equal work per stage (balanced_split) over the entries that share the work, when each
// can hold its share, and otherwise the entries filled in order. The entries that share the work:
// all of them when they are of one kind (`cpu,cpu`: virtual stages; `cuda:0,cuda:1`);
// with GPUs and the CPU listed, the GPUs alone: the CPU is far slower per layer, so it takes only
// what the GPUs cannot hold (`cuda:0,cpu` fills the GPU; `cuda:0=2GiB,cpu`: the GPU takes what fits,
// the CPU the rest). every_entry_shares: all entries share the work whatever their kind (MPI ranks:
// each rank serves one stage). options.auto_devices (and not every_entry_shares): the entries are
// filled in order, with a note naming the GPUs left idle.
Plan plan_pipeline(const ModelShape& shape, const std::vector<DeviceSpec>& devices, const PlanOptions& options,
                   bool every_entry_shares = false);

// Human table (with the shortfall when it does not fit) and JSON (bytes exact, layer ranges
// half-open).
std::string format_plan(const Plan& p, const ModelShape& shape);
nlohmann::json plan_to_json(const Plan& p, const ModelShape& shape);
// "cuda short by 1.20 GiB (1288490189 bytes); cpu short by ..."; empty when it fits.
std::string shortfall_message(const Plan& p);

}  // namespace baton
