#!/usr/bin/env bash
# Prepares a GPU check on a machine that cannot build Baton (no fmt, CLI11, Catch2 or libedit there,
# nothing installable), such as a lent GPU machine with only the CUDA Toolkit: builds the binaries
# the check needs here (CUDA, sm_90, no MPI or NCCL) in build-dev, and packs them with the shared
# libraries the target may lack and the peer data into .dev/ (ignored by git):
#   .dev/bundle.tar.xz     build-dev/{baton,tests/test_cuda_*,tests/test_peer_logits,CTest files}, .dev/lib/*
#   .dev/shared/peer/logits the peer tiny model and llama.cpp's logits (tests and same-token runs)
#   .dev/source-dir        the source path the test binaries were built with
#   .dev/baton-base.xz     with BATON_BUNDLE_BASE=REV: REV's baton (built in a worktree, build-dev-base),
#                          for the check's decode A/B against this tree (BATON_GPU_BASE_BIN)
# Then, on the GPU machine, in a copy of this tree that has .dev/: scripts/device-check.sh.
#   BATON_GPU_ARCH  CUDA architecture (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${BATON_GPU_ARCH:-90}
build=build-dev
targets=(baton test_cuda_ops test_cuda_stage test_cuda_layout test_cuda_quant_host test_peer_logits)

grep -qx '/.dev/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.dev/' >>.git/info/exclude; }
cmake -S . -B "$build" -DBATON_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_BUILD_TYPE=Release \
  -DBATON_MPI=OFF -DBATON_NCCL=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

rm -rf .dev/lib .dev/shared
mkdir -p .dev/lib .dev/shared/peer
# Shared libraries beyond glibc, libstdc++ and CUDA's cuBLAS (which the target's toolkit has).
ldd "$build/baton" | awk '$3 ~ /^\// { print $3 }' | while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libgcc_s*|libstdc++*|libpthread*|libdl.so*|librt.so*|ld-linux*|libcublas*) ;;
    *) cp -L "$lib" .dev/lib/ ;;
  esac
done
cp -r ../shared/peer/logits .dev/shared/peer/
pwd >.dev/source-dir
files=("$build/baton" "$build/CTestTestfile.cmake" "$build/tests/CTestTestfile.cmake")
for t in "${targets[@]:1}"; do files+=("$build/tests/$t"); done
# One xz stream with a large window: the test binaries share most of their bytes (the kernels).
tar -cf - "${files[@]}" .dev/lib | xz -T0 -9 --lzma2=dict=192MiB >.dev/bundle.tar.xz
ls -l .dev/lib
rm -f .dev/baton-base.xz
if [[ -n ${BATON_BUNDLE_BASE:-} ]]; then
  # A worktree of the base commit, kept (with its build) for the next bundle of the same base.
  base_src=$(pwd)/build-dev-base/src
  base_rev=$(git rev-parse "$BATON_BUNDLE_BASE^{commit}")
  if [[ $(git -C "$base_src" rev-parse HEAD 2>/dev/null) != "$base_rev" ]]; then
    rm -rf build-dev-base
    git worktree prune
    git worktree add --detach "$base_src" "$base_rev" >/dev/null
  fi
  cmake -S "$base_src" -B build-dev-base/build -DBATON_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DCMAKE_BUILD_TYPE=Release -DBATON_MPI=OFF -DBATON_NCCL=OFF >/dev/null
  cmake --build build-dev-base/build -j "$(nproc)" --target baton
  xz -T0 -9 <build-dev-base/build/baton >.dev/baton-base.xz
  echo "base: $(git rev-parse --short "$base_rev") -> .dev/baton-base.xz"
fi
du -sh .dev/bundle.tar.xz .dev/shared
