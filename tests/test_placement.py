"""Where each parameter lives (parallel/placement.py), checked for every parameter of every family at
tensor-, sequence-, pipeline- and context-parallel layouts without a process group (the ranks' contexts
are built by hand), and the checkpoint pieces it describes, split along several axes at once.

- Every rank's parameter is its placement's slice of the one-device initial value, and the slices of all
  tensor-parallel ranks put together are the one-device tensor.
- Each element is counted once over all ranks (the gradient norm, checkpoint writes), with and without the
  distributed optimizer; a tied copy never.
- Under sequence parallelism exactly the tensor-parallel-replicated parameters are partial over tp; the per-head
  q/k norm weights (qwen3) are at any tp > 1, every rank's heads adding to them. Latent attention's down-projections
  and their norms are tensor-parallel-replicated (whole on every rank), its up-projections split by heads.
- A tensor split along two axes at one layout is read back at another (and whole) exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_config

from megalite.checkpoint.files import finalize, write_rank_files
from megalite.checkpoint.reader import CheckpointReader, Target
from megalite.checkpoint.sharded_state import Piece
from megalite.model.gpt import GPTModel
from megalite.parallel.context import AxisView, ParallelContext
from megalite.parallel.pipeline.registry import stage_layout
from megalite.parallel.placement import DATA_AXES, Placement, ShardSpec, unshard

LAYOUTS = [{"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2}, {"tp": 2, "pp": 2}, {"cp": 2},
           {"tp": 2, "cp": 2, "sequence_parallel": True}]
DENSE = ("tp", "cp", "dp", "pp")
# Multi-head latent attention with query compression, as a llama (model.multi_latent_attention)
LATENT = {"multi_latent_attention": True, "num_query_groups": None, "q_lora_rank": 12, "kv_lora_rank": 16,
          "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6}


def _config(family: str, **sections):
    """tiny_config of `family`, or ("latent attention") of a llama with LATENT; four layers."""
    latent = family == "latent attention"
    model = {"num_layers": 4, **(LATENT if latent else {})}
    return tiny_config("llama" if latent else family, model=model, **sections)


def _models(family: str, parallel: dict) -> dict[tuple[int, int], GPTModel]:
    """(tp rank, pp rank) -> that rank's model, initialised (cp ranks hold the same model)."""
    cfg = _config(family, parallel=parallel)
    tp, pp, sp = parallel.get("tp", 1), parallel.get("pp", 1), parallel.get("sequence_parallel", False)
    return {(t, s): GPTModel(cfg.model, torch.device("cpu"), ParallelContext(AxisView(None, t, tp),
                                                                             sequence_parallel=sp and tp > 1),
                             stage_layout(cfg, s), seed=cfg.train.seed)
            for t in range(tp) for s in range(pp)}


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "latent attention"])
@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_every_parameter_is_its_placements_slice_of_the_one_device_model(family, parallel):
    whole = GPTModel(_config(family).model, torch.device("cpu"), seed=1234)
    full = dict(whole.named_parameters())
    models = _models(family, parallel)
    tp = parallel.get("tp", 1)
    sp = parallel.get("sequence_parallel", False) and tp > 1
    seen = set()
    for (tp_rank, _), model in models.items():
        placements, copies = model.placements_by_name(), model.tied_copies()
        for name, param in model.named_parameters():
            placement, original = placements[name], copies.get(name, name)
            assert placement.copy == (name in copies)
            coord = {"tp": (tp_rank, tp)}.get
            assert torch.equal(param.detach(), placement.local(full[original].detach(),
                                                               lambda a, coord=coord: coord(a, (0, 1))))
            if family == "latent attention" and tp > 1 and ".attention." in name:  # down: whole; up: by heads
                replicated = name.endswith(("down_proj.weight", "layernorm.weight"))
                assert dict(placement.shards).get("tp") == (None if replicated else ShardSpec(
                    1 if name.endswith("linear_proj.weight") else 0)), name
            qk_norm = name.endswith(("q_norm.weight", "k_norm.weight")) and tp > 1
            assert placement.partial == (("tp",) if (sp or qk_norm) and not placement.shards else ())
            seen.add(original)
    assert seen == set(full)  # every one-device parameter lives somewhere
    for name in full:  # the tensor-parallel slices together are the whole tensor
        holders = [m for m in models.values() if name in dict(m.named_parameters())]
        for s in {key[1] for key, m in models.items() if m in holders}:
            parts = [dict(models[(t, s)].named_parameters())[name].detach() for t in range(tp)]
            spec = dict(holders[0].placements_by_name()[name].shards).get("tp")
            assert torch.equal(unshard(parts, spec) if spec else parts[0], full[name].detach()), name


