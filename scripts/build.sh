#!/usr/bin/env bash
# setup + build. Prints nothing but errors and a last line naming the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build=${BATON_BUILD_DIR:-build}
jobs=${BATON_JOBS:-$(nproc)}
cmake --build "$build" -j "$jobs" >/dev/null || cmake --build "$build" -j 1
echo "build: $build/baton"
