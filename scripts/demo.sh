#!/usr/bin/env bash
# setup + build + fetch the default model (SmolLM2-135M-Instruct Q4_1) + run it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
model=$(bash scripts/fetch-model.sh smollm2-135m)
build/baton inspect "$model"
