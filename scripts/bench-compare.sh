#!/usr/bin/env bash
# Baton vs llama.cpp on the same files and threads, in one run: for each model and thread count,
# llama-bench and `baton bench` alternate, so both see the same machine load. Prints each tool's
# pp/tg tokens/s and the ratio baton / llama.cpp. llama.cpp is built outside the project.
# Usage: scripts/bench-compare.sh MODEL.gguf... (env: LLAMA_BENCH, BATON, P, N, R, THREADS)
set -euo pipefail
LLAMA_BENCH=${LLAMA_BENCH:-/tmp/llcpp/build/bin/llama-bench}
BATON=${BATON:-build/baton}
P=${P:-512} N=${N:-128} R=${R:-3} THREADS=${THREADS:-"2 1"}
export LD_LIBRARY_PATH="$(dirname "$LLAMA_BENCH")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=$(mktemp -d)
for m in "$@"; do
  for t in $THREADS; do
    tag="$(basename "$m" .gguf)-t$t"
    echo "+ $LLAMA_BENCH -m $m -p $P -n $N -t $t -r $R" >&2
    "$LLAMA_BENCH" -m "$m" -p "$P" -n "$N" -t "$t" -r "$R" -o json > "$out/$tag.llama.json" 2>/dev/null
    echo "+ $BATON bench -m $m -p $P -n $N -t $t -r $R --json" >&2
    "$BATON" bench -m "$m" -p "$P" -n "$N" -t "$t" -r "$R" --json --no-bandwidth > "$out/$tag.baton.json"
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
print("| model | threads | test | llama.cpp t/s | baton t/s | ratio |")
print("| --- | ---: | --- | ---: | ---: | ---: |")
for lf in sorted(d.glob("*.llama.json")):
    tag = lf.name[: -len(".llama.json")]
    ll = json.loads(lf.read_text())
    bt = [json.loads(l) for l in (d / f"{tag}.baton.json").read_text().splitlines() if l.strip()]
    for b in bt:
        test = b["test"]
        l = next(x for x in ll if (x["n_prompt"], x["n_gen"]) == (b["n_prompt"], b["n_gen"]))
        model, t = tag.rsplit("-t", 1)
        print(f"| {model} | {t} | {test} | {l['avg_ts']:.2f} ± {l['stddev_ts']:.2f} | "
              f"{b['avg_ts']:.2f} ± {b['stddev_ts']:.2f} | {b['avg_ts'] / l['avg_ts']:.2f} |")
PY
