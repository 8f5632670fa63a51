#!/usr/bin/env bash
# Installs what Baton needs (Debian packages) and configures the build in ./build.
# Idempotent and non-interactive; runs `apt-get update` only when something is missing.
#   BATON_BUILD_DIR  build folder (default: build)
#   BATON_CUDA       AUTO|ON|OFF (default AUTO: on when nvcc is found)
#   CUDA_ARCHS       CUDA architectures (default: CMake's list 80;86;89;90; CI uses 90)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for pkg in build-essential cmake pkg-config libfmt-dev libcli11-dev catch2 nlohmann-json3-dev libedit-dev \
           clang libclang-rt-dev python3 \
           libsimde-dev g++-aarch64-linux-gnu \
           libopenmpi-dev openmpi-bin; do  # Open MPI: the --distributed pipeline (docs/DISTRIBUTED.md)
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ -z "${BATON_CUDA:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

build=${BATON_BUILD_DIR:-build}
args=(-S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DBATON_CUDA="${BATON_CUDA:-AUTO}")
[ -n "${CUDA_ARCHS:-}" ] && args+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
cmake "${args[@]}" >/dev/null
echo "setup: configured $build"
