#!/usr/bin/env bash
# `baton batch` throughput: the same 64 everyday prompts with --parallel 1 and --parallel 16, and
# llama.cpp's llama-batched-bench on the same model and threads with prompts of the same mean
# length. llama.cpp is built outside the project.
#
# What is compared (both sides count the same thing):
#   generated tokens / wall time from the first prompt evaluated to the last token generated
#   (prompt evaluation included, model loading not). For baton that is the batch summary's
#   "generated tok/s"; for llama-batched-bench it is npl*ntg / (T_PP + T_TG) at -npl 1 and 16.
# llama-batched-bench cannot take our prompts: it evaluates -npp placeholder tokens per sequence
# and then exactly -ntg tokens for each of -npl sequences. So -npp is the mean chat-templated
# prompt length of our 64 prompts (measured by baton in the parallel-1 run), -ntg the max_tokens
# below, and every prompt asks for a long answer so that nearly all of them run to max_tokens
# (the script prints how many did). Greedy decoding (temperature 0): deterministic output.
#
# Usage: scripts/bench-batch.sh [MODEL]   (default smollm2-135m)
# env: BATON (build/baton), BATCHED_BENCH (/tmp/llcpp/build/bin/llama-batched-bench), THREADS (2),
#      MAX_TOKENS (128), PARALLEL (16), ROUNDS (1: how many times the three runs alternate), KEEP (dir)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m}
BATON=${BATON:-build/baton}
BATCHED_BENCH=${BATCHED_BENCH:-/tmp/llcpp/build/bin/llama-batched-bench}
THREADS=${THREADS:-2} MAX_TOKENS=${MAX_TOKENS:-128} PARALLEL=${PARALLEL:-16} ROUNDS=${ROUNDS:-1}
export LD_LIBRARY_PATH="$(dirname "$BATCHED_BENCH")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
dir=${KEEP:-$(mktemp -d)}
mkdir -p "$dir"

# The model file for llama.cpp: a path as is, a known name through baton's resolver.
if [ -f "$MODEL" ]; then gguf=$MODEL; else gguf=$(bash scripts/fetch-model.sh "$MODEL" | tail -n 1); fi
[ -f "$gguf" ] || { echo "bench-batch: cannot find the model file for $MODEL (got '$gguf')" >&2; exit 2; }

# 64 prompts: 16 everyday subjects x 4 ways of asking for a long answer. Same file every time.
# shellcheck source=scripts/prompts.sh
source scripts/prompts.sh
in="$dir/prompts.jsonl"
long_prompts "$in" "$MAX_TOKENS" 4

# The batch summary line, e.g. "64 ok, 0 failed | 2710 prompt + 8192 generated tokens | 93.1 s | 88.0 generated tok/s".
summary_tps() { sed -n 's/.* | \([0-9.]*\) generated tok\/s.*/\1/p' "$1" | tail -n 1; }

run_baton() {  # $1 = parallel, $2 = round
  local tag="baton-p$1-r$2"
  echo "+ $BATON batch -m $gguf -i $in -o $dir/$tag.jsonl --parallel $1 -t $THREADS" >&2
  "$BATON" batch -m "$gguf" -i "$in" -o "$dir/$tag.jsonl" --parallel "$1" -t "$THREADS" 2> "$dir/$tag.err"
  tail -n 1 "$dir/$tag.err" >&2
}

run_llama() {  # $1 = npp, $2 = round
  local tag="llama-r$2" ctx=$(( PARALLEL * ($1 + MAX_TOKENS) + 256 ))
  echo "+ $BATCHED_BENCH -m $gguf -t $THREADS -c $ctx -b 2048 -ub 512 -npp $1 -ntg $MAX_TOKENS -npl 1,$PARALLEL" >&2
  "$BATCHED_BENCH" -m "$gguf" -t "$THREADS" -c "$ctx" -b 2048 -ub 512 -npp "$1" -ntg "$MAX_TOKENS" \
    -npl "1,$PARALLEL" > "$dir/$tag.out" 2> "$dir/$tag.err"
  grep -E '^\|' "$dir/$tag.out" >&2
}

