// `baton plan`: where each layer goes and how many bytes every device needs, without loading a
// single weight. Works for devices that are not present (`--devices cuda=24GiB,cuda=24GiB`).
// Exit 3 with the shortfall when the model does not fit.
#include <memory>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/distributed.h"
#include "cli/options.h"
#include "gguf/gguf.h"
#include "runtime/config.h"
#include "runtime/devices.h"
#include "runtime/lora.h"
#include "runtime/model_files.h"
#include "runtime/planner.h"
#include "runtime/shape.h"

namespace baton::cli {
namespace {

struct PlanArgs {
  std::string model, shape, type = "Q4_K", devices = "auto", kv_type = "f16";
  uint32_t ctx = 0, parallel = 1, batch = 512, outputs = 0, threads = 0;
  PlacementFlags placement;
  bool json = false, distributed = false;
  std::vector<std::string> lora, lora_scaled;  // adapters loading would add (their bytes with the layers)
};

ModelShape load_shape(const PlanArgs& a) {
  if (!a.model.empty() && !a.shape.empty()) fail(ErrorKind::Usage, "give either -m MODEL or --shape NAME, not both");
  const std::vector<LoraFile> adapters = lora_files(a.lora, a.lora_scaled);
  if (!a.model.empty()) {
    const auto f = gguf::File::open(resolve_model(a.model));
    ModelShape shape = shape_from_gguf(*f);
    if (!adapters.empty()) LoraAdapters(adapters, *f, ModelConfig::from_gguf(*f)).add_to(shape);
    return shape;
  }
  if (!adapters.empty()) fail(ErrorKind::Usage, "--lora needs -m MODEL (an adapter is checked against its model)");
  if (a.shape.empty()) fail(ErrorKind::Usage, "nothing to plan: give -m MODEL or --shape NAME");
  const TypeTraits* t = type_by_name(a.type);
  if (!t || !t->compute) fail(ErrorKind::Usage, "--type '{}' is not a weight type Baton computes with", a.type);
  return shape_from_preset(find_preset(a.shape), t->type);
}

int run_plan(const PlanArgs& a) {
  const ModelShape shape = load_shape(a);
  PlanOptions o;
  o.n_ctx = a.ctx ? a.ctx : std::min<uint32_t>(4096, shape.n_ctx_train ? shape.n_ctx_train : 4096);
  o.n_parallel = a.parallel;
  o.n_batch = a.batch;
  o.n_outputs = a.outputs ? a.outputs : a.parallel;  // as run, chat and batch: a row per sequence
  o.n_threads = a.threads ? a.threads : std::max(1u, std::thread::hardware_concurrency());  // as run's default
  if (a.kv_type == "f16" || a.kv_type == "F16") o.kv_type = GgmlType::F16;
  else if (a.kv_type == "q8_0" || a.kv_type == "Q8_0") o.kv_type = GgmlType::Q8_0;
  else fail(ErrorKind::Usage, "--kv-type '{}' is not supported (use f16 or q8_0)", a.kv_type);
  apply_placement(a.placement, o);
  o.auto_devices = a.devices == "auto";

  Plan p;
  if (a.distributed) {  // every rank's devices (one each), gathered on rank 0; the workers print nothing
    p = plan_distributed(shape, a.model.empty() ? "" : resolve_model(a.model), a.devices, o);
    distributed_shutdown(false);
  } else {
    // What loading would do: plan_pipeline, as Pipeline::load plans.
    p = plan_pipeline(shape, parse_devices(a.devices, probe_devices(), /*allow_hypothetical=*/true), o);
  }
  write_stdout(a.json ? plan_to_json(p, shape).dump(2) + "\n" : format_plan(p, shape));
  if (!p.fits) fail(ErrorKind::OutOfMemory, "the model does not fit: {}", shortfall_message(p));
  return 0;
}

Register reg{{"plan", "Show where each layer would go and the bytes per device (no weights are loaded)",
              [](CLI::App& app) {
                auto a = std::make_shared<PlanArgs>();
                app.add_option("-m,--model", a->model, "Model file or known name");
                app.add_option("--shape", a->shape, "Plan a preset shape instead of a file (llama3-8b, llama3-70b, ...)");
                app.add_option("--type", a->type, "Weight type for --shape (default Q4_K)");
                app.add_option("--devices", a->devices,
                               "auto, or a list such as cuda:0,cpu / cuda:0=20GiB,cpu=8GiB / cuda=24GiB,cuda=24GiB")
                    ->check(not_empty("the device list"));
                app.add_option("-c,--ctx,--ctx-size", a->ctx, "Context per sequence (default min(4096, trained context))")
                    ->check(at_least(0));
                app.add_option("--parallel", a->parallel, "Sequences held at once (default 1)")->check(at_least(1));
                app.add_option("--batch", a->batch, "Tokens per forward step (default 512)")->check(at_least(1));
                app.add_option("--outputs", a->outputs,
                               "Logit rows per step (default: one per sequence, as run, chat and batch ask without "
                               "drafts; --lookup/--draft-max N ask 1 + N per sequence, logits every token of a batch)")
                    ->check(at_least(0));
                app.add_option("--kv-type", a->kv_type, "KV cache type: f16 or q8_0 (default f16)");
                app.add_option("-t,--threads", a->threads,
                               "CPU threads a CPU stage runs with (its attention buffers are per thread; default: all cores)")
                    ->check(at_least(0));
                add_placement_flags(app, a->placement);
                add_lora_flags(app, a->lora, a->lora_scaled);
                app.add_flag("--json", a->json, "Print the plan as JSON");
                add_distributed_flag(app, a->distributed, [a] { return WorkerArgs{a->model, a->devices, 0, 0}; });
                return [a] { return run_plan(*a); };
              }}};

}  // namespace
}  // namespace baton::cli
