#!/usr/bin/env bash
# GPU check (issue 7): build with CUDA for sm_90 on all cores, run the `gpu` tests, generate
# llama3-8b-shaped models, run whatever benchmark commands this tree has, print a short table last.
# Usage: scripts/gpu-check.sh [--sim] LOG_DIR   (full logs of every step go to LOG_DIR)
#   --sim  rehearsal without a GPU: every step on the CUDA simulator (BATON_CUDA=SIM, two simulated
#          devices), with a small model instead of the 8B shape and short benchmarks. Its numbers
#          mean nothing; it shows that every step's command runs and the table comes out.
# Environment: BATON_GPU_ARCH (default 90), BATON_GPU_BUILD (default build-gpu, build-sim with --sim),
#              BATON_GPU_MODELS (folder for the generated models, default LOG_DIR/models),
#              BATON_GPU_SYNTH=0 (do not generate models: quick reruns),
#              BATON_GPU_PREBUILT=1 (no configure/build: $BATON_GPU_BUILD holds the binaries),
#              BATON_GPU_DEPS=DIR (the build's libraries extracted from Debian packages into DIR by
#              scripts/gpu-deps.sh, for a machine that has only CUDA, CMake and a compiler),
#              BATON_GPU_END=S (end every step by S seconds from the start; later steps are skipped),
#              BATON_GPU_CTEST_ARGS (more ctest arguments), BATON_GPU_KERNEL_TYPES ("Q4_0 Q4_K": the
#              kernels step's types; default all), BATON_GPU_BASE_BIN (another tree's baton: decode
#              A/B against it, alternating).
# Steps whose command does not exist yet in this tree are skipped with a note, not failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

sim=0
if [[ ${1:-} == --sim ]]; then sim=1; shift; fi
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [--sim] LOG_DIR" >&2
  exit 2
fi
logs=$(mkdir -p "$1" && cd "$1" && pwd)
arch=${BATON_GPU_ARCH:-90}
models=${BATON_GPU_MODELS:-$logs/models}
if [[ $sim == 1 ]]; then
  build=${BATON_GPU_BUILD:-build-sim}
  cuda_mode=SIM
  shape="sim-small"
  synth_shape=(--n-embd 256 --n-layer 6 --n-head 4 --n-head-kv 2 --n-ff 768 --n-vocab 4096)
  pp=64 tg=16 depth=300 spill=72MiB  # the reserve holds a 32 MiB cuBLAS workspace
else
  build=${BATON_GPU_BUILD:-build-gpu}
  cuda_mode=ON
  shape=llama3-8b
  synth_shape=(--shape llama3-8b)
  pp=512 tg=128 depth=4096 spill=2GiB
fi
jobs=$(nproc)
bin=$build/baton
rows=()  # "step|status|seconds|note"
failed=0

note() { printf '%s\n' "$*" | tee -a "$logs/summary.txt"; }
row() { rows+=("$1|$2|$3|$4"); }

# The numbers of a `baton bench` log for the table: each test's t/s, and the decode's weight GB/s
# with its share of the measured copy bandwidth, e.g. "pp512 15021 t/s; tg128 802 t/s 3620 GB/s (74%)".
bench_note() {
  awk -F'|' '$7 ~ /(pp|tg)[0-9]+/ {
      gsub(/ /, "", $7); split($8, t, "±"); gsub(/ /, "", t[1]); n = split($9, g, " ")
      gb = (n > 0) ? " " g[1] " GB/s" ((n > 1) ? " " g[2] : "") : ""
      printf "%s%s %s t/s%s", sep, $7, t[1], gb; sep = "; "
    }' "$1" | cut -c1-90
}

