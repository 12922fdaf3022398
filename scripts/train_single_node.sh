#!/usr/bin/env bash
# Train on one machine: one process per visible GPU (NCCL), or CPU processes (gloo) when there is none.
#
#   bash scripts/train_single_node.sh CONFIG.yaml [--section.field=value ...]
#
# Extra arguments go to pretrain_gpt.py (they override the config). Environment:
#   NPROC   processes to start (default: the number of visible GPUs, or 2 on a machine without one)
#   SHUTDOWN_TIMEOUT  seconds the ranks get to save and exit after a SIGTERM or Ctrl-C (default 180)
#   PYTHON  interpreter (default: .venv/bin/python when present, else python3)
# On CPUs torchrun gives each process OMP_NUM_THREADS=1 unless you set it (cores / NPROC is a good value).
set -euo pipefail
# shellcheck source=scripts/lib_launch.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib_launch.sh"
megalite_check_config "bash scripts/train_single_node.sh CONFIG.yaml [--section.field=value ...]" "${1:-}"
config="$1"
shift
nproc="${NPROC:-$(megalite_local_procs 2)}"
echo "megalite: $nproc processes on $(hostname), config $config" >&2
megalite_torchrun --standalone --nproc-per-node="$nproc" "$MEGALITE_ROOT/pretrain_gpt.py" --config "$config" "$@"
