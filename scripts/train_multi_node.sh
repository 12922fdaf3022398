#!/usr/bin/env bash
# Train on several machines: run this once on every node (by hand, pdsh, or srun; see slurm/).
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/train_multi_node.sh CONFIG.yaml [--section.field=value ...]
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/train_multi_node.sh CONFIG.yaml [--section.field=value ...]
#
# Extra arguments go to pretrain_gpt.py. Environment:
#   NNODES          number of nodes (required)
#   MASTER_ADDR     address of node 0, reachable from every node (required)
#   MASTER_PORT     a free TCP port on MASTER_ADDR (default 29500)
#   NODE_RANK       this node's index 0..NNODES-1: fixed rank order, node k holds ranks k*N..k*N+N-1
#   RDZV_ID         instead of NODE_RANK: a job id shared by all nodes; torchrun's c10d rendezvous
#                   then admits the nodes in any order and can restart them (MAX_RESTARTS)
#   NPROC_PER_NODE  processes per node (default: the visible GPUs, or 2 without GPUs)
#   MAX_RESTARTS    times torchrun restarts the workers after a failure (default 0); a restarted run
#                   resumes from its latest checkpoint when checkpoint.save is set
#   SHUTDOWN_TIMEOUT seconds the ranks get to save and exit after a SIGTERM or Ctrl-C (default 180)
#   PYTHON          interpreter (default: .venv/bin/python when present, else python3)
# Megalite orders ranks tensor-parallel first, so tp groups stay inside a node: keep tp <= NPROC_PER_NODE.
set -euo pipefail
# shellcheck source=scripts/lib_launch.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib_launch.sh"
megalite_check_config "NNODES=N MASTER_ADDR=HOST (NODE_RANK=K | RDZV_ID=ID) bash scripts/train_multi_node.sh CONFIG.yaml [--section.field=value ...]" "${1:-}"
config="$1"
shift
: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (reachable from every node)}"
port="${MASTER_PORT:-29500}"
if [ -n "${RDZV_ID:-}" ]; then
  rendezvous=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$port" --rdzv-id="$RDZV_ID")
  where="rendezvous $RDZV_ID at $MASTER_ADDR:$port"
elif [ -n "${NODE_RANK:-}" ]; then
  rendezvous=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$port")
  where="node $NODE_RANK, master $MASTER_ADDR:$port"
else
  echo "error: set NODE_RANK (this node's index, 0..$((NNODES - 1))) or RDZV_ID (a job id shared by all nodes)" >&2
  exit 2
fi
nproc="${NPROC_PER_NODE:-$(megalite_local_procs 2)}"
echo "megalite: $nproc processes on $(hostname) of $NNODES nodes ($where), config $config" >&2
megalite_torchrun --nnodes="$NNODES" --nproc-per-node="$nproc" "${rendezvous[@]}" \
  --max-restarts="${MAX_RESTARTS:-0}" "$MEGALITE_ROOT/pretrain_gpt.py" --config "$config" "$@"