# The numbers of a `baton bench-kernels --device cuda:N` log: per type the 1-column GEMV's share of
# the copy bandwidth, the column count from which the GEMM is faster (">128": never) and the
# fastest FP16 slab of the 512-column GEMM.
kernels_note() {
  awk '$1 == "gemv" && $3 == 1 { pct[$2] = $6 }
       $1 == "gemv2r" && $3 == 1 { pct2[$2] = "/" $6 }
       $1 == "gemvS" && $3 == 1 { pct3[$2] = "/" $6 }
       $1 == "cut-over" { t = $2; sub(":", "", t); n = ($NF == "columns" && $(NF-1) ~ /^[0-9]+$/) ? $(NF-1) : ">128"
                          if ($0 ~ /already at 8/) n = "<=8"; if ($0 ~ /GEMV faster up to/) n = ">128"
                          cut[t] = n; order[++k] = t }
       $1 == "slab" { t = $2; sub(":", "", t); slab[t] = ($NF == "MiB") ? $(NF-1) "M" : "all" }
       END { for (i = 1; i <= k; i++) { t = order[i]; printf "%s%s %s%s%s cut %s slab %s", sep, t, pct[t], pct2[t], pct3[t], cut[t], slab[t]; sep = "; " } }' "$1" \
    | cut -c1-170
}
# The decode t/s of a `baton bench` log's tg row ("" when it has none).
tg_of() { [[ -s $1 ]] && awk -F'|' '$7 ~ /tg[0-9]+/ { split($8, t, "±"); gsub(/ /, "", t[1]); print t[1]; exit }' "$1"; }
# The GEMV forms' decode against the default's, for type $1: "default 418.2; nosplit x1.010; ...".
gemv_forms_note() {
  local t=$1 base f v out
  base=$(tg_of "$logs/bench-1stage-$t.log")
  [[ -n $base ]] || { echo "no default decode to compare with"; return; }
  out="default $base t/s"
  for f in tuned tunedany nosplit rows2 stream streamnopf attn2; do
    v=$(tg_of "$logs/bench-1stage-$f-$t.log")
    [[ -n $v ]] && out+=$(awk -v f="$f" -v v="$v" -v b="$base" 'BEGIN { printf "; %s x%.3f", f, v / b }')
  done
  echo "$out"
}
# The GEMV forms a stage measured and chose at load (`--verbose` lines "stage K: GEMV forms, OP
# (R x C, TYPE), 1 column: FORM  [...]"), one column: "q/k/v stream, output proj. split, ...".
tuned_note() {
  [[ -s $1 ]] || { echo "no log"; return; }
  sed -n 's/^stage 0: GEMV forms, \([^(]*\) (.*), 1 column: \([a-z]*\) .*/\1 \2/p' "$1" | paste -sd, - | sed 's/,/, /g'
}
# The fastest slab (MiB) for type $2 in a kernels log, when it is below the default 64 MiB.
best_slab() { awk -v t="$2:" '$1 == "slab" && $2 == t && $NF == "MiB" && $(NF-1) < 64 { print $(NF-1) }' "$1"; }

# Time limits. BATON_GPU_END=S: no step runs past S seconds from the start (each step's limit is
# cut to what is left, and later steps are skipped), so a lent machine's call ends with its logs.
end_s=${BATON_GPU_END:-0}
# limit_for LIMIT: LIMIT, or what is left before BATON_GPU_END when that is less (0: nothing left).
limit_for() {
  local l=$1
  if ((end_s > 0)); then
    local left=$((end_s - SECONDS))
    ((left < 5)) && left=0
    ((left < l)) && l=$left
  fi
  echo "$l"
}

# run NAME TIMEOUT CMD... : logs to LOG_DIR/NAME.log, records status and wall time.
run() {
  local name=$1 limit
  limit=$(limit_for "$2")
  shift 2
  if ((limit == 0)); then row "$name" skipped 0 "no time left (BATON_GPU_END)"; return 0; fi
  local t0=$SECONDS rc
  echo "== $name: $*" >"$logs/$name.log"
  timeout "$limit" "$@" >>"$logs/$name.log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0))
  if [[ $rc -eq 0 && $name == bench-* ]]; then
    row "$name" ok "$dt" "$(bench_note "$logs/$name.log")"
  elif [[ $rc -eq 0 && $name == kernels ]]; then  # "Q4_0 78% cut 24; Q4_K ..." (the log has the table)
    row "$name" ok "$dt" "$(kernels_note "$logs/$name.log")"
  elif [[ $rc -eq 0 && $name == batch* ]]; then  # the summary line's "N ok, ... | X generated tok/s"
    row "$name" ok "$dt" "$(grep -E 'generated tok/s' "$logs/$name.log" | tail -n 1 | sed 's/ failed.*|/ failed |/' | cut -c1-60)"
  elif [[ $rc -eq 0 ]]; then
    row "$name" ok "$dt" "$(tail -n 1 "$logs/$name.log" | cut -c1-60)"
  elif [[ $rc -eq 124 ]]; then
    row "$name" TIMEOUT "$dt" "limit ${limit}s"; failed=1
  else
    row "$name" FAIL "$dt" "exit $rc, see $name.log"; failed=1
  fi
  return $rc
}

