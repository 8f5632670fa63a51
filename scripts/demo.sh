#!/usr/bin/env bash
# setup + build + fetch the default model (SmolLM2-135M-Instruct Q4_1) + answer a prompt with it.
#   scripts/demo.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
model=$(bash scripts/fetch-model.sh smollm2-135m)
prompt=${1:-"What is the capital of France? Answer in one sentence."}
exec build/baton run -m "$model" --system "You are a helpful assistant." -p "$prompt" -n 128
