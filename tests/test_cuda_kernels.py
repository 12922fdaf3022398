"""The eager step's kernels on a GPU (their CPU side: tests/test_eager_kernels.py), run with tests/test_cuda.py by
tools/gpu_check.py's tests step and skipped where torch sees no CUDA device.

Under bf16 autocast a norm with bf16 parameters runs on its bf16 input: no fp32 copies in, no casts in backward,
and the fp32 norm's values rounded once, as the cast after it rounded them (torch's CUDA layer_norm reads 4
elements at a time for every dtype so that float and bf16 give the same results); with fp32 parameters it stays
fp32. SwiGLU and RoPE (train.fusions) are one compiled kernel each way and agree with the eager forms to bf16
rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

from megalite.config import FAMILY_FEATURES
from megalite.model.fused import rope, swiglu
from megalite.model.mlp import activate
from megalite.model.norms import build_norm
from megalite.model.rope import apply_rope

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = torch.device("cuda", 0)
BF16 = torch.bfloat16


def _graph(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [child for child, _ in node.next_functions]
    return {type(node).__name__ for node in seen}


def _norm_and_grads(norm: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, plain: bool):
    """The norm's output and gradients under bf16 autocast; `plain`: as autocast runs torch's norm, its output
    cast to bf16 as the next matmul casts it."""
    x = x.detach().requires_grad_()
    norm.zero_grad(set_to_none=True)
    norm.fused = not plain
    with torch.autocast("cuda", dtype=BF16):
        out = norm(x)
    out = out.to(x.dtype) if plain else out
    out.backward(grad)
    return out, x.grad, [p.grad for p in norm.parameters()]


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_a_bf16_norm_under_autocast_runs_on_its_bf16_input_with_the_fp32_norms_values(kind):
    norm = build_norm(kind, 2048, 1e-5, DEVICE).to(DEVICE, BF16)
    for p in norm.parameters():
        torch.nn.init.normal_(p, 1.0, 0.2)
    x, grad = torch.randn(8192, 2048, device=DEVICE, dtype=BF16), torch.randn(8192, 2048, device=DEVICE, dtype=BF16)
    with torch.autocast("cuda", dtype=BF16):
        out = norm(x.requires_grad_())
    assert out.dtype == BF16 and "ToCopyBackward0" not in _graph(out)
    new, new_dx, new_dw = _norm_and_grads(norm, x, grad, plain=False)
    old, old_dx, old_dw = _norm_and_grads(norm, x, grad, plain=True)
    if kind == "layernorm":  # torch's kernel reads 4 elements at a time in every dtype: the same fp32 sums
        assert torch.equal(new, old)
    torch.testing.assert_close(new, old, rtol=2**-7, atol=0)
    torch.testing.assert_close(new_dx, old_dx, rtol=2**-7, atol=1e-5)
    for a, b in zip(new_dw, old_dw):  # a sum over 8192 rows in fp32, rounded to bf16: the order may differ
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)


def test_a_norm_with_fp32_parameters_stays_fp32_under_autocast():
    """fp32 parameters keep an fp32 residual stream: nothing to cast, as before; a bf16 input under fp32 weights
    (a q/k norm of a bf16 projection) runs as autocast has it, in fp32."""
    norm = build_norm("layernorm", 256, 1e-5, DEVICE).to(DEVICE)
    x = torch.randn(64, 256, device=DEVICE)
    with torch.autocast("cuda", dtype=BF16):
        assert norm(x).dtype == torch.float32 and torch.equal(norm(x), F.layer_norm(x, (256,), norm.weight, norm.bias))
        assert norm(x.to(BF16)).dtype == torch.float32


def _kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def _one_kernel_each_way(fused, eager, inputs: list[torch.Tensor], grad: torch.Tensor) -> None:
    leaf = inputs[0].detach().requires_grad_()
    out = fused(leaf, *inputs[1:])  # compiles
    out.backward(grad)
    reference = inputs[0].detach().requires_grad_()
    expected = eager(reference, *inputs[1:])
    expected.backward(grad)
    torch.testing.assert_close(out, expected)
    # eager rounds each term of a gradient to bf16 before their sum, which may cancel: to bf16 rounding of the terms
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=2**-6, atol=2**-4)
    forward = _kernels(lambda: fused(leaf, *inputs[1:]))
    out, leaf.grad = fused(leaf, *inputs[1:]), None
    backward = _kernels(lambda: out.backward(grad))
    assert len(forward) == 1 and len(backward) == 1 and "triton" in forward[0] + backward[0], (forward, backward)


def test_fused_swiglu_is_one_compiled_kernel_each_way_and_agrees_with_eager():
    h = torch.randn(2048, 2, 2 * 1024, device=DEVICE, dtype=BF16)
    grad = torch.randn(2048, 2, 1024, device=DEVICE, dtype=BF16)
    _one_kernel_each_way(swiglu, lambda x: activate(x, FAMILY_FEATURES["llama"]), [h], grad)


def test_fused_rope_is_one_compiled_kernel_each_way_and_agrees_with_eager():
    angles = torch.outer(torch.arange(2048, device=DEVICE, dtype=torch.float32),
                         torch.rand(32, device=DEVICE))
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    x = torch.randn(2048, 2, 8, 64, device=DEVICE, dtype=BF16)
    _one_kernel_each_way(rope, apply_rope, [x, angles.cos(), angles.sin()], torch.randn_like(x))
