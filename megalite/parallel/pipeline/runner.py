"""How this rank runs its micro batches: the schedule, its pipeline stage and the p2p channel.

Built once from the config and the topology, and handed to the training and evaluation steps.
The channel's message shape is the residual stream between two chunks: this rank's part of the
sequence under context parallelism, which sequence parallelism shards further over the
tensor-parallel group; both ends derive it from the config, so no handshake is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megalite.config import TORCH_DTYPES, Config
from megalite.parallel.p2p import PipelineComm
from megalite.parallel.pipeline.executor import ScheduleObserver
from megalite.parallel.pipeline.overlap import SEQUENTIAL, PairRunner, pair_runner
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.parallel.pipeline.spec import ScheduleSpec
from megalite.parallel.pipeline.stage import PipelineStage
from megalite.parallel.topology import Topology


@dataclass
class Pipeline:
    """The schedule's spec, this rank's stage, the p2p channel (pp > 1), what runs paired operations (overlap.py:
    interleaved where experts exchange tokens over ep > 1 ranks) and whoever watches the training steps (the
    pipeline trace, measurements: executor.py's ScheduleObserver)."""

    spec: ScheduleSpec
    stage: PipelineStage
    comm: PipelineComm | None = None
    pairs: PairRunner = SEQUENTIAL
    observers: list[ScheduleObserver] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: Config, topology: Topology) -> Pipeline:
        spec = schedule_spec(cfg.parallel.pipeline_schedule)
        stage = spec.stage(topology.pp, cfg.parallel.vp, topology.pp_rank)
        if topology.pp == 1:
            return cls(spec, stage)
        m = cfg.model
        seq = m.seq_length // topology.cp  # this rank's part of the sequence (context parallelism)
        seq = seq // topology.tp if cfg.parallel.sequence_parallel_active else seq
        dtype = TORCH_DTYPES[cfg.train.param_dtype]  # the residual stream's dtype
        comm = PipelineComm(topology, (seq, cfg.train.micro_batch_size, m.hidden_size), dtype)
        return cls(spec, stage, comm, pair_runner(topology.device, topology.ep > 1))
