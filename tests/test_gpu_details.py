"""Details that only GPU clusters would show, checked on CPU: the device a rank picks, the NCCL
error-handling mode that lets megalite report a timeout, the one CUDA connection that tensor and context
parallelism need (set before CUDA starts), the timeout message naming the rank and
the group, and the MFU peak of the exact device model."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import cpu_topology, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.config import ParallelConfig
from megalite.parallel import topology as topology_module
from megalite.parallel.cuda_env import max_connections
from megalite.parallel.timeouts import collective_timeout_message
from megalite.parallel.topology import Topology, pick_device, release_process_groups
from megalite.training.flops import PEAK_TFLOPS, device_model


def test_each_rank_takes_local_rank_modulo_the_visible_devices(monkeypatch):
    """Launchers that hand each process one GPU (CUDA_VISIBLE_DEVICES) leave every rank seeing device 0."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert pick_device("auto", 6) == torch.device("cuda", 2) and chosen == [torch.device("cuda", 2)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda", 5) == torch.device("cuda", 0)


def test_nccl_process_group_leaves_timeouts_to_the_training_thread(monkeypatch):
    """NCCL's watchdog would kill the process from its own thread on a timeout; CleanUpOnly (2) aborts the
    hung communicators and lets the error reach megalite's handler. A value the user set is kept."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append(backend))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    topology_module.init_process_group(torch.device("cuda", 0))
    assert calls == ["nccl"] and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    topology_module.init_process_group(torch.device("cuda", 0))
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    topology_module.init_process_group(torch.device("cpu"))
    assert calls[-1] == "gloo"


@pytest.mark.parametrize("layout, user, value, logged", [
    ({}, None, None, None),  # no tensor or context parallelism: CUDA's default
    ({"tp": 2}, None, "1", "CUDA_DEVICE_MAX_CONNECTIONS=1 set for parallel.tp=2, parallel.cp=1"),
    ({"cp": 2}, None, "1", "CUDA_DEVICE_MAX_CONNECTIONS=1 set for parallel.tp=1, parallel.cp=2"),
    ({"tp": 2, "distributed_optimizer": True}, None, "1", "CUDA_DEVICE_MAX_CONNECTIONS=1 set"),
    ({"tp": 2}, "1", None, None),  # already what the layout needs
    ({"tp": 2}, "8", None, "CUDA_DEVICE_MAX_CONNECTIONS=8 kept as set"),  # never overridden, but said
    ({"tp": 2, "zero_stage": 3}, None, None, None),  # ZeRO-3's gathers need more than one connection
    ({"cp": 2, "zero_stage": 3}, "1", None, "CUDA_DEVICE_MAX_CONNECTIONS=1 kept as set: parallel.zero_stage=3"),
])
def test_one_cuda_connection_for_tensor_or_context_parallelism(layout, user, value, logged):
    """Megatron-LM's rule: with tp or cp > 1 the GPU must start kernels in the order they were queued (one
    connection), so that the sequence-parallel collectives start before the matmuls they overlap; ZeRO-3
    (Megatron-FSDP) wants several. A value the user set stays, with a line saying so when it differs."""
    environ = {} if user is None else {"CUDA_DEVICE_MAX_CONNECTIONS": user}
    got_value, line = max_connections(ParallelConfig(**layout), environ)
    assert got_value == value
    assert (line is None) if logged is None else line.startswith(logged), line


class _Stop(Exception):
    pass


def test_the_connection_limit_is_set_before_cuda_starts(monkeypatch):
    """CUDA reads CUDA_DEVICE_MAX_CONNECTIONS once, when it starts: the variable is in the environment at the
    first CUDA call of pretrain's start-up (Topology.from_environment); a run on the CPU leaves it out."""
    seen = []

    def first_cuda_call(*args):
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", first_cuda_call)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")  # so that the test's end restores its absence
    for preference in ("auto", "cuda"):
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
        with pytest.raises(_Stop):
            Topology.from_environment(preference, ParallelConfig(tp=2, sequence_parallel=True))
    assert seen == ["1", "1"]
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setattr(topology_module, "pick_device", first_cuda_call)
    with pytest.raises(_Stop):
        Topology.from_environment("cpu", ParallelConfig(tp=2))
    assert seen[-1] is None


