"""How this rank runs its micro batches: the schedule, its pipeline stage and the p2p channel.

Built once from the config and the topology, and handed to the training and evaluation steps.
The channel's message shape is the residual stream between two chunks: this rank's part of the
sequence under context parallelism, which sequence parallelism shards further over the
tensor-parallel group; both ends derive it from
the config, so no handshake is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import TORCH_DTYPES, Config
from megalite.parallel.p2p import PipelineComm
from megalite.parallel.pipeline_layout import PipelineStage, placement_of
from megalite.parallel.schedules import Trace
from megalite.parallel.topology import Topology


@dataclass
class Pipeline:
    """The schedule's name, this rank's stage, the p2p channel (pp > 1) and an optional trace."""

    schedule: str
    stage: PipelineStage
    comm: PipelineComm | None = None
    trace: Trace | None = None

    @classmethod
    def build(cls, cfg: Config, topology: Topology) -> Pipeline:
        stage = PipelineStage(topology.pp, cfg.parallel.vp, topology.pp_rank,
                              placement=placement_of(cfg.parallel.pipeline_schedule))
        if topology.pp == 1:
            return cls(cfg.parallel.pipeline_schedule, stage)
        m = cfg.model
        seq = m.seq_length // topology.cp  # this rank's part of the sequence (context parallelism)
        seq = seq // topology.tp if cfg.parallel.sequence_parallel_active else seq
        dtype = TORCH_DTYPES[cfg.train.param_dtype]  # the residual stream's dtype
        comm = PipelineComm(topology, (seq, cfg.train.micro_batch_size, m.hidden_size), dtype)
        return cls(cfg.parallel.pipeline_schedule, stage, comm)