@pytest.mark.parametrize("family", ["gpt2", "qwen3", "latent attention"])
@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.parametrize("sharded_data", [False, True])
def test_each_element_is_counted_once_over_all_ranks(family, parallel, sharded_data):
    """Over every rank of the dense grid (tp x cp x dp x pp, dp 2): the elements counted sum to the one-device
    model's, tied copies excluded. Under the distributed optimizer each data-parallel rank counts only the
    elements it owns, which here is modelled as 1/dp of each counted parameter."""
    sizes = {"tp": parallel.get("tp", 1), "cp": parallel.get("cp", 1), "dp": 2, "pp": parallel.get("pp", 1)}
    models = _models(family, parallel)
    total = 0.0
    for coords in itertools.product(*(range(sizes[a]) for a in DENSE)):
        at = dict(zip(DENSE, coords))
        model = models[(at["tp"], at["pp"])]
        placements = model.placements_by_name()
        for name, param in model.named_parameters():
            counted = placements[name].counted(DENSE, sharded_data, lambda a, at=at: (at[a], sizes[a]))
            share = 1 / (sizes["dp"] * sizes["cp"]) if sharded_data else 1
            total += counted * param.numel() * share
    one = sum(p.numel() for p in GPTModel(_config(family).model, torch.device("meta"), seed=0).parameters())
    assert total == pytest.approx(one)


def test_placement_axes_and_replication():
    expert = Placement((("ep", ShardSpec(0)), ("etp", ShardSpec(1))), grid="expert")
    assert expert.replicated(("etp", "ep", "edp", "pp"), sharded_data=False) == ("edp",)
    assert expert.replicated(("etp", "ep", "edp", "pp"), sharded_data=True) == ()
    assert Placement().replicated(DENSE, False) == ("tp", "cp", "dp")
    assert DATA_AXES == {"dense": ("cp", "dp"), "expert": ("edp",)}
    coord = {"ep": (1, 2), "etp": (0, 2)}.get
    full = torch.arange(4 * 6 * 3.0).view(4, 6, 3)
    assert torch.equal(expert.local(full, coord), full[2:4, 0:3])
    assert expert.global_shape([2, 3, 3], coord) == [4, 6, 3]
    assert expert.pieces(coord) == [[0, 1, 1, 2], [1, 1, 0, 2]]


def _save(root, placement: Placement, full: torch.Tensor, sizes: dict[str, int], chunks: int):
    """Every rank's shard of `full` as `chunks` flat pieces (as distributed-optimizer ranges are), published as
    root/iter_0000001."""
    path = root / "iter_0000001.tmp"
    path.mkdir(parents=True)
    for rank, at in enumerate(itertools.product(*(range(n) for n in sizes.values()))):
        coord = dict(zip(sizes, ((i, n) for i, n in zip(at, sizes.values())))).get
        local = placement.local(full, coord).reshape(-1)
        step = -(-local.numel() // chunks)
        pieces = [(Piece("w", "model", list(full.shape), placement.pieces(coord) or None, lo, min(lo + step,
                                                                                               local.numel())),
                   local[lo:lo + step]) for lo in range(0, local.numel(), step)]
        write_rank_files(path, rank, pieces, None)
    finalize(path, root / "iter_0000001")
    return root / "iter_0000001"


@pytest.mark.parametrize("saved_sizes, read_sizes", [
    ({"ep": 2, "etp": 2}, {"ep": 4, "etp": 1}),
    ({"ep": 4, "etp": 1}, {"ep": 1, "etp": 2}),
    ({"ep": 2, "etp": 2}, {"ep": 2, "etp": 2}),
    ({"ep": 1, "etp": 1}, {"ep": 2, "etp": 3}),
])
def test_pieces_split_along_two_axes_are_read_back_at_any_split(tmp_path, saved_sizes, read_sizes):
    """An expert-like weight [experts, out, in] split over ep (dim 0) and etp (dim 1), saved in flat pieces at
    one split and read at another: each reader's shard and flat range, and the whole tensor, come back exact."""
    placement = Placement((("ep", ShardSpec(0)), ("etp", ShardSpec(1))), grid="expert")
    full = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
    reader = CheckpointReader(_save(tmp_path, placement, full, saved_sizes, chunks=3))
    assert torch.equal(reader.read("w", "model"), full)
    for at in itertools.product(*(range(n) for n in read_sizes.values())):
        coord = dict(zip(read_sizes, ((i, n) for i, n in zip(at, read_sizes.values())))).get
        local = placement.local(full, coord).reshape(-1)
        shards = tuple(tuple(split) for split in placement.pieces(coord))
        for lo, hi in ((0, local.numel()), (3, local.numel() - 2), (local.numel() // 2, local.numel() // 2 + 1)):
            got = reader.read_part("w", "model", Target(tuple(full.shape), shards, lo, hi))
            assert torch.equal(got, local[lo:hi]), (at, lo, hi)


def test_checkpoints_of_single_axis_pieces_still_read(tmp_path):
    """index.json of checkpoints written before multi-axis pieces holds one split ([dim, blocks, index, count])
    or null per piece: both read as before."""
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    root = tmp_path / "iter_0000001.tmp"
    root.mkdir()
    for rank in range(2):
        shard = full.chunk(2, 1)[rank].reshape(-1)
        write_rank_files(root, rank, [(Piece("w", "model", [4, 6], [1, 1, rank, 2], 0, shard.numel()), shard)], None)
    finalize(root, tmp_path / "iter_0000001")
    reader = CheckpointReader(tmp_path / "iter_0000001")
    assert torch.equal(reader.read("w", "model"), full)
    assert torch.equal(reader.read_part("w", "model", Target((4, 6), ((1, 1, 1, 2),), 0, 12)),
                       full.chunk(2, 1)[1].reshape(-1))