@pytest.mark.parametrize("rank, device, logged", [("0", "cuda", True), ("1", "cuda", False), ("0", "cpu", False)])
def test_the_first_rank_of_a_gpu_run_says_what_it_set(monkeypatch, capsys, rank, device, logged):
    """One line per job, on GPU runs only (a CPU run under device=auto has it set, harmlessly, and unsaid)."""
    def stop(*args):
        raise _Stop

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(topology_module, "pick_device", lambda *args: torch.device(device))
    monkeypatch.setattr(topology_module, "init_process_group", stop)
    with pytest.raises(_Stop):
        Topology.from_environment("auto", ParallelConfig(cp=2))
    said = capsys.readouterr().out
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert said == ("CUDA_DEVICE_MAX_CONNECTIONS=1 set for parallel.tp=1, parallel.cp=2: the GPU starts each tensor- "
                    "or context-parallel collective before the computation queued after it, which it overlaps (as "
                    "Megatron-LM requires)\n" if logged else ""), said


def test_an_nccl_timeout_names_the_rank_and_the_group():
    topology = Topology.from_environment("cpu")
    try:
        watchdog = ("NCCL communicator was aborted on rank 0. Original reason for failure was: "
                    "[PG ID 2 PG GUID 3(data-parallel) Rank 0] Watchdog caught collective operation timeout: "
                    "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
                    "ran for 600042 milliseconds before timing out.")
        message = collective_timeout_message(dist.DistBackendError(watchdog), 0, 10.0, topology.named_groups())
        assert message == ("rank 0: a collective timed out after parallel.timeout_minutes=10.0; another rank died "
                           "or hangs in the data-parallel group (ranks [0]) (check its log), or steps are slower "
                           "than that: then raise the timeout")
        assert collective_timeout_message(ValueError("timed out"), 0, 10.0, {}) is None
        assert collective_timeout_message(RuntimeError("CUDA out of memory"), 0, 10.0, {}) is None
    finally:
        release_process_groups()


def _time_out_in_a_group(rank: int, world_size: int) -> str | None:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2), group_desc="tensor-parallel")
    if rank == 1:
        time.sleep(4)  # never joins the collective below
        return None
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as error:
        return collective_timeout_message(error, rank, 0.03, {"tensor-parallel": group})
    return "no timeout"


def test_a_gloo_timeout_names_the_group_it_happened_in():
    message = run_ranks(2, _time_out_in_a_group)[0]
    assert message.startswith("rank 0: a collective timed out after parallel.timeout_minutes=0.03; "
                              "another rank died or hangs in the tensor-parallel group (ranks [0, 1])"), message


@pytest.mark.parametrize("name, model, bf16", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0), ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0), ("NVIDIA H200", "H200", 989.0), ("NVIDIA H200 NVL", "H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", "GH200", 989.0), ("NVIDIA H800", "H800", 989.0), ("NVIDIA H800 PCIe", "H800 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0), ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA A800-SXM4-80GB", "A800", 312.0), ("NVIDIA H100", None, None), ("NVIDIA GeForce RTX 4090", None, None),
])
def test_mfu_peak_is_that_of_the_exact_device_model(name, model, bf16):
    assert device_model(name) == model
    assert (PEAK_TFLOPS[model]["bf16"] if model else None) == bf16


@pytest.mark.parametrize("allowed", [True, False])
def test_tf32_follows_the_config(allowed, tmp_path):
    """fp32 matmuls on CUDA use TF32 unless train.allow_tf32=false (torch's own default is off)."""
    from conftest import tiny_config

    from megalite.training.pretrain import pretrain

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not allowed
    try:
        pretrain(tiny_config(train={"train_iters": 1, "allow_tf32": allowed}))
        assert torch.backends.cuda.matmul.allow_tf32 is allowed and torch.backends.cudnn.allow_tf32 is allowed
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True


def _overflow_votes(rank: int, world_size: int, precision: str) -> int:
    from conftest import tiny_config

    from megalite.planning.measure import mock_batches
    from megalite.training.build import build_trainer
    from megalite.training.step import train_step

    cfg = tiny_config(train={"precision": precision})
    with build_trainer(cfg, cpu_topology(rank, world_size)) as trainer:
        votes = []
        vote = trainer.optimizer.any_overflow
        trainer.optimizer.any_overflow = lambda found: votes.append(found) or vote(found)
        for _ in range(2):
            train_step(trainer, mock_batches(cfg, 1, seed=0))
    return len(votes)


def test_only_fp16_votes_on_overflow_each_step():
    """The overflow vote is a collective read on the host (a GPU pipeline stall): only fp16's dynamic loss
    scale can overflow, so bf16 and fp32 steps skip it."""
    assert [run_ranks(2, _overflow_votes, p)[0] for p in ("fp32", "bf16", "fp16")] == [0, 0, 2]


