#!/usr/bin/env bash
# The whole test suite, in the project's .venv (created and filled on first use).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" dev
bash scripts/get_assets.sh  # setup_env.sh left us in the repo root
ruff check --output-format=concise .  # pyproject.toml [tool.ruff]: lines <= 120, no unused imports or names
export OMP_NUM_THREADS=1 WANDB_SILENT=true
python -m pytest -q tests "$@"
