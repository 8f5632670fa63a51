#!/usr/bin/env bash
# Pipeline stages on the CPU, in one run with the configurations alternating (so each sees the
# same machine load): the batch test (N sequences decoding together, aggregate t/s) and the single
# stream test (tg, 1 vs 2 vs 3 stages at the same threads per running stage).
# Usage: scripts/bench-pipeline.sh MODEL.gguf   (env: BATON, N (tokens per sequence), PAR, R, ROUNDS)
set -euo pipefail
BATON=${BATON:-build/baton}
M=${1:?model}
N=${N:-32} PAR=${PAR:-16} R=${R:-2} ROUNDS=${ROUNDS:-3}
out=$(mktemp -d)
batch=("1x1:--devices cpu -t 1" "2x1:--devices cpu,cpu --threads-per-stage 1" "1x2:--devices cpu -t 2")
single=("S1t2:--devices cpu --threads-per-stage 2" "S2t2:--devices cpu,cpu --threads-per-stage 2" "S3t2:--devices cpu,cpu,cpu --threads-per-stage 2"
        "S1t1:--devices cpu --threads-per-stage 1" "S2t1:--devices cpu,cpu --threads-per-stage 1" "S3t1:--devices cpu,cpu,cpu --threads-per-stage 1")
uptime
for round in $(seq "$ROUNDS"); do
  for c in "${batch[@]}"; do
    tag=${c%%:*}; flags=${c#*:}
    echo "+ $BATON bench -m $M -p 0 -n $N -r $R --parallel $PAR $flags" >&2
    $BATON bench -m "$M" -p 0 -n "$N" -r "$R" --parallel "$PAR" $flags --json --no-bandwidth >> "$out/$tag.json"
  done
  for c in "${single[@]}"; do
    tag=${c%%:*}; flags=${c#*:}
    echo "+ $BATON bench -m $M -p 0 -n $((N * 2)) -r $R $flags" >&2
    $BATON bench -m "$M" -p 0 -n $((N * 2)) -r "$R" $flags --json --no-bandwidth >> "$out/$tag.json"
  done
done
uptime
PAR=$PAR python3 - "$out" <<'PY'
import json, os, pathlib, statistics, sys
PAR = os.environ["PAR"]
d = pathlib.Path(sys.argv[1])
def tps(tag):
    rows = [json.loads(l) for l in (d / f"{tag}.json").read_text().splitlines() if l.strip()]
    return (statistics.median(s for r in rows for s in r["samples_ts"]),
            statistics.median(r["cpu_ms_per_token"] for r in rows))
print("| test | config | median t/s | ratio (wall) | CPU ms/token | ratio (CPU) |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
b11 = tps("1x1"); b12 = tps("1x2")
for tag, label in [("1x1", "1 stage x 1 thread"), ("2x1", "2 stages x 1 thread"), ("1x2", "1 stage x 2 threads")]:
    v, c = tps(tag)
    print(f"| batch {PAR} seqs | {label} | {v:.1f} | {v / b11[0]:.2f}x of 1x1, {v / b12[0]:.2f}x of 1x2 | {c:.2f} | {c / b11[1]:.3f} |")
for t in (2, 1):
    base = tps(f"S1t{t}")
    for s in (1, 2, 3):
        v, c = tps(f"S{s}t{t}")
        print(f"| single stream | {s} stage(s) x {t} thread(s) | {v:.1f} | {v / base[0]:.3f} | {c:.2f} | {c / base[1]:.3f} |")
PY
