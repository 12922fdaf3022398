"""What data-parallel ranks shard, one strategy class per ZeRO stage over one bucket layout (stages.py:
0-2, stage3.py: 3 and its gather units)."""

from megalite.parallel.zero.stage3 import GatherUnits, ShardedParameters, unit_index
from megalite.parallel.zero.stages import AllReduce, ReduceScatter, ShardedGradients

STAGES = {0: AllReduce, 1: ReduceScatter, 2: ShardedGradients, 3: ShardedParameters}

__all__ = ["STAGES", "AllReduce", "GatherUnits", "ReduceScatter", "ShardedGradients", "ShardedParameters",
           "unit_index"]
