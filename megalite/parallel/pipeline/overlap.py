"""Running a paired operation (F&B, ops.py `Paired`): one micro batch's forward and another's whole backward, so
that one part's expert all-to-all travels while the other part computes (DualPipe's point, dualpipe.py).

`SEQUENTIAL` runs the forward, then the backward: what a rank without an all-to-all to hide runs. `Interleaved`
runs the forward part on this thread and the backward part on a second one, and hands the turn between them at
one seam: right after a part posts an all-to-all (parallel/mappings.py calls `travel`), the other part runs until
it posts one of its own, and only then does the first wait for its result. Only one part runs at any time, and
where the turn passes depends only on the parts' own calls, so every rank of a group posts its collectives in
the same order on every layout: NCCL cannot deadlock on them, and gloo's results are exact (the parity tests
run this very code). On an accelerator both threads queue kernels on the compute stream the step runs on (the
second thread takes the first's device and stream, `Streams`); the all-to-all runs on its communicator's own
stream (NCCL's, torch.distributed's asynchronous collectives), and the compute stream waits for it only where
the part that posted it resumes: the other part's kernels, queued in between, run while it travels. A CPU has
no streams; tests/test_dualpipe.py checks the order of turns, posts, waits and stream hand-overs with a recorded
fake. How much time that hides is unmeasured until a machine with several GPUs runs it.

A recompute (activation checkpointing) reruns a forward inside the backward part: it keeps the turn through its
all-to-alls, so that the forward part never runs while the recompute has swapped in the random generators' saved
states (dropout draws the masks its forward drew).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

_seat = threading.local()  # (the running pair's turns, this thread's side) while a pair runs


class PairRunner(Protocol):
    def run(self, parts: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run a paired operation's parts (forward, backward); returns what each returned."""


class _Sequential:
    def run(self, parts: Sequence[Callable[[], Any]]) -> list[Any]:
        return [part() for part in parts]


SEQUENTIAL = _Sequential()


class _Turns:
    """Whose turn it is: a part runs only on its turn, gives it away after posting a collective and gets it back
    when the other gives it away or finishes."""

    def __init__(self) -> None:
        self.turn, self.finished = 0, [False, False]
        self.changed = threading.Condition()

    def wait(self, side: int) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.turn == side)

    def hand_over(self, side: int) -> bool:
        """Give the other part the turn and wait for it back; False (and keep it) when the other has finished."""
        with self.changed:
            if self.finished[1 - side]:
                return False
            self.turn = 1 - side
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.turn == side)
            return True

    def finish(self, side: int) -> None:
        with self.changed:
            self.finished[side], self.turn = True, 1 - side
            self.changed.notify_all()


class Streams:
    """The accelerator's current stream, and making it another thread's: an accelerator's current stream and device
    are the calling thread's own (torch.accelerator); a CPU has neither."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> Any:
        return torch.accelerator.current_stream(self.device) if self.device.type != "cpu" else None

    def use(self, stream: Any) -> None:
        if stream is not None:
            torch.accelerator.set_stream(stream)  # and its device


class Interleaved:
    """The two parts on two threads, the turn handed over at every all-to-all (module docstring)."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def run(self, parts: Sequence[Callable[[], Any]]) -> list[Any]:
        turns, results, errors = _Turns(), [None, None], []
        stream = self.streams.current()

        def run_part(side: int) -> None:
            turns.wait(side)
            if side:
                self.streams.use(stream)
            _seat.value = (turns, side)
            try:
                results[side] = parts[side]()
            except BaseException as error:  # noqa: BLE001  (re-raised on the calling thread)
                errors.append(error)
            finally:
                _seat.value = None
                turns.finish(side)

        backward = threading.Thread(target=run_part, args=(1,), name="pipeline pair: backward", daemon=True)
        backward.start()
        run_part(0)
        backward.join()
        if errors:
            raise errors[0]
        return results


def pair_runner(device: torch.device, experts_exchange: bool) -> PairRunner:
    """Interleaved where the model exchanges tokens between expert-parallel ranks (an all-to-all to hide), else
    sequential."""
    return Interleaved(Streams(device)) if experts_exchange else SEQUENTIAL


def travel(work: dist.Work, forward: bool) -> None:
    """Called right after posting a collective: while a pair runs, the other part runs until it posts one of its
    own (not inside a recompute: `forward` and already in a backward); then wait for this one's result."""
    seat = getattr(_seat, "value", None)
    if seat is not None and not (forward and torch._C._current_graph_task_id() != -1):
        turns, side = seat
        turns.hand_over(side)
    work.wait()