def _stop_votes(rank: int, world_size: int) -> tuple[list[int], list[tuple[int, int]], int]:
    """When each step's stop vote is queued, when it is read (by step) and how many host-reading votes ran."""
    import os

    from conftest import tiny_config

    from megalite.training import pretrain as pretrain_module

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    queued, reads, steps, host_votes = [], [], [0], [0]
    step, later, vote = pretrain_module.train_step, Topology.max_over_ranks_later, Topology.max_over_ranks

    def counted_step(*args):
        steps[0] += 1
        return step(*args)

    def queued_vote(self, values):
        issued, read = steps[0], later(self, values)
        queued.append(issued)
        return lambda: reads.append((issued, steps[0])) or read()

    def host_vote(self, values):
        host_votes[0] += 1
        return vote(self, values)

    pretrain_module.train_step = counted_step
    Topology.max_over_ranks_later, Topology.max_over_ranks = queued_vote, host_vote
    pretrain_module.pretrain(tiny_config(train={"train_iters": 7}, logging={"log_interval": 3}))
    return queued, reads, host_votes[0]


def test_ranks_vote_on_stopping_every_step_and_read_each_vote_a_step_later():
    """The SIGTERM / time-limit vote is queued after every step (a stop never waits for a log step) and read
    on the host after the next one, when a GPU has finished it: no step waits for its own vote."""
    queued, reads, host_votes = run_ranks(2, _stop_votes)[0]
    assert queued == list(range(1, 8))
    assert reads == [(s, s + 1) for s in range(1, 7)]
    assert host_votes == 0


def _votes_per_step(rank: int, world_size: int, root: str) -> dict[int, int]:
    """Host-reading collectives (Topology.max_over_ranks) per step of a run saving asynchronously at steps 2,
    4 and 6 of 7, logging at steps 3, 6 and 7."""
    import os

    from conftest import tiny_config

    from megalite.training import pretrain as pretrain_module

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    votes: dict[int, int] = {}
    steps = [0]
    step, vote = pretrain_module.train_step, Topology.max_over_ranks

    def counted_step(*args):
        steps[0] += 1
        return step(*args)

    def counted_vote(self, values):
        votes[steps[0]] = votes.get(steps[0], 0) + 1
        return vote(self, values)

    pretrain_module.train_step, Topology.max_over_ranks = counted_step, counted_vote
    pretrain_module.pretrain(tiny_config(train={"train_iters": 7}, logging={"log_interval": 3},
                                         checkpoint={"save": root, "save_interval": 2, "async_save": True}))
    return votes


def test_a_pending_async_save_is_polled_only_at_log_steps(tmp_path):
    """While an asynchronous save is being written, asking every rank whether it is done is a collective read
    on the host: it happens at log steps (3, 6, 7) and where a save must wait for the previous one (4, 6, the
    end), never at steps 1 and 5 (step 4's save is pending during step 5); every save still becomes `latest`."""
    root = tmp_path / "ckpt"
    votes = run_ranks(2, _votes_per_step, str(root))
    assert votes[0] == votes[1] and set(votes[0]) <= {3, 4, 6, 7}
    assert (root / "latest").read_text().strip() == "7"
    assert sorted(p.name for p in root.glob("iter_*")) == [f"iter_000000{i}" for i in (2, 4, 6, 7)]


def test_checkpoint_host_copies_reuse_their_buffers(tmp_path, monkeypatch):
    """Every save copies the pieces into the same host buffers (pinned on a GPU, non-blocking copies, one
    synchronisation), instead of a fresh blocking copy per piece per save; the files hold the values."""
    from conftest import tiny_config

    from megalite.checkpoint.local import Checkpointer
    from megalite.training.pretrain import pretrain

    seen = []
    copies = Checkpointer._host_copies

    def spy(self, tensors):
        host = copies(self, tensors)
        seen.append([h.data_ptr() for h in host])
        return host

    monkeypatch.setattr(Checkpointer, "_host_copies", spy)
    ckpt = {"save": str(tmp_path / "ckpt"), "save_interval": 1}
    first = pretrain(tiny_config(train={"train_iters": 4, "exit_interval": 3}, checkpoint=ckpt))
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    resumed = pretrain(tiny_config(train={"train_iters": 4}, checkpoint={**ckpt, "load": ckpt["save"]}))
    straight = pretrain(tiny_config(train={"train_iters": 4}))
    assert {**first.losses, **resumed.losses} == straight.losses


