# shellcheck shell=bash
# Helpers shared by train_single_node.sh and train_multi_node.sh (sourced, not run).
# Why a shared file: both scripts pick the same Python and count GPUs the same way, and a cluster
# user reading one should find the same behaviour in the other.

# The repository root, whatever the caller's working directory (config paths stay relative to it).
MEGALITE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The interpreter: $PYTHON if set, else the project's .venv when it exists, else python3 from PATH
# (a cluster's module system or conda environment).
megalite_python() {
  if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
  elif [ -x "$MEGALITE_ROOT/.venv/bin/python" ]; then
    echo "$MEGALITE_ROOT/.venv/bin/python"
  else
    echo python3
  fi
}

# torchrun through megalite's launcher (python -m megalite.launch, same arguments): after a SIGTERM or Ctrl-C
# it exits 0 when the ranks saved a checkpoint, instead of torchrun's 1 with a traceback. SHUTDOWN_TIMEOUT
# (default 180) is how long torchrun lets the ranks finish their step, save and exit before it SIGKILLs them.
megalite_torchrun() {
  PYTHONPATH="$MEGALITE_ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$(megalite_python)" -m megalite.launch \
    --shutdown-timeout="${SHUTDOWN_TIMEOUT:-180}" "$@"
}

# Processes for this node: the visible GPUs (one process each), or $1 CPU processes when there is none.
megalite_local_procs() {
  local gpus
  gpus="$("$(megalite_python)" -c 'import torch; print(torch.cuda.device_count())')"
  if [ "$gpus" -gt 0 ]; then echo "$gpus"; else echo "$1"; fi
}

# Exit with usage unless the first argument is a readable config file.
megalite_check_config() {
  local usage="$1" config="${2:-}"
  if [ -z "$config" ] || [ "${config#-}" != "$config" ]; then
    echo "usage: $usage" >&2
    exit 2
  fi
  if [ ! -f "$config" ]; then
    echo "error: config file '$config' not found (relative paths are taken from $(pwd))" >&2
    exit 2
  fi
}
