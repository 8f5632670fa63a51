// One pipeline stage on a CUDA GPU: the planned block of layers (and the embedding / head when the
// plan gives it them) with its weights uploaded once in the device layout (kernels/cuda/layout.h),
// its KV cache and scratch allocated once, and one stream. forward() runs the same llama-family
// loop as the CPU stage (models/llama_forward.h) with the CUDA ops (kernels/cuda/ops.h); the hidden
// state and the logits cross to the host at the stage's ends (the host-staged link).
// In a build without CUDA the ops are the host emulation (kernels/cuda_host/ops_host.cpp), which
// shows a device only with BATON_CUDA_EMULATE=1 (tests); otherwise the constructor throws a usage error.
#pragma once
#include <memory>

#include "runtime/stage.h"

namespace baton {

class GpuLink;
class DeviceChannel;
namespace cuda { class Context; }

class GpuStage : public ModelStage {
 public:
  // device: the CUDA ordinal. Weights are read from `f` (which must outlive the constructor only);
  // progress(bytes uploaded) is called while they upload.
  GpuStage(const gguf::File& f, const ModelConfig& cfg, const Stage& plan, const StageOptions& opt, int device,
           const std::function<void(uint64_t)>& progress = nullptr);
  ~GpuStage() override;

  void forward(const Batch& batch, float* x, float* logits) override;
  // With links: the input comes from slot h.in_slot of `in` when set, the output goes into a slot
  // of `out` (h.out_slot) instead of x.
  void forward(const Batch& batch, float* x, float* logits, Handoff& h) override;
  // The device links into and out of this stage (nullptr: host memory); set before any forward.
  void connect(GpuLink* in, GpuLink* out);
  // Device channels to stages in other processes (nullptr: host memory). With `in` the input is
  // received into the stage's device buffer and the host x is not read; with `out` the output is
  // sent from it, x is not written, and forward() returns without waiting for the device.
  void connect_channels(DeviceChannel* in, DeviceChannel* out);
  cuda::Context& context();
  // Steps of at most gemv_max_cols tokens are captured in a CUDA graph once per shape and
  // replayed (StageOptions::cuda_graphs; --no-cuda-graphs turns it off). A sequence's run of at
  // least Context::prefill_min_tokens tokens takes the tiled prefill attention.
  struct Stats {
    uint64_t captured = 0, launched = 0;  // graphs
    uint64_t prefill_runs = 0;            // attention_prefill calls (one per run and layer)
  };
  Stats stats() const;
  const Stage& plan() const override { return plan_; }
  int n_threads() const override { return 1; }
  int max_rewind() const override { return max_rewind_; }
  int copy_limit() const override { return copy_limit_; }
  uint64_t measured_bytes() const override;
  // The GEMV forms measured at load (BATON_GEMV_TUNE; docs/GPU.md), one line per op and width.
  std::vector<std::string> notes() const override;

  struct Impl;  // the device state (gpu_stage.cpp)

 private:
  Stage plan_;
  int max_rewind_ = 0;
  int copy_limit_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton
