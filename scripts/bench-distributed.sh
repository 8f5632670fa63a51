#!/usr/bin/env bash
# The distributed pipeline against one process, same model, one thread per process:
#   batch:  tg with 16 sequences decoding together (baton bench --parallel 16): 1 process vs 2 ranks
#           (the engine keeps 2 groups in flight, one per rank)  -> aggregate tokens/s and the ratio
#   single: one sequence (--parallel 1): 1 process vs 2 ranks   -> the process boundary's cost per
#           token, 1e6/tps(2 ranks) - 1e6/tps(1 process) in µs (one boundary each way: hidden
#           state rank 0 -> 1, logits rank 1 -> 0)
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

# tokens/s of the tg row of `baton bench --json`
tps() { python3 -c 'import json, sys; print([json.loads(l)["avg_ts"] for l in sys.stdin if l.startswith("{")][-1])'; }
run() {  # label, parallel, distributed(0/1)
  local args=(bench -m "$MODEL" -t 1 -p 0 -n "$N_GEN" -r "$REPS" --parallel "$2" --no-bandwidth --json)
  local out
  if [ "$3" = 1 ]; then out=$("${launch[@]}" "$BATON" "${args[@]}" --distributed 2>/dev/null)
  else out=$("$BATON" "${args[@]}" 2>/dev/null); fi
  local t; t=$(echo "$out" | tps)
  echo "$1 $t tok/s (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  echo "$t"
}

for ((r = 1; r <= ROUNDS; r++)); do
  b1=$(run "batch16  1 process " 16 0); b2=$(run "batch16  2 ranks   " 16 1)
  s1=$(run "single   1 process " 1 0); s2=$(run "single   2 ranks   " 1 1)
  python3 -c "
b1, b2, s1, s2 = $b1, $b2, $s1, $s2
print(f'round $r: batch 16: {b2:.1f} / {b1:.1f} tok/s = {b2 / b1:.2f}x | single stream: {s1:.1f} vs {s2:.1f} tok/s, '
      f'boundary cost {1e6 / s2 - 1e6 / s1:.0f} us per token')"
done
