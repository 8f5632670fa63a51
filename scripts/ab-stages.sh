#!/usr/bin/env bash
# One stream through 1 CPU stage against the same stream through several, for a noisy shared
# machine: `baton bench` tg (one sequence, full logits rows) with the two configurations
# alternating in ABBA order, and the median and quartiles of the per-round ratios SPLIT / ONE.
# Every stage gets the same threads, and one stream keeps one stage busy at a time, so the ratio is
# what the split itself costs (issue 5: each extra stage <= 2 %).
#
# Usage: scripts/ab-stages.sh ROUNDS DEVICES [MODEL]   e.g. scripts/ab-stages.sh 20 cpu,cpu,cpu
# env: BATON (build/baton), THREADS (threads per stage, 2), N_GEN (64)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: $0 ROUNDS DEVICES [MODEL]" >&2
  exit 2
fi
rounds=$1 devices=$2 model=${3:-smollm2-135m}
baton=${BATON:-build/baton} threads=${THREADS:-2} n_gen=${N_GEN:-64}

# Median tokens/s of one bench run (two repetitions).
run() {
  "$baton" bench -m "$model" -p 0 -n "$n_gen" -r 2 --devices "$1" --threads-per-stage "$threads" --json --no-bandwidth \
    | python3 -c 'import json, statistics, sys; print(statistics.median(json.loads(sys.stdin.read().splitlines()[-1])["samples_ts"]))'
}

uptime
rounds_file=$(mktemp)
trap 'rm -f "$rounds_file"' EXIT
for r in $(seq "$rounds"); do
  if (( r % 2 )); then a=$(run cpu); b=$(run "$devices"); else b=$(run "$devices"); a=$(run cpu); fi
  echo "$a $b" | awk '{printf "round: 1 stage %.1f t/s, %s %.1f t/s, ratio %.3f\n", $1, dev, $2, $2 / $1}' dev="$devices" \
    | tee -a "$rounds_file"
done
awk '{print $NF}' "$rounds_file" | sort -g | awk -v n="$rounds" -v dev="$devices" '
  {v[NR] = $1}
  END {
    med = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%s vs cpu over %d rounds: median ratio %.3f (IQR %.3f-%.3f)\n", dev, n, med, v[int(NR / 4) + 1], v[int(3 * NR / 4)]
  }'
uptime