class _DataDependentShapes(TorchDispatchMode):
    """Counts the ops whose output size depends on tensor values (a boolean mask's selection, nonzero): on a GPU
    each waits for the device, like a read."""

    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if masked or func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _host_reads(rank: int, world_size: int, precision: str, parallel: dict, model: dict | None = None,
                optim: dict | None = None) -> int:
    """How many times one training step reads a tensor's value on the host (each would stall a GPU)."""
    from conftest import tiny_config

    from megalite.planning.measure import mock_batches
    from megalite.training.build import build_trainer
    from megalite.training.step import train_step

    cfg = tiny_config(train={"precision": precision}, parallel=parallel, model=model or {}, optim=optim or {})
    topology = cpu_topology(rank, world_size, cfg)
    with build_trainer(cfg, topology) as trainer:
        batches = mock_batches(cfg, cfg.num_microbatches(2), seed=0)
        train_step(trainer, batches)  # warm-up: first-step allocations
        reads = []
        names = ("item", "tolist", "__float__", "__int__", "__bool__")
        originals = {name: getattr(torch.Tensor, name) for name in names}
        for name, original in originals.items():
            setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
        try:
            with _DataDependentShapes(reads):
                result = train_step(trainer, batches)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        result.read()  # the figures are all there, read when the loop wants them
    return len(reads)


@pytest.mark.parametrize("precision, parallel", [
    ("bf16", {"zero_stage": 1, "overlap_param_gather": True}),
    ("fp32", {"tp": 2, "sequence_parallel": True}),
    ("bf16", {"pp": 2}),
    ("bf16", {"zero_stage": 3}),
])
def test_a_training_step_never_reads_the_device_on_the_host(precision, parallel):
    """Loss, token count and gradient norm stay on the device, clipping scales on the device and a NaN/Inf
    norm skips the update inside the fused AdamW kernel: no host read in a bf16 or fp32 step (fp16 alone
    votes on overflows)."""
    assert run_ranks(2, _host_reads, precision, parallel) == [0, 0]


@pytest.mark.parametrize("precision, parallel", [("bf16", {"zero_stage": 1}), ("fp32", {"tp": 2})])
def test_a_muon_step_never_reads_the_device_on_the_host(precision, parallel):
    """Muon's traffic is planned at build (split sizes known on every rank) and a NaN/Inf norm skips its update
    by a selection on the device."""
    assert run_ranks(2, _host_reads, precision, parallel, None, {"optimizer": "muon"}) == [0, 0]


MOE = {"num_experts": 4, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.01}


@pytest.mark.parametrize("parallel, model, reads", [
    ({"ep": 2}, MOE, 2),  # dropless all-to-all: the split sizes, once per MoE layer (2) per micro batch (1)
    ({"ep": 2}, {**MOE, "moe_capacity_factor": 1.0, "moe_pad_to_capacity": True}, 0),
    ({"ep": 2, "moe_dispatcher": "allgather"}, MOE, 0),
    ({}, {**MOE, "moe_expert_bias": True}, 0),  # ep 1: the grouped GEMM takes its offsets on the device
])
def test_host_reads_of_a_mixture_of_experts_step(parallel, model, reads):
    """The dropless all-to-all must know its split sizes on the host: one read per MoE layer per forward (a
    stall of the host, not of the device work queued before it); padding to a capacity or the all-gather
    dispatcher need none, nor does ep 1."""
    assert run_ranks(2, _host_reads, "bf16", parallel, model) == [reads, reads]


class _FakeEvent:
    """Stands in for torch.cuda.Event: records 'device time' from a script instead of a GPU."""

    script: list[float] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at, self.synchronized = None, False

    def record(self) -> None:
        self.at = _FakeEvent.script.pop(0)

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert end.synchronized, "reading an interval must wait for its end"
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA reports


def test_device_timings_come_from_cuda_events_on_a_gpu(monkeypatch):
    """On CUDA a wait for a collective or a pipeline operation is timed by events on the stream (the host
    returns from NCCL's wait at once); the trace places device intervals at the host time of its first mark."""
    from megalite.parallel import timing
    from megalite.parallel.pipeline.executor import Trace

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.script = [10.0, 10.25]
    start, end = timing.mark(torch.device("cuda", 0)), timing.mark(torch.device("cuda", 0))
    assert timing.seconds(start, end) == pytest.approx(0.25)
    _FakeEvent.script = [5.0, 5.5, 6.0, 7.0]
    trace = Trace(torch.device("cuda", 0))
    first = trace.mark()
    trace.events.append(("F", 0, 0, first, trace.mark(), False))  # the last field: part of a pair (DualPipeV)
    trace.events.append(("B", 0, 0, trace.mark(), trace.mark(), False))
    anchor = trace.anchor
    assert trace.timed_events() == [("F", 0, 0, anchor, pytest.approx(anchor + 0.5), False),
                                    ("B", 0, 0, pytest.approx(anchor + 1.0), pytest.approx(anchor + 2.0), False)]
    assert timing.seconds(1.0, 3.5) == 2.5  # on the CPU a mark is the host clock
