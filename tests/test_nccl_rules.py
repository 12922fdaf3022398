"""NCCL's ordering rules, checked without a GPU: every point-to-point call and collective that gloo
ranks really make is recorded and replayed as NCCL would run it (megalite/dryrun/nccl_rules/).

The replay is first shown to catch each kind of NCCL-only failure on small hand-made programs (pair
exchanges posted out of one global order among them); then it checks the pipeline executor for every schedule
(the zero-bubble ones and DualPipeV too), pp, vp and micro batch counts the validator allows, with the
neighbour pairs' communicators side by side and one after another, and whole training and evaluation steps with
tp, SP, dp and the distributed optimizer.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import cpu_topology, run_ranks

from megalite.config_cli import parse_config
from megalite.dryrun.nccl_rules.record import Call, CommRecorder, Message, RankRecord
from megalite.dryrun.nccl_rules.replay import STREAMS, replay
from megalite.dryrun.pipeline_plan import SHAPE, record_schedule
from megalite.parallel.p2p import Message as PipelineMessage
from megalite.parallel.p2p import PipelineComm, coalescing_device, post_batch
from megalite.parallel.pipeline.registry import schedule_spec
from megalite.training.pretrain import pretrain


def _ring_sends_first(rank: int, world_size: int) -> RankRecord:
    """Each rank sends to the next, then receives from the previous, as single calls."""
    out, inbox = torch.full((4,), float(rank)), torch.empty(4)
    with CommRecorder(rank) as recorder:
        send = dist.isend(out, (rank + 1) % world_size)
        recv = dist.irecv(inbox, (rank - 1) % world_size)
        send.wait()
        recv.wait()
    return recorder.record


def _tags_reorder(rank: int, world_size: int) -> RankRecord:
    """Rank 0 sends A then B; rank 1 receives B first (by tag), which only gloo can do."""
    with CommRecorder(rank) as recorder:
        if rank == 0:
            works = [dist.isend(torch.full((4,), value), 1, tag=tag) for tag, value in ((1, 1.0), (2, 2.0))]
        else:
            a, b = torch.empty(4), torch.empty(4)
            works = [dist.irecv(b, 0, tag=2), dist.irecv(a, 0, tag=1)]
        for work in works:
            work.wait()
    return recorder.record


def _batched_exchange(rank: int, world_size: int) -> RankRecord:
    """The same ring as one batch per rank: sends and receives progress together."""
    inbox = torch.empty(4)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), (rank + 1) % world_size),
           dist.P2POp(dist.irecv, inbox, (rank - 1) % world_size)]
    with CommRecorder(rank) as recorder:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.all_reduce(inbox)
    return recorder.record


def test_replay_catches_a_hang_that_depends_on_the_communicator_placement():
    records = run_ranks(3, _ring_sends_first, observed_groups=True)
    assert replay(records, ("pair",)).ok  # each pair of ranks has its own communicator and stream
    report = replay(records, ("group",))
    assert not report.ok and "hang" in report.text(), report.text()


def test_replay_catches_messages_that_nccl_would_swap():
    report = replay(run_ranks(2, _tags_reorder, observed_groups=True))
    assert "wrong message" in report.text(), report.text()


def test_replay_accepts_a_batched_exchange_and_counts_what_it_saw():
    report = replay(run_ranks(3, _batched_exchange, observed_groups=True))
    assert report.ok, report.text()
    assert report.calls == 6 and report.messages == 3


def _pipeline_exchange(rank: int, world_size: int) -> tuple[RankRecord, list[float], bool]:
    """One exchange of a pipeline pair: rank 0 sends an activation and receives a gradient, rank 1 the reverse,
    posted by PipelineComm (post_batch, not torch's batch_isend_irecv)."""
    comm = PipelineComm(cpu_topology(rank, world_size, pp=world_size), (4,), torch.float32)
    messages = [PipelineMessage("F", 0, 0, 0, 1), PipelineMessage("B", 0, 0, 1, 0)]
    outbox = {messages[rank]: torch.full((4,), float(rank + 1))}
    with CommRecorder(rank) as recorder:
        exchange = comm.exchange(messages, outbox)
        exchange.wait()
    (received,) = exchange.received.values()
    return recorder.record, received.tolist(), coalescing_device(comm.groups[(0, 1)], torch.device("cpu")) is None


def test_a_pipeline_exchange_is_recorded_as_one_batch_and_its_data_travels():
    """megalite posts an exchange's sends and receives on the pair's group itself (post_batch): the recorder takes
    them as one batched call, as it takes torch's batch_isend_irecv, so the replay runs them as NCCL runs a batch."""
    per_rank = run_ranks(2, _pipeline_exchange, observed_groups=True)
    for rank, (record, received, uncoalesced) in enumerate(per_rank):
        (call,) = record.calls
        assert call.name == "batch_isend_irecv" and not call.single and len(call.messages) == 2
        assert [message.send for message in call.messages] == [rank == 0, rank == 1]
        assert received == [float(2 - rank)] * 4 and uncoalesced  # gloo does not coalesce: a work per message
    report = replay([record for record, _, _ in per_rank], streams=STREAMS)
    assert report.ok and report.calls == 2 and report.messages == 2, report.text()


class _CoalescingGroup:
    """Stands in for an NCCL process group: records the calls made on it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _start_coalescing(self, device: torch.device) -> None:
        self.calls.append(("start", device))

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.calls.append(("send", tensors[0], peer, tag))
        return "send work"

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.calls.append(("recv", tensors[0], peer, tag))
        return "recv work"

    def _end_coalescing(self, device: torch.device) -> str:
        self.calls.append(("end", device))
        return "batch work"


def test_a_batch_on_a_coalescing_backend_is_one_group_of_calls_with_one_work():
    """Where the backend coalesces (NCCL), post_batch makes the calls torch's batch_isend_irecv makes: the sends and
    receives in the given order between the group's start and end of coalescing, one work for the batch."""
    group, device, out, inbox = _CoalescingGroup(), torch.device("cpu"), torch.ones(2), torch.empty(2)
    assert post_batch(group, device, [(True, out, 1), (False, inbox, 0)]) == ["batch work"]
    assert group.calls == [("start", device), ("send", out, 1, 0), ("recv", inbox, 0, 0), ("end", device)]
    plain = _CoalescingGroup()
    assert post_batch(plain, None, [(True, out, 1), (False, inbox, 0)]) == ["send work", "recv work"]
    assert [call[0] for call in plain.calls] == ["send", "recv"]


def _pairs_in_order(rank: int, world_size: int, global_order: bool) -> RankRecord:
    """A ring of three, each neighbour pair on a communicator of its own: each rank sends to the next and
    receives from the previous, one batch per pair, posting the pairs in one global order (lower pair
    first) or each its send first."""
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    out, inbox = torch.full((4,), float(rank)), torch.empty(4)
    batches = {nxt: ("isend", out), prev: ("irecv", inbox)}
    pairs = {pair: dist.new_group(list(pair)) for pair in ((0, 1), (1, 2), (0, 2))}  # every rank makes all, in order
    groups = {peer: pairs[tuple(sorted((rank, peer)))] for peer in batches}
    order = sorted(batches, key=lambda peer: sorted((rank, peer))) if global_order else [nxt, prev]
    with CommRecorder(rank) as recorder:
        works = [work for peer in order for work in dist.batch_isend_irecv(
            [dist.P2POp(getattr(dist, batches[peer][0]), batches[peer][1], group=groups[peer],
                        group_peer=dist.get_group_rank(groups[peer], peer))])]
        for work in works:
            work.wait()
    return recorder.record


def test_replay_rejects_pair_exchanges_posted_out_of_one_global_order():
    """Each pair on its own communicator: side by side (a stream each) any order finishes; run one after another
    (NCCL's caveat for concurrent communicators) only one global order does, and the replay says so."""
    for global_order in (True, False):
        records = run_ranks(3, _pairs_in_order, global_order, observed_groups=True)
        assert replay(records, streams=STREAMS[:1]).ok
        report = replay(records, streams=STREAMS)
        assert report.ok == global_order, report.text()
        assert global_order or "[pair communicators, one per rank stream] hang" in report.text(), report.text()


def test_replay_catches_size_and_collective_mismatches():
    def call(rank: int, index: int, name: str, *messages: Message, nbytes: int | None = None) -> Call:
        return Call(rank, index, name, "0", (0, 1), list(messages), nbytes, "torch.float32" if nbytes else None)

    records = [RankRecord(0, [("post", call(0, 0, "isend", Message(True, 1, 16, "torch.float32", "x"))),
                              ("post", call(0, 1, "all_reduce", nbytes=8))]),
               RankRecord(1, [("post", call(1, 0, "irecv", Message(False, 0, 32, "torch.float32", "x"))),
                              ("post", call(1, 1, "all_reduce", nbytes=4))])]
    text = replay(records).text()
    assert "size mismatch" in text and "collective #0 differs" in text, text


def _schedule_cases(pp: int) -> list[tuple[str, int, int]]:
    """(schedule, vp, micro batches) the validator allows: any count for vp=1, multiples of pp for vp>1."""
    cases = [("1f1b", 1, m) for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp, 3 * pp} - {0})]
    cases += [("1f1b", vp, m) for vp in (2, 3) for m in (pp, 2 * pp, 3 * pp)]
    cases += [("gpipe", 1, m) for m in (1, pp, 2 * pp + 1)]
    cases += [("forward", vp, m) for vp in (1, 3) for m in (1, pp, 2 * pp + 1) if vp == 1 or m % pp == 0]
    cases += [("zb-h1", 1, m) for m in sorted({1, pp - 1, pp, 2 * pp + 1} - {0})]
    cases += [("zb-h1", 2, m) for m in (pp, 2 * pp)] + [("zb-v", 2, m) for m in (1, 2 * pp - 1, 2 * pp + 1)]
    cases += [("dualpipev", 2, m) for m in (2 * pp, 3 * pp + 1)]
    return cases


