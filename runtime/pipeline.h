// A loaded model placed on its devices: one or more stages, each a contiguous block of layers with
// its own weights, KV cache, scratch and threads, joined by links. This is the interface the engine
// (sequences, sampling, scheduling) drives; the engine never sees stages or devices.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "quant/types.h"
#include "runtime/batch.h"
#include "runtime/control_vector.h"
#include "runtime/lora.h"

namespace baton {
namespace gguf { class File; }
struct ModelConfig;
class Tokenizer;

struct LoadOptions {
  int n_ctx = 0;            // context per sequence; 0: the model's context length capped at 4096
  int n_seq = 1;            // parallel sequences (KV cache slots)
  int n_batch = 512;        // most tokens evaluated in one forward
  // Most output rows (logits or hidden states) of one forward, what the last stage's output buffers
  // are sized for: a batch asking more is evaluated in several forwards. 0: n_batch (every token).
  // Generation needs a row per sequence and drafted token; prompts only their last token's.
  int n_outputs = 0;
  GgmlType kv_type = GgmlType::F16;  // F16 or Q8_0
  int n_threads = 0;        // CPU threads in total; 0: all cores
  std::string devices = "cpu";       // device list as for --devices
  int threads_per_stage = 0;         // CPU stages: worker threads each (0: n_threads / n_cpu_stages)
  // Layer proportions per device entry (--tensor-split). Empty: several CPU entries (or ranks) get
  // equal work each (balanced_split), otherwise the planner fills devices in order.
  std::vector<double> tensor_split;
  // The other placement overrides, as `baton plan` takes them (PlanOptions in runtime/planner.h):
  // a user margin per device entry (one value: every entry), at most n_gpu_layers layers on GPU
  // entries (-1: no cap), no spill to the CPU, every GPU entry used even when one would do.
  std::vector<uint64_t> reserve;
  int n_gpu_layers = -1;
  bool no_cpu_spill = false;
  bool spread = false;
  bool cpu_moe = false;  // a mixture's experts in host memory, run on the CPU (PlanOptions::cpu_moe)
  // LoRA adapters applied on top of the model's weights (runtime/lora.h; CPU and GPU stages, not --distributed).
  std::vector<LoraFile> lora;
  // Control vectors added to the layers' outputs (runtime/control_vector.h; not --distributed), on
  // the layers in [control_first, control_last] (-1: no bound).
  std::vector<ControlVectorFile> control_vectors;
  int control_first = -1, control_last = -1;
  // How consecutive GPU stages hand over the hidden state: "auto" (peer-to-peer where the GPUs
  // allow it, else through pinned host memory), "on" (peer-to-peer or an error), "off" (always
  // through host memory). BATON_P2P=0 in the environment makes "auto" mean "off".
  std::string p2p = "auto";
  // GPU stages capture steps of up to 8 tokens (decode) in CUDA graphs once per shape and replay
  // them (--no-cuda-graphs: launch every op every step).
  bool cuda_graphs = true;
  bool verbose = false;
  // Progress while loading: bytes done of bytes total (called from the loading thread).
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Called by a stage's driver thread before the stage works on a piece of a batch (tests use it
  // to watch stages overlap and to inject a failure: what it throws reaches wait()).
  std::function<void(int stage, const Batch& piece)> on_stage;
};

// One stage as loaded: where it runs, its layers, and the bytes the planner set aside for it
// (reserve excluded) next to the bytes it actually holds (weights bound + KV + scratch + buffers).
struct StageInfo {
  std::string device;
  int layer_begin = 0, layer_end = 0;
  int n_threads = 0;
  uint64_t planned_bytes = 0;
  uint64_t measured_bytes = 0;
  double busy_s = 0;  // time spent working on batches since load (a balanced pipeline keeps every stage busy)
  std::string link;   // how its output reaches the next stage: "host memory", "cuda:0 -> cuda:1, peer-to-peer", … ("" for the last)
  std::vector<std::string> notes;  // what the stage measured at load and chose by it (GPU stages: the GEMV forms)
};

class Pipeline {
 public:
  static std::unique_ptr<Pipeline> load(const std::string& path, const LoadOptions& opt);
  virtual ~Pipeline() = default;

  virtual const gguf::File& file() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual int n_ctx() const = 0;
  virtual int n_seq() const = 0;
  virtual int n_vocab() const = 0;

  // Evaluate a batch. For each token with logits=1, one row of n_vocab floats is written to
  // `logits`, in batch order. Positions must continue each sequence's cache (pos == cached length)
  // and stay below n_ctx; a violation is an Error. Large batches are split internally.
  virtual void decode(const Batch& batch, float* logits) = 0;

  // Asynchronous evaluation, so several batches can be in the stages at once (stage 0 on one
  // batch while stage 1 finishes another). submit() checks the batch (an Error there leaves no
  // state changed), copies it, starts evaluating it and returns a ticket; wait(ticket) blocks
  // until its logits rows are in `logits` (same layout as decode) and rethrows any error raised
  // while evaluating it. `logits` must stay valid until wait returns. Every stage evaluates
  // batches in submission order, so a batch may continue a sequence that a batch still in flight
  // extends (the next prompt chunk); positions are checked against what has been submitted.
  // Tickets may be waited in any order; each exactly once. truncate_seq must not be called on a
  // sequence with work in flight that extends it; batches submitted before a truncation that only
  // read the sequence (Batch::copies from it) still see it as it was. A pipeline is driven from one
  // thread at a time.
  // The default is synchronous (submit evaluates with decode, wait returns at once), so a
  // pipeline only has to implement decode(); pipelines that overlap work override all three.
  virtual uint64_t submit(const Batch& batch, float* logits) {
    decode(batch, logits);
    return ++sync_tickets_;
  }
  virtual void wait(uint64_t ticket) { (void)ticket; }
  // How many batches it pays to keep in flight: the number of stages that can work at once
  // (1 for a single stage or a synchronous pipeline).
  virtual int max_in_flight() const { return 1; }
  // Forget what sequence `seq` has cached from position `from` on (0: all of it).
  virtual void truncate_seq(int seq, int from = 0) = 0;
  // How many positions truncate_seq can take off a sequence's end (other than truncating to 0):
  // sliding-window layers keep a ring of their window only, so a model with them can drop just
  // the last position; unlimited (INT_MAX) otherwise.
  virtual int max_rewind() const { return std::numeric_limits<int>::max(); }
  virtual int seq_len(int seq) const = 0;
  // Batch::copies: the longest sequence a copy may take its first positions from (sliding-window
  // rings keep only their last cells, so a sequence that has outgrown its ring cannot be copied
  // from); INT_MAX without rings; 0: this pipeline makes no copies (a batch with any is refused).
  virtual int copy_limit() const { return 0; }
  // The stages in pipeline order (empty for pipelines that have no stages to show).
  virtual std::vector<StageInfo> stages() const { return {}; }

  // Process links (the distributed pipeline; nothing elsewhere): for each micro-batch, the time
  // from rank 0 handing it on to its logits being in rank 0's hands, less what the other ranks
  // spent computing it. With one stream that is what the process boundaries cost per token.
  struct LinkStats {
    uint64_t micro_batches = 0;
    double seconds = 0;
  };
  virtual LinkStats link_stats() const { return {}; }

 private:
  uint64_t sync_tickets_ = 0;
};

}  // namespace baton
