#!/usr/bin/env bash
# Regenerate tests/data/quant/*.ggml.q.{f32,bin}: ggml's own reference quantizers applied to fixed
# pseudo-random rows, for the k-quant types the PyPI `gguf` package cannot quantize. Not needed to
# build or test (the outputs are committed); ggml is used here only as an outside oracle.
#
#   git clone https://github.com/ggml-org/ggml /tmp/ggml   # or a llama.cpp checkout's ggml/
#   tests/gen_ggml_quant_fixtures.sh /tmp/ggml
#
# Compiled with assertions on and without FMA contraction, like Baton's reference code.
set -euo pipefail
ggml=${1:?usage: $0 GGML_SOURCE_DIR}
here=$(cd "$(dirname "$0")" && pwd)
out="$here/data/quant"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cc=${CC:-cc}
$cc -O2 -std=c11 -ffp-contract=off -I"$ggml/include" -I"$ggml/src" -c "$ggml/src/ggml-quants.c" -o "$work/ggml-quants.o"
$cc -O2 -std=c11 -ffp-contract=off -Wall -Wextra -c "$here/gen_ggml_quant_fixtures.c" -o "$work/gen.o"
$cc "$work/gen.o" "$work/ggml-quants.o" -lm -o "$work/gen"
mkdir -p "$out"
"$work/gen" "$out"

rev=$(git -C "$ggml" rev-parse HEAD 2>/dev/null || echo unknown)
grep -v '^ggml-quants.c ' "$out/MANIFEST.txt" > "$work/manifest" 2>/dev/null || true
echo "ggml-quants.c $rev: *.ggml.q.* via tests/gen_ggml_quant_fixtures.sh" >> "$work/manifest"
cp "$work/manifest" "$out/MANIFEST.txt"
echo "wrote $(ls "$out"/*.ggml.q.* | wc -l) files to $out"