def _executor_ranks(rank: int, world_size: int) -> list[tuple[tuple, RankRecord]]:
    """Run the executor with a toy model per case: each chunk scales its input by its own weight."""
    topology = cpu_topology(rank, world_size, pp=world_size)
    comm = PipelineComm(topology, SHAPE, torch.float32)
    return [((name, vp, m), record_schedule(name, m, schedule_spec(name).stage(world_size, vp, rank), comm))
            for name, vp, m in _schedule_cases(world_size)]


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_pipeline_executor_obeys_nccl_rules(pp):
    per_rank = run_ranks(pp, _executor_ranks, observed_groups=True)
    failures = []
    for index, (case, _) in enumerate(per_rank[0]):
        report = replay([results[index][1] for results in per_rank], streams=STREAMS)
        assert report.messages > 0 or case[2] == 0
        if not report.ok:
            failures.append(f"{case}: {report.text().splitlines()[0]}")
    assert not failures, f"{len(failures)} of {len(per_rank[0])} cases fail under NCCL's rules:\n" + "\n".join(failures)


TINY = ["--logging.progress_bar=false", "--logging.log_interval=1", "--data.mock=true", "--data.num_workers=0",
        "--train.device=cpu", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
        "--model.vocab_size=250", "--train.micro_batch_size=1", "--train.train_iters=2", "--train.eval_interval=2",
        "--train.eval_iters=1", "--checkpoint.save_interval=2"]
