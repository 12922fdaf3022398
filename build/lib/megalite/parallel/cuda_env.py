"""What CUDA reads from the environment when it starts, decided from the parallel layout before it does.

CUDA_DEVICE_MAX_CONNECTIONS is how many hardware queues the GPU takes work from (8 by default). With one,
kernels of every stream start in the order the host queued them; with several, the GPU may start a matmul
queued after a collective first and leave the collective waiting for it. gemm.py's sequence-parallel
backward queues the all-gather of the input before the input-gradient matmul and the reduce-scatter of
the input gradient before the weight-gradient matmul, so that each collective runs beside a matmul (and
ring attention queues each hop before the block it overlaps); that holds only with one connection, which
is why Megatron-LM requires CUDA_DEVICE_MAX_CONNECTIONS=1 for tp or cp > 1. ZeRO-3 (Megatron-FSDP's
optim_grads_params) needs the opposite: its parameter gathers run ahead of the layers on streams of their
own and overlap them only with more than one connection, so the variable is left alone there, as
Megatron-LM does under FSDP.

CUDA reads the variable once, when it starts; Topology.from_environment applies the decision before its
first CUDA call. A value the user set is never overridden; the log line (on a GPU run) says when it is
kept against the layout's need, or set. (Blackwell GPUs no longer need one connection, Megatron-LM notes;
the architecture is unknown before CUDA starts, so it is set there too.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from megalite.config import ParallelConfig

MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def max_connections(parallel: ParallelConfig, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the value CUDA_DEVICE_MAX_CONNECTIONS should be given, or None to leave it as it is; a line to log,
    or None) for `parallel` in `environ`."""
    if parallel.tp == 1 and parallel.cp == 1:
        return None, None
    layout, user = f"parallel.tp={parallel.tp}, parallel.cp={parallel.cp}", environ.get(MAX_CONNECTIONS)
    if parallel.zero == 3:
        if user == "1":
            return None, (f"{MAX_CONNECTIONS}=1 kept as set: parallel.zero_stage=3 overlaps its parameter gathers "
                          "with the layers only with more than one connection (unset it to let them overlap)")
        return None, None
    if user is None:
        return "1", (f"{MAX_CONNECTIONS}=1 set for {layout}: the GPU starts each tensor- or context-parallel "
                     "collective before the computation queued after it, which it overlaps (as Megatron-LM requires)")
    if user != "1":
        return None, (f"{MAX_CONNECTIONS}={user} kept as set; with {layout} the GPU may start a tensor- or "
                      "context-parallel collective after the computation it should overlap (Megatron-LM requires 1)")
    return None, None


def prepare_cuda_environment(parallel: ParallelConfig, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Apply `max_connections` to `environ` before CUDA starts; returns its line on the first rank (the one
    that logs it, once the device is known to be a GPU), None on the others."""
    value, line = max_connections(parallel, environ)
    if value is not None:
        environ[MAX_CONNECTIONS] = value
    return line if environ.get("RANK", "0") == "0" else None