# True when the baton binary has subcommand $1 (and, with $2, that option).
has_cmd() { [[ -x $bin ]] && "$bin" "$1" --help >/dev/null 2>&1 && { [[ $# -lt 2 ]] || "$bin" "$1" --help 2>&1 | grep -q -- "$2"; }; }
skip() { row "$1" skipped 0 "$2"; }

note "gpu-check $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname), logs in $logs$([[ $sim == 1 ]] && echo ' (REHEARSAL on the CUDA simulator)')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader \
  | tee "$logs/gpu.txt"

# 1. Build (sm_$arch only, all cores). BATON_GPU_PREBUILT=1: $build already holds the binaries
# (built elsewhere for sm_$arch; the device-check script brings them).
deps_args=()
if [[ -n ${BATON_GPU_DEPS:-} ]]; then  # CMake finds the packages there; the linker and loader their libraries
  deps=$(cd "$BATON_GPU_DEPS" && pwd)
  deps_args=(-DCMAKE_PREFIX_PATH="$deps/usr")
  export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [[ ${BATON_GPU_PREBUILT:-0} == 1 ]]; then
  row build prebuilt 0 "$build"
else
  run configure 300 cmake -S . -B "$build" -DBATON_CUDA=$cuda_mode -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_BUILD_TYPE=Release \
    "${deps_args[@]}"
  run build 900 cmake --build "$build" -j "$jobs"
fi

# 2. llama3-8b-shaped models (Q4_0, Q4_K; with --sim a small llama), written in the background
# while the tests run: each writes $models/<file>.status with its exit code when done.
mkdir -p "$models"
synth_wanted=0
if [[ ${BATON_GPU_SYNTH:-1} == 0 ]]; then
  skip synth "BATON_GPU_SYNTH=0"
elif has_cmd synth; then
  synth_wanted=1
  (
    for t in Q4_0 Q4_K; do
      f=$models/$shape-$t.gguf
      [[ -s $f && ! -e $f.status ]] && { echo 0 >"$f.status"; continue; }
      [[ -s $f && $(cat "$f.status") == 0 ]] && continue
      t0=$SECONDS
      timeout 600 "$bin" synth "${synth_shape[@]}" --type "$t" --out "$f" >"$logs/synth-$t.log" 2>&1
      rc=$?
      echo "$((SECONDS - t0)) s" >>"$logs/synth-$t.log"
      echo $rc >"$f.status"
    done
  ) &
else
  skip synth "no 'baton synth' yet"
fi
# have_model TYPE: waits for the background synth of TYPE (up to the time left), true when written.
have_model() {
  local f=$models/$shape-$1.gguf
  ((synth_wanted)) || { [[ -s $f ]]; return; }
  local t0=$SECONDS
  while [[ ! -e $f.status ]] && (($(limit_for 600) > 0)); do sleep 1; done
  if [[ -e $f.status && $(cat "$f.status") == 0 ]]; then
    [[ -e $f.row ]] || { row "synth-$1" ok "$(tail -n 1 "$logs/synth-$1.log" 2>/dev/null | tr -d ' s')" "$f (waited $((SECONDS - t0)) s)"; touch "$f.row"; }
    return 0
  fi
  [[ -e $f.row ]] || { row "synth-$1" FAIL 0 "see synth-$1.log"; failed=1; touch "$f.row"; }
  return 1
}

# 3. GPU tests (exit 77 = skipped: no GPU visible). BATON_GPU_CTEST_ARGS: more ctest arguments.
if [[ -d $build ]]; then
  # shellcheck disable=SC2086
  run gpu-tests 900 ctest --test-dir "$build" -L gpu --output-on-failure ${BATON_GPU_CTEST_ARGS:-}
  grep -E "tests passed|tests failed|Skipped|\*\*\*Failed|Timeout" "$logs/gpu-tests.log" | tee -a "$logs/summary.txt"
fi

# 4. Devices and copy bandwidth.
if has_cmd devices; then run devices 60 "$bin" devices; else skip devices "no 'baton devices' yet"; fi

# 5. The same greedy tokens with 1, 2 and 3 stages, peer-to-peer and host-staged (issue 7): the peer
# tiny model (in the tree's shared/ when present) and the 8B shape.
same_tokens() {  # NAME MODEL: every split must print the 1-stage text
  local name=$1 model=$2 ref out cfg ok=1 t0=$SECONDS
  if (($(limit_for 120) == 0)); then skip "$name" "no time left (BATON_GPU_END)"; return; fi
  local args=(run -m "$model" --raw -p "Once upon a time" -n 32 --temp 0)
  echo "== $name" >"$logs/$name.log"
  ref=$(timeout "$(limit_for 120)" "$bin" "${args[@]}" --devices cuda:0 2>>"$logs/$name.log") || ok=0
  echo "1 stage: $ref" >>"$logs/$name.log"
  for cfg in "cuda:0,cuda:0 --p2p on" "cuda:0,cuda:0 --p2p off" "cuda:0,cuda:0,cuda:0 --p2p on" "cuda:0,cuda:0,cuda:0 --p2p off"; do
    (($(limit_for 120) == 0)) && { ok=0; echo "$cfg: no time left" >>"$logs/$name.log"; break; }
    # shellcheck disable=SC2086
    out=$(timeout "$(limit_for 120)" "$bin" "${args[@]}" --devices $cfg --verbose 2>>"$logs/$name.log") || ok=0
    echo "$cfg: $out" >>"$logs/$name.log"
    [[ $out == "$ref" ]] || ok=0
  done
  if [[ $ok == 1 && -n $ref ]]; then row "$name" ok $((SECONDS - t0)) "1/2/3 stages, p2p on/off: same text"
  else row "$name" FAIL $((SECONDS - t0)) "texts differ or a run failed, see $name.log"; failed=1; fi
}
tiny_model=
for tiny in shared/peer/logits/tiny-q4_0.gguf ../shared/peer/logits/tiny-q4_0.gguf; do [[ -s $tiny ]] && { tiny_model=$tiny; break; }; done
has_p2p=0
has_cmd run --p2p && has_p2p=1
if ((has_p2p)) && [[ -n $tiny_model ]]; then same_tokens same-tokens-tiny "$tiny_model"; fi

# 5b. Session 33 on a GPU stage (peer tiny model): a draft model (the model itself) gives the same
# greedy text with every guess kept; perplexity on cuda:0 within 1 % of the CPU's.
session33() {
  local t0=$SECONDS log="$logs/draft-perplexity.log" note
  if (($(limit_for 120) == 0)); then skip draft-perplexity "no time left (BATON_GPU_END)"; return; fi
  local args=(run -m "$tiny_model" --raw -p "Once upon a time" -n 32 --temp 0 --devices cuda:0 --json)
  local ppl=(perplexity -m "$tiny_model" -f docs/ARCHITECTURE.md -c 128 --chunks 8 --json)
  {
    echo "== draft-perplexity"
    timeout 60 "$bin" "${args[@]}" >"$logs/plain.json"
    timeout 60 "$bin" "${args[@]}" --draft-model "$tiny_model" >"$logs/draft.json"
    timeout 60 "$bin" "${ppl[@]}" --devices cpu >"$logs/ppl-cpu.json"
    timeout 60 "$bin" "${ppl[@]}" --devices cuda:0 >"$logs/ppl-cuda.json"
  } >>"$log" 2>&1
  if note=$(python3 - "$logs" <<'PY' 2>>"$log"
import json, sys
d = sys.argv[1]
a, b = (json.load(open(f"{d}/{n}.json")) for n in ("plain", "draft"))
c, g = (json.load(open(f"{d}/ppl-{n}.json"))["ppl"] for n in ("cpu", "cuda"))
ok = a["text"] == b["text"] and b["draft"]["accepted"] > 0 and abs(g / c - 1) <= 0.01
print(f"same text: {a['text'] == b['text']}, {b['draft']['accepted']}/{b['draft']['drafted']} kept; ppl cpu {c:.2f} cuda {g:.2f}")
sys.exit(0 if ok else 1)
PY
  ); then
    row draft-perplexity ok $((SECONDS - t0)) "$note"
  else
    row draft-perplexity FAIL $((SECONDS - t0)) "${note:-a run failed}, see draft-perplexity.log"; failed=1
  fi
}
if has_cmd perplexity && [[ -n $tiny_model ]]; then session33; else skip draft-perplexity "no 'baton perplexity' or no peer tiny model"; fi

# 6. Benchmarks, the most wanted first: per type 1 stage, 2 stages on one GPU (P2P and host-staged);
# for Q4_0 also the same tokens on the 8B shape, a GPU -> CPU spill and a 16-sequence batch on 2
# stages; then what the decode graphs save, the CUDA matmuls alone and the other batch variants.
bench_splits() {  # TYPE MODEL
  local t=$1 f=$2
  run "bench-1stage-$t" 300 "$bin" bench -m "$f" --devices cuda:0 -p "$pp" -n "$tg" --verbose
  if has_cmd bench --p2p; then
    run "bench-2stage-p2p-$t" 300 "$bin" bench -m "$f" --devices cuda:0,cuda:0 --p2p on -p "$pp" -n "$tg"
    run "bench-2stage-host-$t" 300 "$bin" bench -m "$f" --devices cuda:0,cuda:0 --p2p off -p "$pp" -n "$tg"
  else  # one link type so far: host-staged (device -> host -> device at the stage boundary)
    run "bench-2stage-host-$t" 300 "$bin" bench -m "$f" --devices cuda:0,cuda:0 --tensor-split 1,1 -p "$pp" -n "$tg"
  fi
}
f0=$models/$shape-Q4_0.gguf
fk=$models/$shape-Q4_K.gguf
jobs_file=$logs/batch16.jsonl
for i in $(seq 1 16); do echo "{\"id\": \"s$i\", \"prompt\": \"Sequence $i: count to twenty.\", \"max_tokens\": 64}"; done >"$jobs_file"
if ! has_cmd bench; then
  skip bench "no 'baton bench' yet"
elif have_model Q4_0; then
  bench_splits Q4_0 "$f0"
  ((has_p2p)) && same_tokens "same-tokens-$shape" "$f0"
  # GPU -> CPU spill: 2 GiB of layers on the GPU, the rest on the CPU (short runs: the CPU part is slow).
  run bench-spill-Q4_0 300 "$bin" bench -m "$f0" --devices "cuda:0=$spill,cpu" -p 64 -n 16 -r 1 --verbose
  if has_cmd batch; then
    run batch16-2stage 300 "$bin" batch -m "$f0" --devices cuda:0,cuda:0 --parallel 16 \
      --raw -i "$jobs_file" -o "$logs/batch16.out.jsonl"
  fi
fi
if has_cmd bench && have_model Q4_K; then bench_splits Q4_K "$fk"; fi
if has_cmd bench --no-cuda-graphs; then  # what the decode graphs save
  for t in Q4_0 Q4_K; do
    have_model $t && run "bench-1stage-nographs-$t" 300 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg" --no-cuda-graphs
  done
fi
# LoRA adapters on a GPU stage (session 40): a random rank-16 F16 adapter on every layer matrix,
# against bench-1stage-Q4_0 above (the same -p and -n).
if has_cmd bench --lora && have_model Q4_0; then
  lora=$models/$shape-lora16.gguf
  run lora-synth 300 "$bin" synth --lora-of "$f0" --rank 16 --out "$lora"
  [[ -s $lora ]] && run bench-1stage-lora-Q4_0 300 "$bin" bench -m "$f0" --devices cuda:0 -p "$pp" -n "$tg" --lora "$lora"
fi

# The GEMV's shape on the real decode step: the default (split rows) against the forms a stage
# measures at load and picks per launch (BATON_GEMV_TUNE=1 among those that keep the products'
# bits, =2 among all; their logs have each op's times per form, the gemv-tuned row the picks) and
# against each form everywhere: one warp per row
# everywhere (BATON_GEMV_SPLIT=0: the short q/k/v, output and down projections otherwise split
# rows over 2-4 warps), two rows per warp (BATON_GEMV_ROWS=2) and the streamed grid (BATON_GEMV_STREAM=1),
# with and without its L2 prefetch before the wait (BATON_GEMV_PREFETCH_MIB=0); and the attention
# merged by a second kernel (BATON_ATTN_FUSED=0, session 18's default is one launch). And with BATON_GPU_BASE_BIN (another tree's baton, e.g. the
# one scripts/device-bundle.sh packs from BATON_BUNDLE_BASE=REV): the same decode with it and with
# this tree's, alternating (base, new, base, new), so a change is a ratio measured in one run.
if has_cmd bench; then
  for t in Q4_0 Q4_K; do
    have_model $t || continue
    run "bench-1stage-tuned-$t" 300 env BATON_GEMV_TUNE=1 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg" --verbose
    run "bench-1stage-tunedany-$t" 300 env BATON_GEMV_TUNE=2 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg" --verbose
    row "gemv-tuned-$t" ok 0 "same bits: $(tuned_note "$logs/bench-1stage-tuned-$t.log"); any: $(tuned_note "$logs/bench-1stage-tunedany-$t.log")"
    run "bench-1stage-nosplit-$t" 300 env BATON_GEMV_SPLIT=0 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg"
    run "bench-1stage-rows2-$t" 300 env BATON_GEMV_ROWS=2 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg"
    run "bench-1stage-stream-$t" 300 env BATON_GEMV_STREAM=1 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg"
    run "bench-1stage-streamnopf-$t" 300 env BATON_GEMV_STREAM=1 BATON_GEMV_PREFETCH_MIB=0 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg"
    run "bench-1stage-attn2-$t" 300 env BATON_ATTN_FUSED=0 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p 0 -n "$tg"
    row "gemv-forms-$t" ok 0 "$(gemv_forms_note "$t")"
  done
  # Decode deep in a context (every head's keys over many splits, merged by the last split or by the
  # combine kernel).
  if has_cmd bench --depth && have_model Q4_0; then
    f0=$models/$shape-Q4_0.gguf
    run "bench-depth-Q4_0" 300 "$bin" bench -m "$f0" --devices cuda:0 -p 0 -n "$tg" -d "$depth"
    run "bench-depth-attn2-Q4_0" 300 env BATON_ATTN_FUSED=0 "$bin" bench -m "$f0" --devices cuda:0 -p 0 -n "$tg" -d "$depth"
    a=$(tg_of "$logs/bench-depth-Q4_0.log") b=$(tg_of "$logs/bench-depth-attn2-Q4_0.log")
    [[ -n $a && -n $b ]] && row "attn-depth-Q4_0" ok 0 "$(awk -v a="$a" -v b="$b" -v d="$depth" \
      'BEGIN { printf "tg @ d%s: one launch %s t/s, combine kernel %s (x%.3f)", d, a, b, a / b }')"
  fi
  base_bin=${BATON_GPU_BASE_BIN:-}
  if [[ -n $base_bin && -x $base_bin ]]; then
    for t in Q4_0 Q4_K; do
      have_model $t || continue
      for round in 1 2; do
        run "bench-ab$round-base-$t" 300 "$base_bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p "$pp" -n "$tg"
        run "bench-ab$round-new-$t" 300 "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p "$pp" -n "$tg"
      done
    done
  fi
fi

# 7. The CUDA matmuls alone: GEMV GB/s per type and column count, the GEMV -> GEMM cut-over (what
# Context::gemv_max_cols should be) and the GEMM's fastest slab; then a 512-token prompt with that
# slab. With --sim one small type, for the rehearsal. BATON_GPU_KERNEL_TYPES: the types (default all).
if has_cmd bench-kernels --device; then
  if [[ $sim == 1 ]]; then kargs=(--types Q4_0 --rows 256 --cols 512 --gemv-mib 1 --reps 1)
  elif [[ -n ${BATON_GPU_KERNEL_TYPES:-} ]]; then read -ra kt <<<"$BATON_GPU_KERNEL_TYPES"; kargs=(--types "${kt[@]}")
  else kargs=(); fi
  run kernels 600 "$bin" bench-kernels --device cuda:0 "${kargs[@]}"
else
  skip kernels "no 'bench-kernels --device' yet"
fi
for t in Q4_0 Q4_K; do
  slab=$( [[ -s $logs/kernels.log ]] && best_slab "$logs/kernels.log" "$t")
  [[ $sim == 1 ]] && slab=1  # the rehearsal's matrices fit in any slab: rehearse the command anyway
  if [[ -n $slab ]] && has_cmd bench && have_model $t; then
    run "bench-1stage-slab$slab-$t" 300 env BATON_GEMM_SLAB_MIB="$slab" "$bin" bench -m "$models/$shape-$t.gguf" --devices cuda:0 -p "$pp" -n 0
  fi
done

# 8. Batches on one stage: the default sampling (top_k 40) takes the 256 best candidates from the
# device (kTopK), top_k 0 copies the full rows to the host (and sorts them there); and 16 sequences
# per decode step as dequantize + GEMM (BATON_GEMV_MAX_COLS=8) against the default's two GEMV
# passes in a graph (gemv_max_cols 16), on the real step.
if has_cmd batch && have_model Q4_0; then
  sed 's/"max_tokens": 64}/"max_tokens": 64, "top_k": 0}/' "$jobs_file" >"$logs/batch16-rows.jsonl"
  run batch16-1stage-topk 300 "$bin" batch -m "$f0" --devices cuda:0 --parallel 16 \
    --raw -i "$jobs_file" -o "$logs/batch16-topk.out.jsonl"
  run batch16-1stage-rows 300 "$bin" batch -m "$f0" --devices cuda:0 --parallel 16 \
    --raw -i "$logs/batch16-rows.jsonl" -o "$logs/batch16-rows.out.jsonl"
  run batch16-1stage-gemm 300 env BATON_GEMV_MAX_COLS=8 "$bin" batch -m "$f0" \
    --devices cuda:0 --parallel 16 --raw -i "$jobs_file" -o "$logs/batch16-gemm.out.jsonl"
else
  skip batch16 "no 'baton batch' or no model"
fi

# 9. A mixture of experts on one GPU (session 29: routing on the host, experts gathered per launch;
# session 31: steps of up to 16 tokens routed on the device and captured in graphs, the host's
# routing kept behind BATON_MOE_DEVICE=0; neither timed on a GPU before): 8 of Qwen3-30B-A3B's 48
# layers (Q4_0, 2.9 GiB), with --sim a small one.
if has_cmd bench && has_cmd synth --n-expert; then
  fm=$models/moe-Q4_0.gguf
  if [[ $sim == 1 ]]; then
    moe_shape=(--arch qwen3moe --n-embd 256 --n-layer 2 --n-head 4 --n-head-kv 2 --head-dim 64 --n-ff 512 --n-vocab 4096
               --n-expert 8 --n-expert-used 2 --n-ff-exp 128)
  else
    moe_shape=(--shape qwen3-30b-a3b --n-layer 8)
  fi
  if (($(limit_for 240) < 240)); then
    skip moe "too little time left (BATON_GPU_END)"
  elif [[ -s $fm ]] || run synth-moe 120 "$bin" synth "${moe_shape[@]}" --type Q4_0 --out "$fm"; then
    run bench-moe-1stage 120 "$bin" bench -m "$fm" --devices cuda:0 -p "$pp" -n "$tg"
    run bench-moe-hostroute 120 env BATON_MOE_DEVICE=0 "$bin" bench -m "$fm" --devices cuda:0 -p 0 -n "$tg"
  fi
else
  skip moe "no experts in 'baton synth' yet"
fi

# 9b. gpt-oss (session 30: sinks in every attention kernel, expert biases, the clamped SwiGLU, MXFP4
# experts; never run on a GPU): 4 of gpt-oss-20b's 24 layers, MXFP4 experts and Q8_0 elsewhere.
if has_cmd synth --sliding-window; then
  fo=$models/gpt-oss-MXFP4.gguf
  if [[ $sim == 1 ]]; then
    oss_shape=(--arch gpt-oss --n-embd 256 --n-layer 2 --n-head 4 --n-head-kv 2 --head-dim 64 --n-ff 256 --n-vocab 4096
               --n-expert 8 --n-expert-used 4 --n-ff-exp 256 --sliding-window 16)
  else
    oss_shape=(--shape gpt-oss-20b --n-layer 4)
  fi
  if (($(limit_for 180) < 180)); then
    skip gpt-oss "too little time left (BATON_GPU_END)"
  elif [[ -s $fo ]] || run synth-gpt-oss 90 "$bin" synth "${oss_shape[@]}" --type MXFP4 --out "$fo"; then
    run bench-gpt-oss 90 "$bin" bench -m "$fo" --devices cuda:0 -p "$pp" -n "$tg"
  fi
else
  skip gpt-oss "no gpt-oss in 'baton synth' yet"
fi

# compute-sanitizer (with the toolkit) on the kernel tests, when time is left: memcheck on all of
# test_cuda_ops, racecheck (shared-memory hazards) on the kernels that share memory across warps.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [[ $sim == 1 || ! -x $sanitizer || ! -x $build/tests/test_cuda_ops ]]; then
  skip sanitizer "no GPU, no compute-sanitizer or no test_cuda_ops"
elif (($(limit_for 240) < 240)); then
  skip sanitizer "too little time left (BATON_GPU_END)"
else
  run sanitizer-memcheck 240 "$sanitizer" --tool memcheck --error-exitcode 1 "$build/tests/test_cuda_ops"
  run sanitizer-racecheck 240 "$sanitizer" --tool racecheck --error-exitcode 1 "$build/tests/test_cuda_ops" \
    "norms and gates*,attention*,argmax*,rms_norm*"
fi

# Where a decode step's time goes, kernel by kernel (Nsight Compute, when the toolkit has it and
# time is left): three greedy tokens op by op (no graphs, so every kernel is its own launch; ncu runs
# them one at a time, so early launch and the L2 prefetch do not show), with the default GEMV and
# the streamed one; the log has ncu's per-kernel summary (count, mean duration).
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [[ $sim == 1 || ! -x $ncu ]] || ! have_model Q4_0; then
  skip ncu-decode "no GPU, no ncu or no model"
elif (($(limit_for 200) < 200)); then
  skip ncu-decode "too little time left (BATON_GPU_END)"
else
  ncu_args=(--clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel)
  run_args=(run -m "$f0" -p Hello -n 3 --temp 0 --raw --no-cuda-graphs --devices cuda:0)
  run ncu-decode-default 100 "$ncu" "${ncu_args[@]}" "$bin" "${run_args[@]}"
  run ncu-decode-stream 100 env BATON_GEMV_STREAM=1 "$ncu" "${ncu_args[@]}" "$bin" "${run_args[@]}"
fi

# 7. GPU ranks of the distributed pipeline (issue 10), when this machine has mpirun: two ranks on
# cuda:0 through host memory (BATON_NCCL=0) must print the 1-stage text; with NCCL on, two ranks on
# one GPU cannot form a pair (NCCL refuses a duplicate device), and the job must end with an error
# naming NCCL within the time limit, not hang.
mpi_run=(mpirun --oversubscribe --bind-to none -np 2)
[[ $(id -u) == 0 ]] && mpi_run+=(--allow-run-as-root)
if (($(limit_for 400) < 400)); then
  skip distributed-gpu "too little time left (BATON_GPU_END)"
elif command -v mpirun >/dev/null && has_cmd run --distributed && [[ -n $tiny_model ]] \
   && ! "$bin" run --distributed -m "$tiny_model" -p x 2>&1 | grep -q "built without MPI"; then
  t0=$SECONDS
  args=(run -m "$tiny_model" --raw -p "Once upon a time" -n 32 --temp 0 --devices cuda:0)
  ref=$(timeout 120 "$bin" "${args[@]}" 2>"$logs/distributed-gpu.log")
  out=$(BATON_NCCL=0 timeout 180 "${mpi_run[@]}" "$bin" "${args[@]}" --distributed --verbose 2>>"$logs/distributed-gpu.log")
  if [[ -n $ref && $out == "$ref" ]]; then row distributed-gpu ok $((SECONDS - t0)) "2 GPU ranks, host memory: same text"
  else row distributed-gpu FAIL $((SECONDS - t0)) "texts differ or a run failed"; failed=1; fi
  t0=$SECONDS
  out=$(timeout 180 "${mpi_run[@]}" "$bin" "${args[@]}" --distributed --verbose 2>"$logs/distributed-nccl-1gpu.log")
  rc=$?
  if [[ $rc != 0 && $rc != 124 ]] && grep -qi nccl "$logs/distributed-nccl-1gpu.log"; then
    row distributed-nccl-1gpu ok $((SECONDS - t0)) "refused with an NCCL error (expected on one GPU)"
  elif [[ $rc == 0 && $out == "$ref" ]]; then row distributed-nccl-1gpu ok $((SECONDS - t0)) "NCCL on one GPU ran: same text"
  else row distributed-nccl-1gpu FAIL $((SECONDS - t0)) "exit $rc (124: hung), see log"; failed=1; fi
else
  skip distributed-gpu "no mpirun, no MPI in this build, or no peer tiny model"
fi

# A model still being written when time ran out: stop it.
jobs -p | xargs -r kill 2>/dev/null
pkill -f "$bin synth" 2>/dev/null

# Short table last.
{
  echo
  printf '%-28s %-8s %6s  %s\n' step status secs note
  for r in "${rows[@]}"; do
    IFS='|' read -r a b c d <<<"$r"
    printf '%-28s %-8s %6s  %s\n' "$a" "$b" "$c" "$d"
  done
} | tee -a "$logs/summary.txt"
exit $failed
