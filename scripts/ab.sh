#!/usr/bin/env bash
# A/B of two baton binaries on batch decode, for a noisy shared machine: many short runs, the two
# binaries alternating (ABBA order), and the median of the per-round ratios NEW / BASE. Each run is
# `baton batch --parallel 16` over 16 long-answer prompts × 64 tokens (about 1.5 s on 2 cores), so
# slow periods of the machine hit both sides of a round alike. An A/A run (the same binary twice)
# shows the spread: on the 2-core development VM, 20 rounds gave a median of 0.998 (IQR 0.97–1.04),
# so about 3 % is resolved by 30 rounds.
#
# Usage: scripts/ab.sh ROUNDS BASE_BINARY NEW_BINARY [MODEL]     (default model smollm2-135m)
# env: PARALLEL (16), THREADS (2), MAX_TOKENS (64)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "usage: $0 ROUNDS BASE_BINARY NEW_BINARY [MODEL]" >&2
  exit 2
fi
rounds=$1 base=$2 new=$3 model=${4:-smollm2-135m}
parallel=${PARALLEL:-16} threads=${THREADS:-2} max_tokens=${MAX_TOKENS:-64}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# shellcheck source=scripts/prompts.sh
source scripts/prompts.sh
long_prompts "$dir/prompts.jsonl" "$max_tokens"

# Generated tokens per second of one run (the batch summary line).
run() {
  "$1" batch -m "$model" -i "$dir/prompts.jsonl" -o "$dir/out.jsonl" --parallel "$parallel" -t "$threads" 2>&1 \
    | sed -n 's/.* | \([0-9.]*\) generated tok\/s.*/\1/p' | tail -n 1
  rm -f "$dir/out.jsonl"
}

for r in $(seq "$rounds"); do
  if (( r % 2 )); then a=$(run "$base"); b=$(run "$new"); else b=$(run "$new"); a=$(run "$base"); fi
  echo "$a $b"
done > "$dir/rounds.txt"

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
quartile() { sort -g | awk -v q="$1" '{v[NR] = $1} END {i = int(q * (NR - 1) + 0.5) + 1; print v[i]}'; }
ratios=$(awk '{printf "%.4f\n", $2 / $1}' "$dir/rounds.txt")
printf 'rounds %d: median NEW/BASE %.3f (IQR %.3f-%.3f); median tok/s base %.1f, new %.1f\n' "$rounds" \
  "$(median <<<"$ratios")" "$(quartile 0.25 <<<"$ratios")" "$(quartile 0.75 <<<"$ratios")" \
  "$(cut -d' ' -f1 "$dir/rounds.txt" | median)" "$(cut -d' ' -f2 "$dir/rounds.txt" | median)"
