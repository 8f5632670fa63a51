#!/usr/bin/env bash
# ThreadSanitizer runs (not part of CI: ~45 min on 2 cores). Two builds:
#   build-tsan      the CPU code: thread pool, pipeline drivers, engine, CLI (every test but the
#                   gpu ones, the real-model ones, which pass 15 minutes there, and the mpi ones,
#                   where Open MPI's uninstrumented transports are all TSan sees)
#   build-sim-tsan  the CUDA simulator with each GPU thread on a TSan fiber: the race check of the
#                   kernels' shared and global memory (kernels/cuda_sim/fibers.cpp, docs/GPU.md),
#                   the stand-in for compute-sanitizer's racecheck
#   scripts/tsan.sh [cpu|sim|all]   (default all); any report fails its test (tests/tsan.supp).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
jobs=$(nproc)
if [ "$what" = cpu ] || [ "$what" = all ]; then
  echo "== tsan.sh: CPU build (build-tsan)"
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBATON_CUDA=OFF -DBATON_TSAN=ON -DBATON_REAL_TESTS=OFF >/dev/null
  cmake --build build-tsan -j "$jobs" >/dev/null
  (cd build-tsan && ctest --output-on-failure -j "$jobs" -LE 'gpu|mpi|real' --timeout 1800)
fi
if [ "$what" = sim ] || [ "$what" = all ]; then
  echo "== tsan.sh: CUDA simulator build (build-sim-tsan): the kernels' race check"
  cmake -S . -B build-sim-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBATON_CUDA=SIM -DBATON_TSAN=ON \
    -DBATON_REAL_TESTS=OFF >/dev/null
  cmake --build build-sim-tsan -j "$jobs" --target test_cuda_sim test_cuda_ops >/dev/null
  (cd build-sim-tsan && ctest --output-on-failure -j "$jobs" -R '^(test_cuda_sim|test_cuda_ops)$' --timeout 3600)
fi
