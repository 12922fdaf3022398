"""The eager profile's tools on a CPU: kernel families by name (an optimizer's kernels, not every functor's
lambda), record_function ranges on the device left out of device time, and a chrome trace read back: its records,
self times and each kernel charged to the op that launched it (tools/profile_trace.py)."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

from tools import profile_summary
from tools.profile_summary import family
from tools.profile_trace import load, markdown, records_of_trace, time_by_op


def test_optimizer_family_is_the_optimizers_kernels_not_every_lambda():
    """`lamb` named LAMB's kernels and matched the `{lambda()#3}` in torch's elementwise kernels' names: on the
    H200 that put 53 ms of GPT-2's copies, casts and adds in the optimizer family."""
    copy = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
            "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>")
    silu = "void at::native::elementwise_kernel<128, 4, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}>"
    assert family(copy) == "copy / cast" and family(silu) == "elementwise"
    mul = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor"
           "<float, float, float, at::native::binary_internal::MulFunctor<float>>>>")  # `cast` matched its nocast
    assert family(mul) == "elementwise" and family("bfloat16_copy_kernel_cuda{lambda(float)#1}") == "copy / cast"
    assert family("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u>") \
        == "norm" and family("void cudnn::fusion::convert_dq_to_16bits<true>") == "attention"
    assert family("void multi_tensor_apply_kernel<TensorListMetadata<5>, LAMBStage1Functor<float>>") == "optimizer"
    assert family("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata"
                  "<4>, FusedAdamMathFunctor<float, 4>>") == "optimizer"


def test_a_record_function_range_on_the_device_is_not_a_kernel():
    """torch.profiler reports `Optimizer.step#AdamW.step` on the device too (a user annotation spanning the
    optimizer's kernels): counted as a kernel it doubled the optimizer's time."""
    from torch.autograd import DeviceType

    def event(name, device, annotation):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=0.0, end=10.0),
                               self_cpu_time_total=1.0, is_user_annotation=annotation)

    events = [event("Optimizer.step#AdamW.step", DeviceType.CUDA, True), event("adam_kernel", DeviceType.CUDA, False),
              event("Optimizer.step#AdamW.step", DeviceType.CPU, True)]
    assert [(r.name, r.on_device) for r in profile_summary.records_of(events)] == [
        ("adam_kernel", True), ("Optimizer.step#AdamW.step", False)]


def _trace(tmp_path):
    """A step's trace as torch.profiler writes it: ops on two threads (forward, autograd's), launches with
    correlation ids, kernels, a memset, and a range on the device that is no kernel."""
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(ts, correlation, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
                "args": {"correlation": correlation}}

    def kernel(name, ts, dur, correlation, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7,
                "args": {"correlation": correlation}}

    events = [op("aten::layer_norm", 0, 50), op("aten::to", 5, 10), op("aten::copy_", 6, 8), launch(7, 1),
              op("aten::native_layer_norm", 20, 20), launch(25, 2),
              op("SelectBackward0", 100, 40, tid=2), op("aten::fill_", 105, 10, tid=2), launch(106, 3, tid=2),
              op("aten::copy_", 120, 10, tid=2), launch(121, 4, tid=2), launch(135, 5, tid=2),
              kernel("bfloat16_copy_kernel{lambda(float)#1}", 60, 4, 1),
              kernel("vectorized_layer_norm_kernel", 64, 6, 2),
              kernel("vectorized_elementwise_kernel<8, FillFunctor>", 200, 3, 3),
              kernel("direct_copy_kernel{lambda()#3}", 203, 5, 4),
              kernel("Memset (Device)", 208, 1, 5, cat="gpu_memset"),
              {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 60, "dur": 150,
               "tid": 7}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_a_trace_gives_the_summarys_records_with_self_times(tmp_path):
    records = records_of_trace(load(_trace(tmp_path)))
    kernels = [r for r in records if r.on_device]
    assert [r.name for r in kernels] == [
        "bfloat16_copy_kernel{lambda(float)#1}", "vectorized_layer_norm_kernel",
        "vectorized_elementwise_kernel<8, FillFunctor>", "direct_copy_kernel{lambda()#3}", "Memset (Device)"]
    self_us = {(r.name, r.start_us): r.self_us for r in records if not r.on_device}
    assert self_us["aten::layer_norm", 0] == 50 - 10 - 20 and self_us["aten::to", 5] == 2
    assert self_us["SelectBackward0", 100] == 40 - 10 - 10 - 2  # its own launch counts as a child
    summary = profile_summary.summarize(records)
    assert summary["device"]["kernels"] == 5 and summary["host"]["launches"] == 5
    assert {f["family"]: f["kernels"] for f in summary["families"]} == {"copy / cast": 3, "norm": 1, "elementwise": 1}


def test_each_kernel_is_charged_to_the_op_that_launched_it(tmp_path):
    events = load(_trace(tmp_path))
    rows = {(r["op"], r["inner"], r["family"]): (r["ms"], r["kernels"]) for r in time_by_op(events)}
    assert rows == {("SelectBackward0", "aten::copy_", "copy / cast"): (0.005, 1),
                    ("aten::layer_norm", "aten::native_layer_norm", "norm"): (0.006, 1),
                    ("aten::layer_norm", "aten::copy_", "copy / cast"): (0.004, 1),
                    ("SelectBackward0", "aten::fill_", "elementwise"): (0.003, 1),
                    ("SelectBackward0", "SelectBackward0", "copy / cast"): (0.001, 1)}
    table = markdown(events, top=2)
    assert table[0] == "device span 0.1 ms, busy 0.0 ms, 5 kernels" and "| norm | 0.01 | 31.6% | 1 |" in table
    assert table[-2:] == ["| `aten::layer_norm` | `aten::native_layer_norm` | norm | 0.01 | 1 |",
                          "| `SelectBackward0` | `aten::copy_` | copy / cast | 0.01 | 1 |"]
