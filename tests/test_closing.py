"""Ending a trainer and a run cleanly (issue 24): nothing they started is still running when they are closed.

A collective still in flight when the process group is destroyed aborts the process on NCCL (and, as
seen on gloo, `terminate called without an active exception` in about half the runs of a test that
returned right after `train_step`). `Trainer.close()` (or its `with` block) waits for what a step
leaves in flight; a run also stops its data workers and its background checkpoint write, whether it
ends normally or fails.
"""

from __future__ import annotations

import threading

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from distributed import cpu_topology, run_ranks

from megalite.checkpoint.local import WRITER_THREAD
from megalite.planning.measure import mock_batches
from megalite.training import pretrain as pretrain_module
from megalite.training.build import build_trainer
from megalite.training.step import train_step

ASYNC_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                     "all_reduce")


class _Tracked:
    """A collective's work, recording whether anyone waited for it."""

    def __init__(self, work: dist.Work) -> None:
        self.work, self.waited = work, False

    def wait(self) -> bool:
        self.waited = True
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _track_async_collectives(monkeypatch: pytest.MonkeyPatch) -> list[_Tracked]:
    launched = []
    for name in ASYNC_COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:  # the *_single names exist from torch 2.13
            continue

        def tracked(*args, original=original, **kwargs):
            work = original(*args, **kwargs)
            if kwargs.get("async_op"):
                launched.append(_Tracked(work))
                return launched[-1]
            return work

        monkeypatch.setattr(dist, name, tracked)
    return launched


def _unwaited(rank: int, world_size: int, parallel: dict, close: bool, interrupt: bool) -> int:
    """Collectives launched asynchronously and never waited for, after two steps (the second cut short in its
    second micro batch's backward when `interrupt`) and, when `close`, the trainer closed."""
    with pytest.MonkeyPatch.context() as patch:
        launched = _track_async_collectives(patch)
        cfg = tiny_config(parallel={"bucket_size": 2000, **parallel}, train={"global_batch_size": 8})
        batches = mock_batches(cfg, 2, seed=rank)
        trainer = build_trainer(cfg, cpu_topology(rank, world_size))
        train_step(trainer, batches)
        if interrupt:
            backwards = []

            def fail_in_second_backward(grad: torch.Tensor) -> torch.Tensor:
                backwards.append(grad)
                if len(backwards) == 2:
                    raise KeyboardInterrupt("interrupted in the middle of a backward")
                return grad

            trainer.model.embedding.word_embeddings.weight.register_hook(fail_in_second_backward)
            with pytest.raises(KeyboardInterrupt):
                train_step(trainer, batches)
        else:
            train_step(trainer, batches)
        if close:
            trainer.close()
            trainer.close()  # twice is harmless
        unwaited = sum(not work.waited for work in launched)
        for work in launched:  # land what an unclosed trainer left, so this process ends cleanly either way
            work.work.wait()
        return unwaited


@pytest.mark.parametrize("parallel", [
    {"zero_stage": 1, "overlap_param_gather": True},
    {"zero_stage": 2, "overlap_param_gather": True},
    {"zero_stage": 3},
])
def test_closing_a_trainer_lands_every_collective_it_left_in_flight(parallel):
    """Overlapped parameter gathers stay in flight after a step for the next forward to wait on: closing
    waits for them. A step cut short in the middle of a backward (ZeRO-2 and 3 reduce every micro batch, so
    reductions are in flight then; ZeRO-3 also holds prefetched gathers) is closed the same way."""
    if parallel["zero_stage"] < 3:
        assert run_ranks(2, _unwaited, parallel, False, False) != [0, 0]  # what closing is for
    assert run_ranks(2, _unwaited, parallel, True, False) == [0, 0]
    if parallel["zero_stage"] >= 2:
        assert run_ranks(2, _unwaited, parallel, False, True) != [0, 0]
        assert run_ranks(2, _unwaited, parallel, True, True) == [0, 0]


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children()}


def _fail_at_step(monkeypatch: pytest.MonkeyPatch, failing: int) -> threading.Event:
    """train_step raises at step `failing`; the returned event is set just before."""
    step, calls, failed = pretrain_module.train_step, [], threading.Event()

    def failing_step(trainer, batches):
        calls.append(None)
        if len(calls) == failing:
            failed.set()
            raise RuntimeError("injected failure")
        return step(trainer, batches)

    monkeypatch.setattr(pretrain_module, "train_step", failing_step)
    return failed


def test_a_failing_run_leaves_no_data_worker_and_no_checkpoint_writer(tmp_path, monkeypatch):
    """The run fails at step 3 while its data workers prefetch and step 2's asynchronous checkpoint is being
    written (the write is held until the failure): when pretrain raises, both are gone, and the unpublished
    checkpoint did not become `latest`. The error the user sees is the failure itself."""
    failed, before = _fail_at_step(monkeypatch, 3), _children()
    write = pretrain_module.Checkpointer._write

    def held_write(self, pending, *args):
        if pending.final.name == "iter_0000002":
            failed.wait()
        write(self, pending, *args)

    monkeypatch.setattr(pretrain_module.Checkpointer, "_write", held_write)
    cfg = tiny_config(train={"train_iters": 5}, data={"num_workers": 2},
                      checkpoint={"save": str(tmp_path / "ckpt"), "save_interval": 1, "async_save": True})
    with pytest.raises(RuntimeError, match="injected failure"):
        pretrain_module.pretrain(cfg)
    assert _children() == before
    assert not any(thread.name == WRITER_THREAD for thread in threading.enumerate())
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "1"


def test_a_finished_run_leaves_no_data_worker(tmp_path):
    before = _children()
    result = pretrain_module.pretrain(tiny_config(train={"train_iters": 3, "eval_interval": 2, "eval_iters": 1},
                                                  data={"num_workers": 2}))
    assert sorted(result.losses) == [1, 2, 3] and result.val_loss is not None
    assert _children() == before
