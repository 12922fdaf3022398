"""The eager step's fixes found by the H200 profile, on a CPU (their CUDA side: tests/test_cuda.py): q, k and v
split from the fused QKV output as views whose backward is one concatenation; train.fusions, which runs norms in
their input's dtype under autocast and SwiGLU and RoPE as one function each way (compiled on CUDA only), gives the
eager forms' values, bit for bit uncompiled, and keeps less."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from test_plan import one_device_model, saved_bytes

from megalite.config import FAMILY_FEATURES
from megalite.config_cli import parse_config
from megalite.model.attention import SelfAttention, split_qkv
from megalite.model.fused import apply_fusions, rope, swiglu
from megalite.model.mlp import activate
from megalite.model.norms import LayerNorm, RMSNorm, in_input_dtype
from megalite.model.rope import apply_rope, rope_for, rope_tables
from megalite.parallel.context import ParallelContext
from megalite.planning.memory import chunk_activation_bytes

CPU = torch.device("cpu")


def _graph(t: torch.Tensor) -> list[str]:
    """The names of the autograd nodes behind t."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo += [child for child, _ in node.next_functions]
    return names


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_q_k_v_are_views_whose_backward_is_one_concatenation(family):
    """A slice and two selects each zero-filled a QKV-sized gradient in backward, copied their part in and were
    added up (17 ms of GPT-2 1.3B's 299 ms step on an H200); a split has one node, one concatenation."""
    cfg = tiny_config(family)
    attention = SelfAttention(cfg.model, ParallelContext(), CPU)
    rope = rope_for(rope_tables(cfg.model, CPU), 32, None) if family == "llama" else None
    names = _graph(attention(torch.randn(32, 2, 64, requires_grad=True), rope))
    assert names.count("SplitWithSizesBackward0") == 1
    assert not {"SelectBackward0", "SliceBackward0", "IndexBackward0"} & set(names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_group", [1, 4])
def test_split_qkv_gives_indexings_values_and_gradients(dtype, per_group):
    qkv = torch.randn(8, 2, 3, per_group + 2, 16, dtype=dtype, requires_grad=True)
    weights = [torch.randn(8, 2, 3, per_group, 16, dtype=dtype), *torch.randn(2, 8, 2, 3, 16, dtype=dtype)]
    indexed = (qkv[:, :, :, :per_group], qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1])
    grads = []
    for q, k, v in (split_qkv(qkv), indexed):
        assert all(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for t in (q, k, v))
        loss = sum((t * w).sum() for t, w in zip((q, k, v), weights))
        grads.append(torch.autograd.grad(loss, qkv)[0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv), indexed)) and torch.equal(*grads)


def _reference_and_fused(fn_eager, fn_fused, inputs, grad):
    outputs, gradients = [], []
    for fn in (fn_eager, fn_fused):
        leaves = [x.detach().requires_grad_(x.is_floating_point() and i == 0) for i, x in enumerate(inputs)]
        out = fn(*leaves)
        outputs.append(out)
        gradients.append(torch.autograd.grad(out, leaves[0], grad)[0])
    return outputs, gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_is_eagers_bit_for_bit_uncompiled(dtype):
    h = torch.randn(16, 2, 2 * 24, dtype=dtype)
    grad = torch.randn(16, 2, 24, dtype=dtype)
    (eager, fused), (eager_grad, fused_grad) = _reference_and_fused(
        lambda x: activate(x, FAMILY_FEATURES["llama"]), swiglu, [h], grad)
    assert fused.dtype == dtype and torch.equal(eager, fused) and torch.equal(eager_grad, fused_grad)
    assert "_SwiGLUBackward" in _graph(swiglu(h.requires_grad_()))


def test_fused_rope_is_eagers_bit_for_bit_in_fp32_and_rounds_its_bf16_gradient_once():
    cfg = tiny_config("llama")
    cos, sin = rope_for(rope_tables(cfg.model, CPU), 16, None)
    for dtype in (torch.float32, torch.bfloat16):
        x, grad = torch.randn(16, 2, 4, 16, dtype=dtype), torch.randn(16, 2, 4, 16, dtype=dtype)
        (eager, fused), (eager_grad, fused_grad) = _reference_and_fused(apply_rope, rope, [x, cos, sin], grad)
        assert fused.dtype == dtype and torch.equal(eager, fused)
        rotated = torch.cat((grad[..., 8:], -grad[..., :8]), -1)
        if dtype == torch.float32:
            assert torch.equal(eager_grad, fused_grad)
        else:  # one rounding of the fp32 gradient, where autograd rounded each product and their sum
            assert torch.equal(fused_grad, (grad * cos + rotated * sin).to(dtype))
            exact = grad.double() * cos.double() + rotated.double() * sin.double()
            assert (fused_grad.double() - exact).abs().sum() < (eager_grad.double() - exact).abs().sum()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("precision,param_dtype", [("fp32", "fp32"), ("bf16", "bf16")])
