#!/usr/bin/env bash
# Runs the GPU check on a GPU machine that has the NVIDIA driver, the CUDA Toolkit (cuBLAS), CMake
# and a compiler but nothing else and cannot install (the lent H200s), in a copy of the tree with
# .dev/ carried along. Two ways:
#   --build   builds there (all cores, sm_90) against the Debian packages scripts/gpu-deps.sh
#             extracted into .dev/deps, then runs the whole check (scripts/gpu-check.sh)
#   (default) the binaries scripts/device-bundle.sh built here and packed into .dev/bundle.tar.xz
# Ends by SECONDS seconds (default 480) and copies the logs to OUT_DIR as gpu-logs.tgz and
# summary.txt. With `-- CMD...`, runs CMD instead of the GPU check, in the same setting (binaries
# unpacked, library path set).
# Usage: scripts/device-check.sh [--build] [SECONDS] [OUT_DIR] [-- CMD...]   (OUT_DIR default: $OUT, else /tmp/gpu-out)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$(pwd)
args=()
build=0
while (($#)) && [[ $1 != -- ]]; do
  if [[ $1 == --build ]]; then build=1; else args+=("$1"); fi
  shift
done
[[ ${1:-} == -- ]] && shift
budget=${args[0]:-480}
out=${args[1]:-${OUT:-/tmp/gpu-out}}
mkdir -p "$out"
[[ -e ../shared ]] || ln -s "$root/.dev/shared" ../shared 2>/dev/null  # the peer data (device-bundle.sh copies it)
{
  nvidia-smi
  nvidia-smi topo -m
  uname -a; grep -m1 "model name" /proc/cpuinfo; nproc; free -g; cmake --version | head -1; c++ --version | head -1
} >"$out/machine.txt" 2>&1

# Another tree's baton for the decode A/B (device-bundle.sh with BATON_BUNDLE_BASE=REV).
base=()
if [[ -s .dev/baton-base.xz ]]; then
  xz -dc .dev/baton-base.xz >/tmp/baton-base && chmod +x /tmp/baton-base && base=(BATON_GPU_BASE_BIN=/tmp/baton-base)
fi

# check VAR=VALUE...: scripts/gpu-check.sh in that environment, its logs to $out.
check() {
  env "$@" "${base[@]}" BATON_GPU_END="$budget" BATON_GPU_MODELS=/tmp/baton-models \
    BATON_GPU_KERNEL_TYPES="Q4_0 Q4_K Q6_K Q8_0 IQ4_XS" scripts/gpu-check.sh /tmp/gpu-logs
  local rc=$?
  tar -czf "$out/gpu-logs.tgz" -C /tmp gpu-logs
  cp /tmp/gpu-logs/summary.txt "$out/"
  exit $rc
}

if ((build)); then
  [[ -d .dev/deps ]] || { echo "device-check: no .dev/deps (run scripts/gpu-deps.sh first)" >&2; exit 2; }
  check BATON_GPU_DEPS=.dev/deps BATON_GPU_BUILD=build-gpu BATON_GPU_CTEST_ARGS="-j 4"
fi
[[ -s .dev/bundle.tar.xz ]] || { echo "device-check: no .dev/bundle.tar.xz (run scripts/device-bundle.sh first)" >&2; exit 2; }
tar -xJf .dev/bundle.tar.xz

# The test binaries find the sources and the peer data by the paths they were built with.
src=$(cat .dev/source-dir)
if [[ $src != "$root" ]]; then
  mkdir -p "$(dirname "$src")"
  [[ -e $src ]] || ln -s "$root" "$src"
fi
peer_parent=$(dirname "$src")/shared
[[ -e $peer_parent ]] || ln -s "$root/.dev/shared" "$peer_parent"

# cuBLAS: the toolkit's, else a Python package's.
export LD_LIBRARY_PATH=$root/.dev/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ldd build-dev/baton | grep -q "not found"; then
  for d in $(find /usr /opt -name 'libcublas.so.13*' -printf '%h\n' 2>/dev/null | sort -u); do
    LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
  done
fi
ldd build-dev/baton | grep -E "not found|cublas|cudart"
if (($#)); then
  export OUT=$out
  "$@"
  exit
fi
check BATON_GPU_BUILD=build-dev BATON_GPU_PREBUILT=1 BATON_GPU_CTEST_ARGS="-E test_cuda_resources -j 4"
