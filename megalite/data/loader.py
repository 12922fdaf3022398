"""Micro batches for one data-parallel rank, loaded in background worker processes.

The global sample order is the dataset's own (already shuffled) index order: global batch
k holds samples [k*gbs, (k+1)*gbs). Micro batch m of rank r takes samples
first + m*mb*dp + r*mb + [0, mb), so the same global batch is read whatever dp and the
micro batch size are, and resuming needs nothing but the number of consumed samples, even
after a change of dp.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from megalite.child_signals import children_start_deaf, ignore_stop_signals
from megalite.data.batches import Batch, BatchMaker
from megalite.errors import UserError


class MicroBatchSampler:
    """Index lists of this rank's micro batches, from sample `first` up to `end`."""

    def __init__(self, first: int, end: int, micro_batch_size: int, dp: int, dp_rank: int) -> None:
        self.first, self.end, self.mb, self.dp, self.dp_rank = first, end, micro_batch_size, dp, dp_rank

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(self.first, self.end - self.mb * self.dp + 1, self.mb * self.dp):
            begin = start + self.dp_rank * self.mb
            yield list(range(begin, begin + self.mb))

    def __len__(self) -> int:
        return max(0, (self.end - self.first) // (self.mb * self.dp))


class MicroBatches:
    """An iterator of micro batches whose worker processes stop when it is closed (or its `with` block ends),
    not whenever the garbage collector reaches it: a run that ends, or fails with the stream still referenced
    from the traceback, leaves no worker behind."""

    def __init__(self, loader: DataLoader) -> None:
        with children_start_deaf():  # the workers start here
            self._batches = iter(loader)

    def __iter__(self) -> MicroBatches:
        return self

    def __next__(self) -> Batch:
        try:
            return next(self._batches)
        except UserError as error:
            raise _as_raised(error) from None

    def close(self) -> None:
        shutdown = getattr(self._batches, "_shutdown_workers", None)  # only loaders with workers have them
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> MicroBatches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_raised(error: UserError) -> UserError:
    """A user error raised in a worker process arrives re-raised by torch with the worker's whole traceback in its
    message; what the user needs is the message the worker raised (its last line), once."""
    text, marker = str(error).rstrip(), f"{type(error).__name__}: "
    last = text.splitlines()[-1] if text else ""
    if "Original Traceback" not in text or marker not in last:
        return error
    return type(error)(last.split(marker, 1)[1])


def micro_batches(dataset: Dataset, maker: BatchMaker, first: int, end: int, micro_batch_size: int, dp: int,
                  dp_rank: int, num_workers: int, device: torch.device) -> MicroBatches:
    """This rank's micro batches over samples [first, end), prefetched by `num_workers` processes."""
    loader = DataLoader(
        dataset, batch_sampler=MicroBatchSampler(first, end, micro_batch_size, dp, dp_rank), collate_fn=maker,
        num_workers=num_workers, pin_memory=device.type == "cuda", prefetch_factor=4 if num_workers else None,
        worker_init_fn=ignore_stop_signals,  # the rank stops them (megalite/child_signals.py)
    )
    return MicroBatches(loader)
