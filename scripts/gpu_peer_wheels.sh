#!/usr/bin/env bash
# Download the wheels of tools/gpu_check.py's peers step (Megatron-Core, torchtitan and what they need that the GPU
# machine's image lacks; the list is tools/peers/wheels.txt) for CPython 3.12 on x86-64 Linux, into an ignored
# folder that travels with the tree to the GPU machine (name it in `carry`). Nothing here is committed.
#   bash scripts/gpu_peer_wheels.sh [DEST]     # DEST defaults to peer_wheels/ in the repository root
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$root/peer_wheels}"
python="${PYTHON:-python3}"
mkdir -p "$dest"

download() {
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$1"
}

while IFS= read -r line; do
  line="${line%%#*}"; line="${line// /}"
  [[ -z "$line" ]] && continue
  IFS='|' read -r -a choices <<< "$line"
  for choice in "${choices[@]}"; do
    if download "$choice"; then echo "got $choice"; continue 2; fi
    echo "could not download $choice" >&2
  done
  echo "error: none of ${choices[*]} could be downloaded (is a package registry reachable?)" >&2
  exit 1
done < "$root/tools/peers/wheels.txt"

du -sh "$dest"
echo "carry: ${dest#"$root"/}"