def test_a_model_trains_the_same_with_and_without_fusions(family, precision, param_dtype):
    """Uncompiled (a CPU) the fused forms' loss and every gradient equal the eager forms' bit for bit (RoPE's
    bf16 gradient rounds once: within bf16 rounding of it)."""
    cfg = tiny_config(family, train={"precision": precision, "param_dtype": param_dtype})
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=generator)
    runs = []
    for fusions in (False, True):
        cfg.train.fusions = fusions
        model = one_device_model(cfg)
        assert {m.fused for m in model.modules() if hasattr(m, "fused")} == {fusions}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(tokens, labels=tokens).float().mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager), (fused_loss, fused) = runs
    assert torch.equal(eager_loss, fused_loss)
    exact = family == "gpt2" or precision == "fp32"
    for name, grad in eager.items():
        if exact:
            assert torch.equal(grad, fused[name]), name
        else:
            torch.testing.assert_close(fused[name], grad, rtol=0.02, atol=0.02 * grad.abs().max().item())


def test_fused_swiglu_keeps_its_input_and_not_silu_of_the_gate_too():
    """One [tokens, ffn] tensor a layer less, as the planner says (Llama-3.2-1B at 2 x 8192: 4 GiB)."""
    cfg = tiny_config("llama", train={"precision": "bf16", "param_dtype": "bf16"})
    cfg.model.ffn_hidden_size = 96
    measured, planned = {}, {}
    for fusions in (False, True):
        cfg.train.fusions = fusions
        measured[fusions] = saved_bytes(one_device_model(cfg), cfg)
        planned[fusions] = chunk_activation_bytes(cfg, 0, "cpu")[0]
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    fewer = cfg.model.num_layers * tokens * 96 * 2
    assert measured[False] - measured[True] == fewer == planned[False] - planned[True]


def test_norms_leave_autocast_where_input_and_weight_share_a_dtype():
    """CUDA's autocast runs layer_norm in fp32 (tests/test_cuda.py shows the casts go); here the rule itself:
    autocast is off inside the norm when its input and weight share a dtype, on for a bf16 input under fp32
    weights (torch's CUDA norms take one dtype), and off the rule (train.fusions=false) autocast stays."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, w, inside in [(torch.bfloat16, torch.bfloat16, False), (torch.float32, torch.float32, False),
                             (torch.bfloat16, torch.float32, True)]:
            with in_input_dtype(torch.empty(2, dtype=x), torch.empty(2, dtype=w)):
                assert torch.is_autocast_enabled("cpu") == inside
    for norm, plain in [(LayerNorm(32), torch.nn.LayerNorm(32)), (RMSNorm(32), torch.nn.RMSNorm(32))]:
        norm.to(torch.bfloat16), plain.to(torch.bfloat16)
        torch.nn.init.normal_(norm.weight), plain.load_state_dict(norm.state_dict())
        x = torch.randn(4, 32, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(norm(x), plain(x)) and norm(x).dtype == torch.bfloat16
        norm.fused = False
        assert torch.equal(norm(x), plain(x)) and norm.state_dict().keys() == plain.state_dict().keys()


def test_fusions_is_a_training_option():
    cfg = parse_config(["--train.fusions=false"])
    assert cfg.train.fusions is False and parse_config([]).train.fusions is True
    model = torch.nn.Sequential(LayerNorm(8), torch.nn.Linear(8, 8))
    apply_fusions(model, False)
    assert model[0].fused is False and not hasattr(model[1], "fused")


def test_the_fused_functions_compile_on_cuda_only_and_not_inside_a_compiled_layer(monkeypatch):
    """Where the one-kernel forms come from: torch.compile of the function on CUDA with triton; the function as it
    is on a CPU, without triton, and inside a compiled layer (inductor fuses it there with the rest)."""
    from types import SimpleNamespace

    from megalite.model import fused

    monkeypatch.setattr(fused, "_compiled", lambda fn: ("compiled", fn))
    monkeypatch.setattr(fused, "_can_compile", lambda: True)
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert fused._kernel(fused._swiglu, cuda) == ("compiled", fused._swiglu)
    assert fused._kernel(fused._swiglu, cpu) is fused._swiglu
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused._kernel(fused._rope, cuda) is fused._rope
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(fused, "_can_compile", lambda: False)
    assert fused._kernel(fused._rope, cuda) is fused._rope
