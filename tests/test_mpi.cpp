// The distributed pipeline end to end: real `mpirun` jobs of the baton binary on this machine
// (--oversubscribe: more ranks than cores is fine for correctness). Exit code 77 (ctest: skipped)
// when mpirun is missing or baton was built without MPI.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "helpers.h"
#include "model_helpers.h"
#include "runtime/distributed.h"
#include "runtime/shape.h"
#include "runtime/synth.h"

using namespace baton;

namespace {

using Clock = std::chrono::steady_clock;

void require_mpi() {
  if (!distributed_available()) {
    std::printf("skipping: baton was built without MPI (install libopenmpi-dev and reconfigure)\n");
    std::exit(77);
  }
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    std::printf("skipping: mpirun is not installed (scripts/setup.sh installs openmpi-bin)\n");
    std::exit(77);
  }
}

// mpirun with what a test machine needs: more ranks than cores, no core binding (ranks share the
// cores), and root allowed (containers).
std::string mpirun(int n) {
  std::string s = "mpirun --oversubscribe --bind-to none";
  if (geteuid() == 0) s += " --allow-run-as-root";
  return s + " -np " + std::to_string(n) + " ";
}

const std::string kBaton = BATON_BINARY;

struct Ran {
  int code = -1;
  std::string out, err;
};

// Runs a shell command with a time limit; stdout and stderr are captured separately.
Ran sh(const std::string& cmd, int limit_s = 120) {
  const std::string dir = test::temp_dir();
  const std::string full = "timeout " + std::to_string(limit_s) + " sh -c '" + cmd + "' >" + dir + "/out 2>" + dir + "/err";
  const int st = std::system(full.c_str());
  Ran r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = test::read_all(dir + "/out");
  r.err = test::read_all(dir + "/err");
  std::filesystem::remove_all(dir);
  return r;
}

std::string tiny() { return test::peer("logits/tiny-q4_0.gguf"); }

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int id : ids) {
    if (!s.empty()) s += ' ';
    s += std::to_string(id);
  }
  return s;
}

// The logits of one prompt from `baton logits`, as bytes.
std::string logits(const std::string& launch, const std::string& model, const std::string& ids, const std::string& extra) {
  const std::string out = test::temp_dir() + "/logits.f32";
  const Ran r = sh(launch + kBaton + " logits -m " + model + " --tokens \"" + ids + "\" -t 1 --out " + out + " " + extra);
  INFO(r.err);
  REQUIRE(r.code == 0);
  return test::read_all(out);
}

// Batch results by id, without the timing field.
std::map<std::string, nlohmann::json> batch_results(const std::string& path) {
  std::map<std::string, nlohmann::json> m;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    j.erase("ms");
    m[j["id"].dump()] = j;
  }
  return m;
}

// first_max_tokens > 0: the first request stops after that many tokens (its own max_tokens).
std::string write_prompts(int n, int first_max_tokens = 0) {
  const std::string p = test::temp_dir() + "/prompts.jsonl";
  std::ofstream f(p);
  for (int i = 0; i < n; ++i) {
    nlohmann::json j{{"id", i}, {"prompt", "Once upon a time number " + std::to_string(i) + ", there lived"},
                     {"seed", 100 + i}};
    if (i == 0 && first_max_tokens > 0) j["max_tokens"] = first_max_tokens;
    // Greedy: its rows come back as argmax ids; top_k 40 (the default): as candidates (kTopK);
    // top_k off: as full rows. All three mixed in one micro-batch.
    if (i % 3 == 0) j["temperature"] = 0;
    if (i % 3 == 1) j["top_k"] = 0;
    f << j.dump() << "\n";
  }
  return p;
}

