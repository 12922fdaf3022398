"""Replaying every rank's recorded calls (record.py) as NCCL would run them (the rules: nccl_rules/__init__.py):
every call that could never finish, every message delivered to another receive than under gloo, every size
or collective mismatch.

Where the calls of different communicators run is a choice too. NCCL runs each communicator's calls on a stream
of its own, and side by side they progress independently; but its user guide ("Using multiple NCCL
communicators concurrently") promises that only as long as the GPU can hold all their kernels at once, and asks
for the calls to be posted in one order on every rank. `streams="one per rank"` replays every call of a rank in
one queue, in post order, as a GPU that holds one kernel at a time would: code whose calls on several
communicators are posted in one global order (the pipeline's exchanges, each pair of ranks on its own
communicator) must pass that too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from megalite.dryrun.nccl_rules.record import Call, RankRecord

# Where a single isend/irecv runs: a two-rank communicator of its own ("pair"), or the group's ("group", when the
# group was bound to a device). Both are replayed.
P2P_COMMUNICATORS = ("pair", "group")
# Where the calls of different communicators run: on a stream per communicator, or all of a rank's in one queue.
STREAMS = ("per communicator", "one per rank")


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    calls: int = 0
    messages: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        return "\n".join(self.problems[:40])


class _Replay:
    """One replay under one choice of p2p communicators and of streams: the streams' queues, message channels
    and the started/completed fixpoint."""

    def __init__(self, records: dict[int, RankRecord], communicators: str, streams: str = STREAMS[0]) -> None:
        self.communicators, self.streams_per, self.report = communicators, streams, Report()
        self.calls = {(r, c.index): c for r, rec in records.items() for c in rec.calls}
        self.report.calls = len(self.calls)
        self.streams: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        self.waits: dict[int, list[int]] = {r: [i for kind, i in rec.events if kind == "wait"]
                                            for r, rec in records.items()}
        self.waits_before: dict[tuple[int, int], int] = {}
        for r, rec in records.items():
            waited = 0
            for kind, item in rec.events:
                if kind == "wait":
                    waited += 1
                else:
                    self.waits_before[(r, item.index)] = waited
                    self.streams[(r, self._stream(item))].append((r, item.index))
        self.partners = self._match()

    def _stream(self, call: Call) -> tuple:
        return ("rank",) if self.streams_per == "one per rank" else self._communicator(call)

    def _communicator(self, call: Call, peer: int | None = None) -> tuple:
        if call.single and self.communicators == "pair":
            peer = call.messages[0].peer if peer is None else peer
            return ("pair", call.comm, min(call.rank, peer), max(call.rank, peer))
        return ("group", call.comm)

    def _match(self) -> dict[tuple[int, int], set[tuple[int, int]]]:
        """Pair sends with receives in post order per communicator and direction, collectives in post
        order per communicator; note every mismatch. Returns each call's partner calls."""
        sends, recvs, collectives = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(list))
        for key in sorted(self.calls):
            call = self.calls[key]
            for message in call.messages:
                src, dst = (call.rank, message.peer) if message.send else (message.peer, call.rank)
                channel = (self._communicator(call, message.peer), src, dst)
                (sends if message.send else recvs)[channel].append((key, message))
            if not call.messages:
                collectives[call.comm][call.rank].append(key)
        partners: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
        for channel in sends.keys() | recvs.keys():
            self._pair_messages(channel, sends[channel], recvs[channel], partners)
        for comm, per_rank in collectives.items():
            self._pair_collectives(comm, per_rank, partners)
        return partners

    def _pair_messages(self, channel: tuple, sent: list, received: list, partners: dict) -> None:
        _, src, dst = channel
        self.report.messages += min(len(sent), len(received))
        for (skey, s), (rkey, r) in zip(sent, received):
            partners[skey].add(rkey)
            partners[rkey].add(skey)
            if s.nbytes != r.nbytes or s.dtype != r.dtype:
                self._problem(f"size mismatch: {self.calls[skey].describe()} sends {s.nbytes} bytes {s.dtype} "
                              f"into {self.calls[rkey].describe()} which expects {r.nbytes} bytes {r.dtype}")
            elif r.digest is not None and s.digest != r.digest:
                self._problem(f"wrong message: NCCL matches {self.calls[skey].describe()} with "
                              f"{self.calls[rkey].describe()}, but that receive got other data under gloo "
                              "(messages between two ranks must be received in the order they are sent; "
                              "tags are ignored)")
        for key, _ in sent[len(received):]:
            self._problem(f"send {src}->{dst} never received: {self.calls[key].describe()}")
        for key, _ in received[len(sent):]:
            self._problem(f"receive {src}->{dst} never sent: {self.calls[key].describe()}")

    def _pair_collectives(self, comm: str, per_rank: dict[int, list], partners: dict) -> None:
        members = self.calls[next(iter(per_rank.values()))[0]].members
        counts = {r: len(per_rank.get(r, [])) for r in members}
        if len(set(counts.values())) > 1:
            self._problem(f"group {comm}: members post different numbers of collectives {counts}")
        for position in range(min(counts.values())):
            keys = [per_rank[r][position] for r in members]
            shapes = {(self.calls[k].name, self.calls[k].nbytes, self.calls[k].dtype) for k in keys}
            if len(shapes) > 1:
                self._problem(f"group {comm}: collective #{position} differs across members: "
                              + "; ".join(self.calls[k].describe() for k in keys))
            if all(self.calls[k].splits is not None for k in keys):
                self._pair_all_to_all([self.calls[k] for k in keys])
            for key in keys:
                partners[key].update(k for k in keys if k != key)

    def _pair_all_to_all(self, calls: list[Call]) -> None:
        """Member i's bytes to member j are what j expects from i."""
        for i, sender in enumerate(calls):
            for j, receiver in enumerate(calls):
                if sender.splits[0][j] != receiver.splits[1][i]:
                    self._problem(f"all-to-all size mismatch: {sender.describe()} sends {sender.splits[0][j]} bytes "
                                  f"to {receiver.describe()}, which expects {receiver.splits[1][i]}")

    def _problem(self, text: str) -> None:
        streams = "" if self.streams_per == STREAMS[0] else f", {self.streams_per} stream"
        self.report.problems.append(f"[{self.communicators} communicators{streams}] {text}")

    def run(self) -> Report:
        started, done = set(), set()
        heads = {stream: 0 for stream in self.streams}
        self.waited_done = waited_done = dict.fromkeys(self.waits, 0)
        progress = True
        while progress:
            progress = False
            for stream, queue in self.streams.items():
                while heads[stream] < len(queue):
                    key = queue[heads[stream]]
                    if key not in started and waited_done[key[0]] >= self.waits_before[key]:
                        started.add(key)
                        progress = True
                    if key not in started or not self.partners[key] <= started:
                        break
                    done.add(key)
                    heads[stream] += 1
                    progress = True
            for rank, waits in self.waits.items():
                while waited_done[rank] < len(waits) and (rank, waits[waited_done[rank]]) in done:
                    waited_done[rank] += 1
        self._report_hang(started, done, heads)
        return self.report

    def _report_hang(self, started: set, done: set, heads: dict) -> None:
        for stream, queue in self.streams.items():
            if heads[stream] >= len(queue):
                continue
            key = queue[heads[stream]]
            call = self.calls[key]
            if key in started:
                missing = sorted(self.partners[key] - started)
                why = "its peers' matching calls never start: " + "; ".join(self.calls[k].describe() for k in missing)
            else:
                blocker = self.calls[(key[0], self.waits[key[0]][self.waited_done[key[0]]])]
                why = f"it waits for compute that waits for {blocker.describe()}"
            self._problem(f"hang: {call.describe()} never completes: {why}")


def replay(records: dict[int, RankRecord] | list[RankRecord], communicators: tuple[str, ...] = P2P_COMMUNICATORS,
           streams: tuple[str, ...] = STREAMS[:1]) -> Report:
    """Replay every rank's record under NCCL's rules for each choice of p2p communicators and of streams
    (module docstring; `STREAMS` for both)."""
    if isinstance(records, list):
        records = {record.rank: record for record in records}
    total = Report()
    for choice in communicators:
        for where in streams:
            report = _Replay(records, choice, where).run()
            total.problems += report.problems
            total.calls, total.messages = report.calls, max(total.messages, report.messages)
    return total
