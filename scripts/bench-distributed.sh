#!/usr/bin/env bash
# The distributed pipeline against one process, same model, one thread per process:
#   batch:  tg with 16 sequences decoding together (baton bench --parallel 16): 1 process vs 2 ranks
#           (the engine keeps 2 groups in flight, one per rank)  -> aggregate tokens/s and the ratio;
#           full logits rows come back to rank 0 (what sampled requests need)
#   greedy: `baton batch --parallel 16` over 16 greedy prompts x 128 tokens: 1 process vs 2 ranks,
#           generated tokens/s (prompts included); greedy rows come back as token ids
#   single: one sequence (--parallel 1): 1 process vs 2 ranks -> the process boundary's cost per
#           token, measured by rank 0 (a token handed to rank 1 until its logits are back, less rank
#           1's compute: `baton bench`'s "process links" line), and for comparison the difference
#           1e6/tps(2 ranks) - 1e6/tps(1 process) in µs, which the machine's noise dominates
# The runs alternate (ROUNDS times) so that background load hits both sides alike; the load
# average is printed next to every number.
# Usage: scripts/bench-distributed.sh [MODEL]   (default smollm2-135m)
# env: BATON (build/baton), N_GEN (64), REPS (3), ROUNDS (2)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
BATON=${BATON:-build/baton}
N_GEN=${N_GEN:-64} REPS=${REPS:-3} ROUNDS=${ROUNDS:-2}
launch=(mpirun --bind-to none -np 2)
[ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# shellcheck source=scripts/prompts.sh
source scripts/prompts.sh
long_prompts "$dir/prompts.jsonl" 128

# a field of the tg row of `baton bench --json`
field() { python3 -c 'import json, sys; print([json.loads(l).get(sys.argv[1], -1) for l in sys.stdin if l.startswith("{")][-1])' "$1"; }
run() {  # label, parallel, distributed(0/1); prints "tok/s link_us"
  local args=(bench -m "$MODEL" -t 1 -p 0 -n "$N_GEN" -r "$REPS" --parallel "$2" --no-bandwidth --json)
  local out
  if [ "$3" = 1 ]; then out=$("${launch[@]}" "$BATON" "${args[@]}" --distributed 2>/dev/null)
  else out=$("$BATON" "${args[@]}" 2>/dev/null); fi
  local t l; t=$(echo "$out" | field avg_ts); l=$(echo "$out" | field link_us_per_micro_batch)
  echo "$1 $t tok/s (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  echo "$t $l"
}
run_batch() {  # label, distributed(0/1); prints generated tok/s
  local args=(batch -m "$MODEL" -i "$dir/prompts.jsonl" -o "$dir/out.jsonl" --parallel 16 -t 1)
  rm -f "$dir/out.jsonl"
  local out
  if [ "$2" = 1 ]; then out=$("${launch[@]}" "$BATON" "${args[@]}" --distributed 2>&1 >/dev/null)
  else out=$("$BATON" "${args[@]}" 2>&1 >/dev/null); fi
  local t; t=$(echo "$out" | sed -n 's/.* | \([0-9.]*\) generated tok\/s.*/\1/p' | tail -n 1)
  echo "$1 $t tok/s (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  echo "$t"
}

for ((r = 1; r <= ROUNDS; r++)); do
  read -r b1 _ < <(run "batch16  1 process " 16 0); read -r b2 _ < <(run "batch16  2 ranks   " 16 1)
  g1=$(run_batch "greedy16 1 process " 0); g2=$(run_batch "greedy16 2 ranks   " 1)
  read -r s1 _ < <(run "single   1 process " 1 0); read -r s2 link < <(run "single   2 ranks   " 1 1)
  python3 -c "
b1, b2, g1, g2, s1, s2, link = $b1, $b2, $g1, $g2, $s1, $s2, $link
print(f'round $r: batch 16: {b2:.1f} / {b1:.1f} tok/s = {b2 / b1:.2f}x | greedy batch 16: {g2:.1f} / {g1:.1f} = {g2 / g1:.2f}x | '
      f'single stream: {s1:.1f} vs {s2:.1f} tok/s, boundary {link:.0f} us per token measured '
      f'({1e6 / s2 - 1e6 / s1:.0f} us from the rates)')"
done