# p1 streams the weights and follows the host's memory bandwidth, p16 much less: the same binary's
# p16/p1 moved from 3.6x to 4.6x within an hour on a shared VM (docs/BENCHMARKS.md, session 8).
# So the read bandwidth at both ends of the run is printed with it.
read_bw() { "$BATON" bench-kernels --types Q4_0 -t "$THREADS" --read-mib 512 --gemv-mib 1 --cols 256 --gemm-rows 16 2>/dev/null \
  | awk '$1 == "read" { print $6 " GB/s" }'; }
echo "load before: $(uptime)" >&2
echo "read bandwidth before ($THREADS threads): $(read_bw)" >&2
# The first parallel-1 run also measures the mean prompt length that llama.cpp is given.
run_baton 1 1
npp=$(python3 -c "
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(round(sum(x['prompt_tokens'] for x in r) / len(r)))" "$dir/baton-p1-r1.jsonl")
for r in $(seq 1 "$ROUNDS"); do
  [ "$r" = 1 ] || run_baton 1 "$r"
  run_baton "$PARALLEL" "$r"
  run_llama "$npp" "$r"
done
echo "load after: $(uptime)" >&2
echo "read bandwidth after ($THREADS threads): $(read_bw)" >&2

python3 - "$dir" "$ROUNDS" "$PARALLEL" "$MAX_TOKENS" "$npp" <<'PY'
import json, re, statistics, sys, pathlib
d, rounds, par, ntg, npp = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def baton(p, r):
    err = (d / f"baton-p{p}-r{r}.err").read_text()
    m = re.search(r"(\d+) ok, (\d+) failed.*\| (\d+) prompt \+ (\d+) generated tokens \| ([\d.]+) s \| ([\d.]+) generated tok/s", err)
    recs = [json.loads(l) for l in (d / f"baton-p{p}-r{r}.jsonl").read_text().splitlines() if l.strip()]
    full = sum(1 for x in recs if x.get("finish_reason") == "length")
    return dict(ok=int(m[1]), prompt=int(m[3]), gen=int(m[4]), s=float(m[5]), tps=float(m[6]), full=full, n=len(recs))

def llama(r):
    rows = {}
    for line in (d / f"llama-r{r}.out").read_text().splitlines():
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) >= 10 and c[0].isdigit():
            pp, tg, pl, t_pp, t_tg = int(c[0]), int(c[1]), int(c[2]), float(c[4]), float(c[6])
            rows[pl] = dict(e2e=pl * tg / (t_pp + t_tg), s_tg=float(c[7]), s_pp=float(c[5]))
    return rows

print(f"prompts: 64, mean chat-templated prompt {npp} tokens, max_tokens {ntg}, greedy, threads as given")
print("| round | baton p1 tok/s | baton p%d tok/s | p%d / p1 | llama npl1 | llama npl%d | baton p%d / llama npl%d | llama npl%d S_TG (decode only) |" % (par, par, par, par, par, par))
print("|---|---:|---:|---:|---:|---:|---:|---:|")
ratios, vs = [], []
for r in range(1, rounds + 1):
    b1, bp, l = baton(1, r), baton(par, r), llama(r)
    ratios.append(bp["tps"] / b1["tps"])
    vs.append(bp["tps"] / l[par]["e2e"])
    print(f"| {r} | {b1['tps']:.1f} | {bp['tps']:.1f} | {ratios[-1]:.2f}x | {l[1]['e2e']:.1f} | {l[par]['e2e']:.1f} | "
          f"{vs[-1]:.2f}x | {l[par]['s_tg']:.1f} |")
    for name, b in (("p1", b1), (f"p{par}", bp)):
        print(f"  baton {name}: {b['ok']} ok, {b['full']}/{b['n']} ran to max_tokens, {b['prompt']} prompt + {b['gen']} generated tokens in {b['s']:.1f} s")
if rounds > 1:
    print(f"median: p{par}/p1 {statistics.median(ratios):.2f}x, baton/llama {statistics.median(vs):.2f}x")
PY
echo "files in $dir" >&2
