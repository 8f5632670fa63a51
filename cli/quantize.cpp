// `baton quantize`: a model's weights rewritten in a quantized type (llama-quantize's recipes,
// without an importance matrix). Prints the plan — each tensor's type and the sizes — then writes.
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/model_files.h"
#include "runtime/quantize_model.h"

namespace baton::cli {
namespace {

struct QuantizeArgs {
  std::string in, out, type, output_type, embedding_type;
  int threads = 0;
  bool pure = false, allow_requantize = false, leave_output = false, dry_run = false, verbose = false;
};

GgmlType tensor_type(const std::string& flag, const std::string& name) {
  const TypeTraits* t = type_by_name(name);
  if (!t) fail(ErrorKind::Usage, "{} '{}' is not a tensor type (e.g. q8_0, q6_k, f16)", flag, name);
  return t->type;
}

double mib(uint64_t b) { return double(b) / (1024.0 * 1024.0); }

int run_quantize(const QuantizeArgs& a) {
  QuantizeOptions o;
  o.type = a.type;
  o.pure = a.pure;
  o.allow_requantize = a.allow_requantize;
  o.leave_output = a.leave_output;
  if (!a.output_type.empty()) o.output_type = tensor_type("--output-tensor-type", a.output_type);
  if (!a.embedding_type.empty()) o.embedding_type = tensor_type("--token-embedding-type", a.embedding_type);
  if (!find_quant_file_type(a.type)) fail(ErrorKind::Usage, "unknown type '{}' (baton quantize --help lists them)", a.type);
  if (!a.dry_run) {
    if (a.out.empty()) fail(ErrorKind::Usage, "give the output file: baton quantize IN OUT TYPE");
    if (a.out == a.in || same_file(a.in, a.out)) fail(ErrorKind::Usage, "{} is the input file: writing it would destroy the model", a.out);
  }
  const auto f = gguf::File::open(resolve_model(a.in));
  const std::vector<TensorPlan> plan = plan_quantization(*f, o);

  // The plan: per tensor with --verbose, else how many tensors get each type.
  uint64_t before = 0, after = 0;
  std::map<std::string, std::pair<int, uint64_t>> by_type;  // type -> (tensors, bytes)
  int fallbacks = 0, converted = 0;
  for (const TensorPlan& p : plan) {
    before += p.tensor->nbytes;
    after += p.bytes;
    auto& [n, bytes] = by_type[type_name(p.to)];
    ++n, bytes += p.bytes;
    fallbacks += p.fallback;
    converted += p.to != p.tensor->type;
    if (a.verbose)
      std::fprintf(stderr, "%-36s %-18s %6s -> %-6s %9.2f MiB%s\n", p.tensor->name.c_str(), p.tensor->shape_str().c_str(),
                   type_name(p.tensor->type), type_name(p.to), mib(p.bytes), p.fallback ? "  (fallback)" : "");
  }
  std::string mix;
  for (const auto& [name, nb] : by_type) mix += fmt::format("{}{} {} ({:.1f} MiB)", mix.empty() ? "" : ", ", nb.first, name, mib(nb.second));
  std::fprintf(stderr, "%s: %zu tensors, %d converted to %s: %s\n", a.in.c_str(), plan.size(), converted,
               find_quant_file_type(a.type)->name, mix.c_str());
  std::fprintf(stderr, "size %.1f MiB -> %.1f MiB%s\n", mib(before), mib(after),
               fallbacks ? fmt::format(" ({} tensors in a stand-in type: their rows do not fit the blocks of the one planned)", fallbacks).c_str() : "");
  if (a.dry_run) return 0;

  const int threads = a.threads > 0 ? a.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const bool bar = stderr_is_tty();
  const auto t0 = std::chrono::steady_clock::now();
  quantize_model(*f, plan, o, a.out, threads, [&](size_t done, size_t total) {
    if (bar) std::fprintf(stderr, "\rquantizing %zu/%zu tensors\033[K", done, total);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (bar) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "wrote %s in %.1f s\n", a.out.c_str(), s);
  return 0;
}

Register reg{{"quantize", "Write a model with its weights quantized (Q4_K_M, Q8_0, ...), as llama-quantize does", [](CLI::App& app) {
  auto a = std::make_shared<QuantizeArgs>();
  std::string types;
  for (const QuantFileType& t : quant_file_types()) types += fmt::format("\n  {:<7} {}", t.name, t.about);
  app.footer("TYPE is one of:" + types +
             "\nThe input is usually F16, BF16 or F32 (convert_hf_to_gguf.py's output). No importance matrix: "
             "the IQ2/IQ3/IQ1 types and Q2_K_S, which need one, are not offered.");
  app.add_option("input", a->in, "the model to quantize (a GGUF file or a known model name)")->required();
  app.add_option("output", a->out, "the GGUF file to write");
  app.add_option("type", a->type, "the file type to write (below)");
  app.add_option("-t,--threads", a->threads, "threads quantizing rows (default: all cores)")->check(at_least(1));
  app.add_flag("--pure", a->pure, "every quantized weight in TYPE's own type: no Q6_K head, no mixed layers");
  app.add_flag("--allow-requantize", a->allow_requantize,
               "quantize tensors that are already quantized (loses more than quantizing the original)");
  app.add_flag("--leave-output-tensor", a->leave_output, "keep output.weight as it is");
  app.add_option("--output-tensor-type", a->output_type, "the output head's type (e.g. q8_0, f16)");
  app.add_option("--token-embedding-type", a->embedding_type, "the token embedding's type");
  app.add_flag("--dry-run", a->dry_run, "print the plan (sizes, types) and write nothing; OUT may be left out");
  app.add_flag("-v,--verbose", a->verbose, "list every tensor's type");
  return [a] {
    // `baton quantize IN TYPE --dry-run`: the second word is the type.
    if (a->dry_run && a->type.empty()) std::swap(a->type, a->out);
    if (a->type.empty() && find_quant_file_type(a->out))
      fail(ErrorKind::Usage, "give the file to write: baton quantize IN OUT {} (or --dry-run to see the plan only)", a->out);
    if (a->type.empty()) fail(ErrorKind::Usage, "give the type to write: baton quantize IN OUT TYPE (e.g. Q4_K_M)");
    return run_quantize(*a);
  };
}}};

}  // namespace
}  // namespace baton::cli
