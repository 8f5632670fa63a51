#!/usr/bin/env bash
# setup + build + every test, then the AVX-512 kernels emulated, an aarch64 compile check of the CPU
# code, the GPU tests on the CUDA simulator, an ASan+UBSan build of the CPU tests, a short fuzz run.
#   BATON_FUZZ_SECONDS  how long each of the two fuzzers runs, side by side (default 40)
#   BATON_SKIP_AVX512=1 / BATON_SKIP_ARM=1 / BATON_SKIP_SIM=1 / BATON_SKIP_ASAN=1 / BATON_SKIP_FUZZ=1 to leave
#   those stages out while iterating locally.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
t0=$(date +%s)
stage() { echo "== test.sh: $* ($(( $(date +%s) - t0 ))s)"; }

stage "setup and build"
bash scripts/build.sh

stage "fetch the real models the tests use"
export BATON_CACHE=${BATON_CACHE:-$HOME/.cache/baton}
bash scripts/fetch-model.sh smollm2-135m >/dev/null
bash scripts/fetch-model.sh gemma3-270m >/dev/null
export BATON_REQUIRE_MODELS=1   # a missing model is a failure here, not a skip

stage "tests"
(cd build && ctest --output-on-failure -j "$(nproc)")

if [ "${BATON_SKIP_AVX512:-0}" != 1 ]; then
  # The AVX-512 kernels (the path most servers take) on this AVX2 machine through SIMDe, compared
  # bit for bit with the portable kernels, and a model forward against llama.cpp's logits
  # (kernels/cpu/avx512_emulated.h). Skipped where the CPU itself has AVX-512: the main tests ran them.
  # (/proc/cpuinfo spells the flag avx512_vnni; the kernels ask the compiler's avx512vnni.)
  if grep -qE 'avx512_?vnni' /proc/cpuinfo 2>/dev/null && grep -qw avx512vl /proc/cpuinfo; then
    stage "AVX-512 kernels: this CPU has them, the tests above ran them"
  else
    stage "AVX-512 kernels emulated on AVX2 (SIMDe)"
    cmake -S . -B build-avx512 -DCMAKE_BUILD_TYPE=Release -DBATON_CUDA=OFF -DBATON_EMULATE_AVX512=ON \
      -DBATON_REAL_TESTS=OFF >/dev/null
    cmake --build build-avx512 -j "$(nproc)" --target test_matmul test_ops test_model_tiny test_peer_logits >/dev/null
    (cd build-avx512 && ctest --output-on-failure -j "$(nproc)" -R '^(test_matmul|test_ops|test_model_tiny|test_peer_logits)$')
  fi
fi

if [ "${BATON_SKIP_ARM:-0}" != 1 ] && command -v aarch64-linux-gnu-g++ >/dev/null; then
  # Non-x86 CPUs (aarch64) run the scalar kernels: the CPU code must compile there without x86
  # intrinsics (the x86 kernel files compile to nothing). A syntax check with the cross compiler;
  # the header-only dependencies come from the host's /usr/include.
  stage "aarch64: the CPU code compiles without x86 intrinsics"
  for f in quant/*.cpp gguf/*.cpp kernels/cpu/*.cpp; do
    aarch64-linux-gnu-g++ -std=c++20 -I. -idirafter /usr/include -fsyntax-only -Wall -Wextra -Werror \
      -Wno-missing-field-initializers "$f"
  done
fi

if [ "${BATON_SKIP_SIM:-0}" != 1 ]; then
  # The CUDA code itself (kernels, GPU stage, links, graphs) on the CUDA simulator, two simulated
  # devices: the `gpu` tests run here whether or not this machine has a GPU (docs/GPU.md).
  stage "CUDA simulator build: the gpu tests on the CPU"
  cmake -S . -B build-sim -DBATON_CUDA=SIM -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build-sim -j "$(nproc)" --target test_cuda_ops test_cuda_stage test_cuda_layout \
    test_cuda_quant_host test_cuda_sim test_peer_logits >/dev/null || cmake --build build-sim -j 1 --target test_cuda_ops
  (cd build-sim && ctest --output-on-failure -j "$(nproc)" -L gpu)
fi

if [ "${BATON_SKIP_ASAN:-0}" != 1 ]; then
  stage "ASan+UBSan build of the CPU and MPI tests"
  # -O1 -g1 (line tables: the sanitizers' reports still name file:line) compiles ~40 % faster
  # than RelWithDebInfo's -O2 -g; this build's compile is most of CI's time. The tests that need
  # a fetched model (label real) are not built here.
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBATON_CUDA=OFF -DBATON_SANITIZE=ON -DBATON_REAL_TESTS=OFF \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" >/dev/null
  cmake --build build-asan -j "$(nproc)" >/dev/null || cmake --build build-asan -j 1
  # The distributed tests (label mpi) run beside the others: this is the build where their
  # GPU-rank cases run (on the host emulation; a CUDA build skips them). Their leak check is off
  # (tests/CMakeLists.txt: Open MPI's allocations outlive MPI_Finalize).
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     ctest --output-on-failure -j "$(nproc)" -L 'cpu|mpi' -LE real)
fi

if [ "${BATON_SKIP_FUZZ:-0}" != 1 ]; then
  # The GGUF parser's and the grammar compiler's fuzzers side by side (one core each), each for
  # BATON_FUZZ_SECONDS; a crash in either fails the run (its input is left as crash-* here).
  fuzz_s=${BATON_FUZZ_SECONDS:-40}
  stage "fuzz the GGUF parser and the grammar compiler for ${fuzz_s}s, side by side"
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBATON_CUDA=OFF \
     -DBATON_FUZZ=ON >/dev/null
  cmake --build build-fuzz -j "$(nproc)" --target fuzz_gguf fuzz_grammar >/dev/null
  pids=() logs=() corpora=()
  for target in gguf:corpus:65536 grammar:corpus_grammar:8192; do
    IFS=: read -r name seeds max_len <<<"$target"
    corpus=$(mktemp -d)
    cp tests/fuzz/"$seeds"/* "$corpus"/
    log=$(mktemp)
    build-fuzz/tests/fuzz_"$name" -max_total_time="$fuzz_s" -max_len="$max_len" -rss_limit_mb=2048 \
       -print_final_stats=1 "$corpus" >"$log" 2>&1 &
    pids+=("$!") logs+=("$log") corpora+=("$corpus")
  done
  fuzz_failed=0
  for i in 0 1; do
    wait "${pids[$i]}" || fuzz_failed=1
    tail -n 12 "${logs[$i]}"
    rm -rf "${corpora[$i]}" "${logs[$i]}"
  done
  [ "$fuzz_failed" = 0 ] || { echo "test.sh: a fuzzer failed (its report is above)"; exit 1; }
fi
stage "all tests passed"
