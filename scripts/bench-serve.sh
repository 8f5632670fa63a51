#!/usr/bin/env bash
# `baton serve` under load, next to llama.cpp's llama-server on the same model, threads and slots:
# the 64 everyday prompts of bench-batch.sh sent as chat completions by CONCURRENCY clients
# (scripts/bench_serve.py), each reply MAX_TOKENS long (greedy, ignore_eos). Both servers get
# SLOTS sequences of 2048 tokens each (llama-server: -np SLOTS -c SLOTS*2048, which it divides).
# Servers start and stop in turn, ROUNDS times; the model loads before the clock starts.
# llama.cpp is built outside the project (LLAMA_SERVER=path; skipped when it is not there).
#
# Usage: scripts/bench-serve.sh [MODEL]   (default smollm2-135m)
# env: BATON (build/baton), LLAMA_SERVER (/tmp/llcpp/build/bin/llama-server), THREADS (2),
#      MAX_TOKENS (64), SLOTS (4), CONCURRENCY (8), ROUNDS (1), PORT (18080)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
BATON=${BATON:-build/baton}
LLAMA_SERVER=${LLAMA_SERVER:-/tmp/llcpp/build/bin/llama-server}
THREADS=${THREADS:-2} MAX_TOKENS=${MAX_TOKENS:-64} SLOTS=${SLOTS:-4} CONCURRENCY=${CONCURRENCY:-8}
ROUNDS=${ROUNDS:-1} PORT=${PORT:-18080}
export LD_LIBRARY_PATH="$(dirname "$LLAMA_SERVER")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT

if [ -f "$MODEL" ]; then gguf=$MODEL; else gguf=$(bash scripts/fetch-model.sh "$MODEL" | tail -n 1); fi
[ -f "$gguf" ] || { echo "bench-serve: cannot find the model file for $MODEL (got '$gguf')" >&2; exit 2; }
# shellcheck source=scripts/prompts.sh
source scripts/prompts.sh
long_prompts "$dir/prompts.jsonl" "$MAX_TOKENS" 4

# serve NAME PORT COMMAND...: starts the server, waits for /health, runs the load, stops the server.
# Each run gets a port of its own: the last run's connections linger in TIME_WAIT, which some
# servers cannot bind over.
serve() {
  local name=$1 port=$2
  shift 2
  "$@" > "$dir/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { echo "bench-serve: $name did not start:" >&2; tail -5 "$dir/$name.log" >&2; return 1; }
    sleep 0.2
  done
  printf '%-12s ' "$name"
  python3 scripts/bench_serve.py "http://127.0.0.1:$port" "$dir/prompts.jsonl" "$CONCURRENCY"
  kill -INT $pid
  wait $pid 2>/dev/null || true
}

echo "model $gguf, $THREADS threads, $SLOTS slots, $CONCURRENCY clients, 64 requests x $MAX_TOKENS tokens"
for round in $(seq 1 "$ROUNDS"); do
  p=$((PORT + 2 * round))
  serve baton $p "$BATON" serve -m "$gguf" --port $p -t "$THREADS" --parallel "$SLOTS" -c 2048
  if [ -x "$LLAMA_SERVER" ]; then
    serve llama-server $((p + 1)) "$LLAMA_SERVER" -m "$gguf" --port $((p + 1)) -t "$THREADS" -tb "$THREADS" \
      -np "$SLOTS" -c $((SLOTS * 2048)) -cb
  fi
done