# Whole runs (two training steps, an evaluation, a checkpoint save) at world size 8.
RUNS = {
    "llama MoE tp2 x pp2 (vp2) x dp2, SP, ep2 x etp2 (all-to-all and uneven all-gathers), ZeRO-1, bf16, Muon":
        ["--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=4", "--model.num_experts=8",
         "--model.moe_topk=2", "--model.moe_ffn_hidden_size=16", "--model.moe_first_dense_layers=1",
         "--model.moe_aux_loss_coeff=0.01", "--model.moe_shared_expert_size=16", "--model.moe_expert_bias=true",
         "--parallel.ep=2", "--parallel.etp=2",
         "--parallel.tp=2", "--parallel.pp=2", "--parallel.vp=2", "--parallel.sequence_parallel=true",
         "--parallel.distributed_optimizer=true", "--train.precision=bf16", "--train.param_dtype=bf16",
         "--train.global_batch_size=8", "--parallel.bucket_size=2000", "--optim.optimizer=muon"],
    "gpt2 tp2 x pp2 (vp2) x dp2, SP, distributed optimizer, overlapped gathers, bf16 parameters":
        ["--model.family=gpt2", "--model.num_layers=4", "--parallel.tp=2", "--parallel.pp=2", "--parallel.vp=2",
         "--parallel.sequence_parallel=true", "--parallel.distributed_optimizer=true",
         "--parallel.overlap_param_gather=true", "--train.precision=bf16", "--train.param_dtype=bf16",
         "--train.global_batch_size=8", "--parallel.bucket_size=2000"],
    "llama tp2 x pp4, SP, uneven first/last stages": [
        "--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=6", "--parallel.tp=2",
        "--parallel.pp=4", "--parallel.sequence_parallel=true", "--parallel.first_stage_layers=1",
        "--parallel.last_stage_layers=1", "--train.global_batch_size=6"],
    "gpt2 pp8 GPipe": ["--model.family=gpt2", "--model.num_layers=8", "--parallel.pp=8",
                       "--parallel.pipeline_schedule=gpipe", "--train.global_batch_size=3"],
    "llama pp2 (vp3) x dp4, distributed optimizer": [
        "--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=6", "--parallel.pp=2",
        "--parallel.vp=3", "--parallel.distributed_optimizer=true", "--train.global_batch_size=16",
        "--parallel.bucket_size=3000"],
    "gpt2 tp2 x pp2 x dp2, SP, ZeRO-2 (reduce-scatter per micro batch), CPU offload, tied embeddings": [
        "--model.family=gpt2", "--model.num_layers=4", "--parallel.tp=2", "--parallel.pp=2",
        "--parallel.sequence_parallel=true", "--parallel.zero_stage=2", "--optim.offload=cpu",
        "--train.global_batch_size=4",
        "--parallel.bucket_size=2000"],
    "llama tp2 x pp2 (vp2) x dp2, SP, ZeRO-3 (gathers per layer, prefetched), full recompute, bf16 parameters": [
        "--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=4", "--parallel.tp=2",
        "--parallel.pp=2", "--parallel.vp=2", "--parallel.sequence_parallel=true", "--parallel.zero_stage=3",
        "--train.recompute=full", "--train.precision=bf16", "--train.param_dtype=bf16",
        "--train.global_batch_size=8", "--parallel.bucket_size=2000"],
    "gpt2 pp2 x dp4, ZeRO-3, tied embeddings across stages (multi-token prediction reading the head's copy), CPU "
    "offload, Muon": [
        "--model.family=gpt2", "--model.num_layers=2", "--parallel.pp=2", "--parallel.zero_stage=3",
        "--optim.offload=cpu", "--train.global_batch_size=8", "--optim.optimizer=muon", "--model.mtp_num_layers=1"],
    "llama cp2 x tp2 x pp2, SP, ring attention (selective recompute reruns the ring), bf16 parameters": [
        "--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=4", "--parallel.cp=2",
        "--parallel.tp=2", "--parallel.pp=2", "--parallel.sequence_parallel=true", "--train.recompute=selective",
        "--train.precision=bf16", "--train.param_dtype=bf16", "--train.global_batch_size=4"],
    "llama MoE pp2 (DualPipeV) x dp4, ep4 (all-to-alls of F&B pairs interleaved), full recompute, multi-token "
    "prediction (its MoE layer on the first rank, its copy of the embeddings)": [
        "--model.family=llama", "--model.num_query_groups=2", "--model.num_layers=4", "--model.num_experts=8",
        "--model.moe_topk=2", "--model.moe_ffn_hidden_size=16", "--parallel.ep=4", "--parallel.pp=2",
        "--parallel.vp=2", "--parallel.pipeline_schedule=dualpipev", "--train.recompute=full",
        "--train.global_batch_size=16", "--model.mtp_num_layers=1"],
    "latent attention cp2 x tp2 x pp2, SP, tensorwise FP8 (the down-projections' amax over the sequence ranks), "
    "selective recompute (rerunning the up-projections' gathers)": [
        "--model.family=llama", "--model.num_layers=2", "--model.multi_latent_attention=true",
        "--model.num_query_groups=null", "--model.q_lora_rank=16", "--model.kv_lora_rank=16",
        "--model.qk_head_dim=8", "--model.qk_pos_emb_head_dim=8", "--model.v_head_dim=8", "--parallel.cp=2",
        "--parallel.tp=2", "--parallel.pp=2", "--parallel.sequence_parallel=true", "--train.recompute=selective",
        "--train.fp8_recipe=tensorwise", "--train.global_batch_size=2"],
    "gpt2 cp4 x pp2, ring attention, distributed optimizer over dp x cp": [
        "--model.family=gpt2", "--model.num_layers=2", "--parallel.cp=4", "--parallel.pp=2",
        "--parallel.distributed_optimizer=true", "--train.global_batch_size=4"],
}