// Pid of the rank `rank` of the job whose processes carry BATON_TEST_JOB=tag, or -1.
int find_rank(const std::string& tag, int rank) {
  const std::string want_tag = "BATON_TEST_JOB=" + tag, want_rank = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "environ", std::ios::binary);
    if (!f) continue;
    std::string env((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    bool has_tag = false, has_rank = false;
    for (size_t at = 0; at < env.size();) {
      const size_t end = env.find('\0', at);
      const std::string var = env.substr(at, end == std::string::npos ? std::string::npos : end - at);
      has_tag |= var == want_tag;
      has_rank |= var == want_rank;
      if (end == std::string::npos) break;
      at = end + 1;
    }
    std::ifstream comm(e.path() / "comm");
    std::string exe;
    comm >> exe;
    if (has_tag && has_rank && exe == "baton") return std::stoi(name);
  }
  return -1;
}

// Starts a 3-rank batch job in the background, waits until it has written its first result, does
// `hit` to one of its ranks, and returns the job's exit code, stderr and how long it took to end.
struct Ended {
  int code = -1;
  std::string err;
  double seconds = 0;
};
Ended break_a_rank(int rank, int signal, const std::string& env, const std::string& devices = "") {
  const std::string dir = test::temp_dir();
  const std::string tag = std::to_string(getpid()) + "-" + std::to_string(rank);
  const std::string cmd = "BATON_TEST_JOB=" + tag + " " + env + " " + mpirun(3) + kBaton + " batch -m " + tiny() +
                          " --raw -t 1 --temp 0 -n 400 --ctx 512 --parallel 4 -i " + write_prompts(400, 4) + " -o " + dir +
                          "/out.jsonl --distributed " + devices + " >" + dir + "/stdout 2>" + dir + "/stderr";
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), (char*)nullptr);
    _exit(127);
  }
  // A REQUIRE that fails below must not leave the job running (it would hold the machine's cores
  // and ctest's time): on the way out, kill the job's process group and its ranks, and reap it.
  struct Reaper {
    pid_t job;
    std::string tag;
    bool reaped = false;
    ~Reaper() {
      if (reaped) return;
      kill(-job, SIGKILL);
      for (int r = 0; r < 3; r++)
        if (const int pid = find_rank(tag, r); pid > 0) kill(pid, SIGKILL);
      int st = 0;
      waitpid(job, &st, 0);
    }
  } reaper{child, tag};
  // Mid-run: the first request (4 tokens) has finished and the ranks are still working on the
  // others (400 tokens each). (Under ASan on a loaded 2-core machine three ranks once took 60 s
  // to get there when the first request was as long as the others; a healthy run takes seconds.)
  const auto t_start = Clock::now();
  while (!std::filesystem::exists(dir + "/out.jsonl") || std::filesystem::file_size(dir + "/out.jsonl") == 0) {
    REQUIRE(Clock::now() - t_start < std::chrono::seconds(180));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int victim = find_rank(tag, rank);
  REQUIRE(victim > 0);
  REQUIRE(kill(victim, signal) == 0);
  const auto t_hit = Clock::now();
  int st = 0;
  Ended e;
  for (;;) {
    const pid_t w = waitpid(child, &st, WNOHANG);
    if (w == child) {
      reaper.reaped = true;
      break;
    }
    if (Clock::now() - t_hit > std::chrono::seconds(60)) {  // a hang: clean up, then fail below
      kill(-child, SIGKILL);
      kill(victim, SIGKILL);
      waitpid(child, &st, 0);
      reaper.reaped = true;
      e.seconds = 1e9;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (e.seconds == 0) e.seconds = std::chrono::duration<double>(Clock::now() - t_hit).count();
  kill(victim, SIGKILL);  // a stopped rank that outlived the job
  e.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  e.err = test::read_all(dir + "/stderr");
  std::filesystem::remove_all(dir);
  return e;
}

}  // namespace

TEST_CASE("2 and 3 ranks give the same logits as one process", "[mpi]") {
  require_mpi();
  const std::string p1 = ids_text(test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt")));
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((3 + 37 * i) % 1000);  // past the window of 16
  for (const auto& [model, prompt] : {std::pair{tiny(), p1}, std::pair{test::tiny_gemma3_model(), ids_text(ids)}}) {
    INFO(model);
    const std::string one = logits("", model, prompt, "");
    REQUIRE(one.size() > 0);
    for (int n : {2, 3}) {
      INFO(n << " ranks");
      const std::string many = logits(mpirun(n), model, prompt, "--distributed");
      CHECK(many.size() == one.size());
      CHECK(many == one);
    }
    // Output buffers of 7 rows: the prompt's micro-batches cut at 7 rows, the same logits.
    CHECK(logits(mpirun(2), model, prompt, "--distributed --outputs 7") == one);
  }
}

// GPU ranks run on the host emulation of the CUDA ops only in a build without CUDA.
bool cuda_emulation_build() {
  if (std::system((kBaton + " devices --no-links 2>/dev/null | grep -q \"no CUDA backend\"").c_str()) == 0) return true;
  WARN("a CUDA build: GPU ranks are tested on a GPU by gpu-check, not on the emulation");
  return false;
}

TEST_CASE("GPU ranks (on the host emulation) give the logits of one process on that GPU", "[mpi]") {
  require_mpi();
  if (!cuda_emulation_build()) return;
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((3 + 37 * i) % 1000);
  const std::string model = test::tiny_gemma3_model(), prompt = ids_text(ids);
  const std::string one = logits("BATON_CUDA_EMULATE=1 ", model, prompt, "--devices cuda:0");
  REQUIRE(one.size() > 0);
  for (int n : {2, 3}) {
    INFO(n << " ranks");
    // Every rank a GPU stage, the hidden state between them over the device channel (NCCL's host
    // emulation: the rows travel apart from the work messages), and with BATON_NCCL=0 inside the
    // work messages, through host memory.
    for (const std::string env : {"", "BATON_NCCL=0 "}) {
      INFO(env);
      const std::string out = test::temp_dir() + "/gpu-ranks.f32";
      const Ran r = sh(env + "BATON_CUDA_EMULATE=1 " + mpirun(n) + kBaton + " logits -m " + model + " --tokens \"" +
                       prompt + "\" -t 1 --devices cuda:0 --distributed --verbose --out " + out);
      INFO(r.err);
      REQUIRE(r.code == 0);
      CHECK(test::read_all(out) == one);
      for (int k = 0; k + 1 < n; ++k) {
        const std::string boundary = "rank " + std::to_string(k) + " -> rank " + std::to_string(k + 1) + ": ";
        CHECK(r.err.find(boundary + (env.empty() ? "NCCL emulated on the host" : "host memory over MPI")) != std::string::npos);
      }
    }
  }
  // --devices auto (the default) on ranks: each takes one device, the GPU of its local rank.
  {
    const std::string out = test::temp_dir() + "/auto-ranks.f32";
    const Ran r = sh("BATON_CUDA_EMULATE=1 " + mpirun(2) + kBaton + " logits -m " + model + " --tokens \"" + prompt +
                     "\" -t 1 --distributed --verbose --out " + out);
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(test::read_all(out) == one);
    CHECK(r.err.find("rank 0 -> rank 1: NCCL emulated on the host") != std::string::npos);
  }
  // A GPU rank feeding a CPU rank (one device per rank, MPMD launch) against one process with a GPU
  // stage then a CPU stage, cut the same way.
  const std::string mixed = logits("BATON_CUDA_EMULATE=1 ", model, prompt, "--devices cuda:0,cpu --tensor-split 1,1");
  const std::string out = test::temp_dir() + "/mixed.f32";
  const std::string args = " logits -m " + model + " --tokens \"" + prompt + "\" -t 1 --tensor-split 1,1 --distributed --out " + out;
  const Ran r = sh("BATON_CUDA_EMULATE=1 " + mpirun(1) + kBaton + args + " --devices cuda:0 : -np 1 " + kBaton + args +
                   " --devices cpu");
  INFO(r.err);
  REQUIRE(r.code == 0);
  CHECK(test::read_all(out) == mixed);
  CHECK(mixed != one);  // the CPU stage's arithmetic differs from the GPU's: the cut is real
}

TEST_CASE("batch output over 2 and 3 ranks equals one process", "[mpi]") {
  require_mpi();
  const std::string dir = test::temp_dir(), in = write_prompts(10);
  const std::string common = " batch -m " + tiny() + " --raw -t 1 --temp 0.8 -n 24 --ctx 128 --parallel 4 -i " + in;
  Ran r = sh(kBaton + common + " -o " + dir + "/one.jsonl");
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto one = batch_results(dir + "/one.jsonl");
  REQUIRE(one.size() == 10);
  for (int n : {2, 3}) {
    INFO(n << " ranks");
    const std::string out = dir + "/many" + std::to_string(n) + ".jsonl";
    r = sh(mpirun(n) + kBaton + common + " -o " + out + " --distributed");
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(batch_results(out) == one);
  }
}

TEST_CASE("every rank's stage holds no more than its plan", "[mpi]") {
  require_mpi();
  const Ran r = sh(mpirun(3) + kBaton + " run -m " + test::tiny_gemma3_model() + " --raw -p hi -n 2 -t 1 --ctx 64 --verbose --distributed");
  INFO(r.err);
  REQUIRE(r.code == 0);
  int stages = 0;
  std::istringstream lines(r.err);
  for (std::string line; std::getline(lines, line);) {
    // "stage 1 (rank1:cpu, layers [2, 4), 1 threads): planned 1.2 MiB (1234 B), measured 1.1 MiB (1200 B)"
    const size_t p = line.find("): planned "), m = line.find(", measured ");
    if (line.rfind("stage ", 0) != 0 || p == std::string::npos || m == std::string::npos) continue;
    const uint64_t planned = std::stoull(line.substr(line.find('(', p + 3) + 1));
    const uint64_t measured = std::stoull(line.substr(line.find('(', m) + 1));
    INFO(line);
    CHECK(line.find("rank" + std::to_string(stages) + ":cpu") != std::string::npos);
    CHECK(planned >= measured);
    CHECK(measured > 0);
    ++stages;
  }
  CHECK(stages == 3);
}

TEST_CASE("baton plan --distributed shows the rank of every stage", "[mpi]") {
  require_mpi();
  const Ran r = sh(mpirun(3) + kBaton + " plan -m " + tiny() + " --devices cpu --distributed");
  INFO(r.err);
  REQUIRE(r.code == 0);
  CHECK(r.out.find("rank0:cpu") != std::string::npos);
  CHECK(r.out.find("rank1:cpu") != std::string::npos);
  CHECK(r.out.find("rank2:cpu") != std::string::npos);
  CHECK(r.out.find("fits: yes, 3 stages") != std::string::npos);
}

TEST_CASE("bad launches are refused before any weights load", "[mpi]") {
  require_mpi();
  const std::string ids = "1 450 4996";
  SECTION("one rank") {
    const Ran r = sh(mpirun(1) + kBaton + " logits -m " + tiny() + " --tokens \"" + ids + "\" --out /dev/null --distributed");
    CHECK(r.code == 1);
    CHECK(r.err.find("needs at least 2 ranks") != std::string::npos);
  }
  SECTION("without a launcher") {
    const Ran r = sh(kBaton + " logits -m " + tiny() + " --tokens \"" + ids + "\" --out /dev/null --distributed");
    CHECK(r.code == 1);
    CHECK(r.err.find("needs at least 2 ranks") != std::string::npos);
  }
  SECTION("a different file on one rank") {
    std::string launch = mpirun(1) + kBaton + " logits -m " + tiny() + " --tokens \"" + ids + "\" --out /dev/null --distributed : ";
    launch += "-np 1 " + kBaton + " logits -m " + test::tiny_gemma3_model() + " --tokens \"" + ids + "\" --out /dev/null --distributed";
    const Ran r = sh(launch);
    CHECK(r.code != 0);
    INFO(r.err);
    CHECK(r.err.find("rank 1") != std::string::npos);
    CHECK(r.err.find("different model file") != std::string::npos);
  }
  SECTION("more ranks than layers") {
    const Ran r = sh(mpirun(5) + kBaton + " logits -m " + tiny() + " --tokens \"" + ids + "\" --out /dev/null --distributed");
    CHECK(r.code == 1);
    INFO(r.err);
    CHECK(r.err.find("launch at most 4 ranks") != std::string::npos);
  }
  SECTION("a plan that does not fit") {
    const Ran r = sh(mpirun(2) + kBaton + " run -m " + tiny() + " --raw -p hi -n 4 --devices cpu=4MiB --distributed");
    CHECK(r.code == 3);
    INFO(r.err);
    CHECK(r.err.find("does not fit") != std::string::npos);
    CHECK(r.err.find("rank0:cpu") != std::string::npos);
  }
}

TEST_CASE("a killed rank ends the job with an error within 30 s", "[mpi]") {
  require_mpi();
  const Ended e = break_a_rank(2, SIGKILL, "");
  INFO(e.err);
  CHECK(e.seconds < 30);
  CHECK(e.code != 0);
  CHECK(e.err.find("rank 2") != std::string::npos);
}

TEST_CASE("a rank that stops answering ends the job with an error naming it", "[mpi]") {
  require_mpi();
  const Ended e = break_a_rank(1, SIGSTOP, "BATON_MPI_TIMEOUT=3");
  INFO(e.err);
  CHECK(e.seconds < 30);
  CHECK(e.code != 0);
  CHECK(e.err.find("rank 1 stopped answering") != std::string::npos);
}

TEST_CASE("a GPU rank that stops answering ends the job, device channels and all", "[mpi]") {
  require_mpi();
  if (!cuda_emulation_build()) return;
  // Rank 2 waits for rank 1's hidden state on the device channel when rank 1 stops.
  const Ended e = break_a_rank(1, SIGSTOP, "BATON_MPI_TIMEOUT=3 BATON_CUDA_EMULATE=1", "--devices cuda:0");
  INFO(e.err);
  CHECK(e.seconds < 30);
  CHECK(e.code != 0);
  CHECK(e.err.find("rank 1 stopped answering") != std::string::npos);
}

// A model whose hidden state is wide enough (1024 floats a token) that a piece of rows goes as a
// rendezvous message, which completes only once the receiver takes it.
std::string wide_model() {
  static const std::string path = test::synth_q8_model(
      {"wide-llama", "llama", "test", 3, 1024, 8, 8, 128, 1024, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, false}, 9);
  return path;
}

TEST_CASE("a worker whose stage fails mid-run ends the job with its error, device channels and all", "[mpi]") {
  require_mpi();
  std::vector<int32_t> ids;
  for (int i = 0; i < 64; ++i) ids.push_back((11 + 29 * i) % 1000);
  std::vector<std::pair<std::string, std::string>> setups{{"", ""}};  // CPU ranks
  if (cuda_emulation_build()) setups.push_back({"BATON_CUDA_EMULATE=1 ", " --devices cuda:0"});  // NCCL's emulation
  for (const auto& [env, devices] : setups) {
    INFO(env << devices);
    // Rank 1 fails on its first piece (16 rows of 4 KiB) while rank 0 sends the other three: the
    // job must end with rank 1's error, and no rank may wait forever for rows the failed rank
    // never took (over a device channel it drains them).
    const auto t0 = Clock::now();
    const Ran r = sh("BATON_TEST_FAIL_WORK=1:1 " + env + mpirun(3) + kBaton + " logits -m " + wide_model() +
                     " --tokens \"" + ids_text(ids) + "\" -t 1 --batch-size 16 --distributed --out " +
                     test::temp_dir() + "/wide.f32" + devices, 60);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    INFO(r.err);
    CHECK(r.code != 0);
    CHECK(r.code != 124);  // timeout(1): a hang
    CHECK(seconds < 30);
    CHECK(r.err.find("rank 1: fault injected at work message 1") != std::string::npos);
    // Ended by the error itself, not later by the heartbeats of ranks that were left waiting.
    CHECK(r.err.find("stopped answering") == std::string::npos);
  }
}
