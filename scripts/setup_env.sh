#!/usr/bin/env bash
# Create .venv and install megalite with the extras (pyproject.toml) named as arguments; sourced:
#   . scripts/setup_env.sh plot   quickstart.sh: what training needs, and matplotlib for tools/plot_metrics.py
#   . scripts/setup_env.sh dev    test.sh, stress_tests.sh: pytest, ruff and megatron-core too
# torch is pinned to 2.13.0 only when missing: on a CPU-only machine that is the local CPU
# wheel, and an unpinned install would pull gigabytes of CUDA packages. Installs only when
# pyproject.toml changed or an extra is asked for the first time; extras installed before are
# kept (the stamp lists them), so the quickstart after the tests installs nothing.
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
installed_for="" installed=""
if [ -f "$stamp" ]; then
  read -r installed_for installed < "$stamp" || true  # "<pyproject hash> <extra> <extra> ..."
fi
missing=""
for extra in "$@"; do
  case " $installed " in *" $extra "*) ;; *) missing="$missing $extra" ;; esac
done
if [ "$installed_for" != "$want" ] || [ -n "$missing" ]; then
  extras="$(echo $installed $missing | tr ' ' '\n' | sort -u | tr '\n' ' ')"
  extras="${extras% }"
  spec="."
  [ -z "$extras" ] || spec=".[${extras// /,}]"
  install() {  # quiet on success, the whole log on failure
    python -m pip install "$@" > .venv/install.log 2>&1 || { cat .venv/install.log; echo "pip install $* failed" >&2; exit 1; }
  }
  echo "installing megalite${extras:+ with $extras} into .venv (log: .venv/install.log; a few minutes the first time)"
  install --upgrade pip
  python -c "import torch" 2>/dev/null || install "torch==2.13.0"
  install -e "$spec"
  echo "$want $extras" > "$stamp"
fi