def _training_ranks(rank: int, world_size: int, root: str) -> list[RankRecord]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    records = []
    for index, args in enumerate(RUNS.values()):
        with CommRecorder(rank) as recorder:
            pretrain(parse_config([*TINY, *args, f"--checkpoint.save={root}/run{index}"]))
        records.append(recorder.record)
    return records


def test_training_runs_obey_nccl_rules(tmp_path):
    per_rank = run_ranks(8, _training_ranks, str(tmp_path), observed_groups=True)
    for index, layout in enumerate(RUNS):
        report = replay([records[index] for records in per_rank])
        assert report.ok, f"{layout}:\n{report.text()}"
        assert report.messages > 0, layout
        if "all-to-all" in layout:
            assert any(call.name == "all_to_all_single" and call.splits[0] != call.splits[1]
                       for records in per_rank for call in records[index].calls), "no uneven all-to-all replayed"
        if "Muon" in layout:  # its owners' exchange: one all-to-all each way over the world, every rank's call
            assert all(any(call.name == "all_to_all_single" and len(call.members) == 8 and "muon" in call.where
                           for call in records[index].calls) for records in per_rank), "no Muon exchange replayed"
        if "DualPipeV" in layout:
            assert all(_travelled(records[index]) for records in per_rank), "no all-to-all travelled in a pair"


def _travelled(record: RankRecord) -> bool:
    """Some all-to-all had another call posted between its post and its wait: the other part of a paired
    operation ran while it travelled."""
    posted: dict[int, int] = {}
    for position, (kind, item) in enumerate(record.events):
        if kind == "post" and item.name == "all_to_all_single":
            posted[item.index] = position
        elif kind == "wait" and item in posted and any(k == "post" for k, _ in
                                                         record.events[posted[item] + 1:position]):
            return True
    return False
