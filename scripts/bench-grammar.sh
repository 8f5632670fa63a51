#!/bin/bash
# What a grammar costs a reply: generated tok/s and time to first token of `baton run`,
# unconstrained vs --format json vs --json-schema, modes alternating, ROUNDS seeds each.
# Usage: scripts/bench-grammar.sh [MODEL...]   (default: smollm2-135m gemma3-270m)
# Env: BATON (default build/baton), ROUNDS (3), THREADS (2), N (64).
set -euo pipefail
BATON=${BATON:-build/baton}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
N=${N:-64}
SCHEMA='{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":30},"colors":{"type":"array","items":{"enum":["black","white","orange","grey"]},"maxItems":3}},"required":["name","age","colors"]}'
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(smollm2-135m gemma3-270m)
for m in "${models[@]}"; do
  for r in $(seq 1 "$ROUNDS"); do
    for mode in none json schema; do
      case $mode in
        none) extra=() ;;
        json) extra=(--format json) ;;
        schema) extra=(--json-schema "$SCHEMA") ;;
      esac
      stats=$("$BATON" run -m "$m" -p "Describe a cat in detail as JSON." "${extra[@]}" --temp 0.7 -s "$r" \
                -t "$THREADS" -n "$N" 2>&1 >/dev/null | tail -1)
      echo "$m $mode seed $r | ${stats#load * ms | }"
    done
  done
done
