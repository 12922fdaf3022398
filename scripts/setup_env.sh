#!/usr/bin/env bash
# Create .venv and install megalite with its dev extras; sourced by quickstart.sh and test.sh.
# torch is pinned to 2.13.0 only when missing: on a CPU-only machine that is the local CPU
# wheel, and an unpinned install would pull gigabytes of CUDA packages. Re-installs only
# when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.megalite-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
install() {  # quiet on success, the whole log on failure
  python -m pip install "$@" > .venv/install.log 2>&1 || { cat .venv/install.log; echo "pip install $* failed" >&2; exit 1; }
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing megalite into .venv (log: .venv/install.log)"
  install --upgrade pip
  python -c "import torch" 2>/dev/null || install "torch==2.13.0"
  install -e ".[dev]"
  echo "$want" > "$stamp"
fi
