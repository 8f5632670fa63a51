#!/usr/bin/env bash
# Brings what a build of Baton needs beyond the CUDA Toolkit, CMake and a C++ compiler, for a GPU
# machine that has nothing else and cannot install (the lent H200s): downloads the Debian packages
# of fmt, CLI11, nlohmann-json, Catch2 2 and libedit (with the libraries libedit loads) and
# extracts them into DIR (default .dev/deps, ignored by git; about 8 MB). Carry DIR with the tree,
# then build there with scripts/gpu-check.sh and BATON_GPU_DEPS=DIR (scripts/device-check.sh
# --build does), which points CMake's package search and the loader at it.
# Usage: scripts/gpu-deps.sh [DIR]   (needs apt-get and dpkg-deb, as on Debian/Ubuntu)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.dev/deps}
pkgs=(libfmt-dev libfmt9 libcli11-dev nlohmann-json3-dev catch2 libedit-dev libedit2 libbsd0 libmd0 libtinfo6)
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.dev/' >>.git/info/exclude; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 777 "$tmp"  # apt's download user must be able to write there
(cd "$tmp" && apt-get download "${pkgs[@]}" >/dev/null)
rm -rf "$dir"
mkdir -p "$dir"
for d in "$tmp"/*.deb; do dpkg-deb -x "$d" "$dir"; done
ls "$tmp" | sed 's/^/  /'
du -sh "$dir"
