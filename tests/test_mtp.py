"""Multi-token prediction on one device equals a hand-written DeepSeek-V3 MTP loss (report section 2.2): depth k
at position i projects [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})], runs one more transformer layer, its own final
RMSNorm and the shared head against t_{i+k+1}; loss = main + (lambda / D) sum_k CE_k, each CE_k summed over the
depth's predictions inside the window and inside one document, over the main loss's token count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from megalite.config import ConfigError
from megalite.config_validation import validate
from megalite.data.batches import BatchMaker
from megalite.data.mtp_targets import mtp_targets
from megalite.model.gpt import GPTModel
from megalite.parallel import gemm
from megalite.parallel.context import ParallelContext
from megalite.parallel.fp8 import Float8
from megalite.training.build import build_model

EOD = 7


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _valid(sample: torch.Tensor, i: int, k: int, documents: bool) -> bool:
    """Depth k at position i of `sample` (seq + 1 tokens) predicts t_{i+k+1}: inside the window, and with
    documents on, no end-of-document among t_i..t_{i+k} (which the chain of predictions would cross)."""
    if i + k + 1 >= len(sample):
        return False
    return not documents or all(int(t) != EOD for t in sample[i:i + k + 1])


def _reference_loss(model: GPTModel, samples: torch.Tensor, documents: bool) -> tuple[torch.Tensor, list[float]]:
    """The hand-written loss and each depth's summed cross-entropy, from the model's parameters by name (its
    transformer layers called as functions: the layer kind is not what is tested here)."""
    cfg, p = model.cfg, dict(model.named_parameters())
    maker = BatchMaker(EOD, reset_position_ids=documents, eod_mask_loss=documents)
    batch = maker(list(samples.numpy()))
    eps, table, head = cfg.norm_epsilon, p["embedding.word_embeddings.weight"], p["lm_head.weight"]
    rope = model._rope(batch.tokens, batch.position_ids)
    x = table[batch.tokens.t()]
    for layer in model.layers.values():
        x = layer(x, rope)
    hidden = _rms(x, p["final_norm.weight"], eps)  # [seq, batch, hidden]
    logits = (hidden @ head.t())[..., : cfg.vocab]
    main = F.cross_entropy(logits.flatten(0, 1), batch.labels.t().flatten(), reduction="none").view(logits.shape[:2])
    count = batch.loss_mask.sum()
    total = (main.t() * batch.loss_mask).sum() / count
    seq, sums = batch.tokens.shape[1], []
    for k in range(1, cfg.mtp_num_layers + 1):
        d = f"mtp.layers.{k - 1}."
        ahead = torch.stack([torch.cat([s[k:k + seq], s.new_zeros(max(0, k + seq - len(s)))]) for s in samples])
        embedded = _rms(table[ahead.t()], p[d + "enorm.weight"], eps)
        x = torch.cat([embedded, _rms(hidden, p[d + "hnorm.weight"], eps)], -1) @ p[d + "eh_proj.weight"].t()
        hidden = _rms(model.mtp.layers[k - 1].transformer_layer(x, rope), p[d + "final_norm.weight"], eps)
        logits = (hidden @ head.t())[..., : cfg.vocab]
        depth = torch.zeros(())
        for b, sample in enumerate(samples):
            for i in range(seq):
                if _valid(sample, i, k, documents):
                    depth = depth + F.cross_entropy(logits[i, b], sample[i + k + 1])
        sums.append(float(depth.detach()))
        total = total + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * depth / count
    return total, sums


@pytest.mark.parametrize("documents", [False, True], ids=["one window", "documents (reset positions, eod mask)"])
def test_mtp_equals_a_hand_written_reference(documents):
    cfg = tiny_config("llama", model={"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3, "seq_length": 16})
    model = GPTModel(cfg.model, torch.device("cpu"), seed=3)
    generator = torch.Generator().manual_seed(0)
    samples = torch.randint(0, cfg.model.vocab, (2, 17), generator=generator)
    samples[0, [3, 9]] = EOD
    samples[1, 12] = EOD
    maker = BatchMaker(EOD, reset_position_ids=documents, eod_mask_loss=documents)
    batch = maker(list(samples.numpy()))
    targets = mtp_targets(batch.labels, batch.loss_mask, batch.position_ids, cfg.model.mtp_num_layers)
    # As train_step weighs them: summed per-token losses over the global token count (one micro batch here).
    model.aux_losses.start_step(float(batch.loss_mask.numel() / batch.loss_mask.sum()), torch.device("cpu"))
    out = model(batch.tokens, batch.labels, batch.position_ids, mtp=targets)
    ((out * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    counted = [float(model.aux_losses.totals[f"mtp_{k}"]) for k in (1, 2)]
    model.zero_grad()
    reference, sums = _reference_loss(model, samples, documents)
    reference.backward()
    assert counted == pytest.approx(sums, rel=1e-5)
    assert sorted(grads) == sorted(name for name, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert grads["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_targets_shift_inside_the_window_and_stay_in_one_document():
    labels = torch.tensor([[11, 12, EOD, 14, 15, 16]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1]])  # tokens t0..t5 with t3 = EOD: a document starts at t4
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    targets = mtp_targets(labels, mask, positions, 2)
    assert targets.tokens.tolist() == [[[11, 12, EOD, 14, 15, 16]], [[12, EOD, 14, 15, 16, 0]]]
    assert targets.labels.tolist() == [[[12, EOD, 14, 15, 16, 0]], [[EOD, 14, 15, 16, 0, 0]]]
    assert targets.loss_mask.tolist() == [[[1, 1, 0, 0, 1, 0]], [[1, 0, 0, 0, 0, 0]]]
    plain = mtp_targets(labels, torch.ones_like(mask), None, 2)
    assert plain.loss_mask.tolist() == [[[1, 1, 1, 1, 1, 0]], [[1, 1, 1, 1, 0, 0]]]


def test_mtp_fields_are_validated_with_their_fix():
    cfg = tiny_config("llama", model={"mtp_num_layers": -1, "mtp_loss_scaling_factor": -0.5})
    with pytest.raises(ConfigError) as error:
        validate(cfg, 1)
    assert any("model.mtp_num_layers=-1 must be >= 0" in p for p in error.value.problems)
    assert any("model.mtp_loss_scaling_factor=-0.5 must be >= 0" in p for p in error.value.problems)
    cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor = 32, 0.1
    with pytest.raises(ConfigError, match=r"model.mtp_num_layers=32 must be < model.seq_length=32"):
        validate(cfg, 1)


def test_recompute_and_fp8_reach_the_mtp_layers():
    cfg = tiny_config("llama", model={"mtp_num_layers": 1}, train={"fp8_recipe": "tensorwise", "recompute": "full"})
    model = build_model(cfg, torch.device("meta"), ParallelContext(), 0)
    depth, main = model.mtp.layers[0], model.layers["1"]
    assert depth.transformer_layer.recompute and main.recompute
    assert isinstance(depth.transformer_layer.attention.linear_qkv.recipe, Float8)
    assert depth.transformer_layer.attention.linear_qkv.recipe is main.attention.linear_qkv.recipe
    assert depth.eh_proj.recipe is gemm.HIGH_PRECISION
