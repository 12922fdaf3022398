"""Training runs with multi-token prediction: pretrain writes each depth's loss to the metrics file and to W&B
(offline here) beside the main loss, and a run saved at pp 2 (the head's stage holding MTP and its copy of the word
embeddings, which the checkpoint stores once, as the embedding) resumes at dp 2 as if never stopped. The runs share
one group of two spawned ranks."""

from __future__ import annotations

import pytest
from distributed import metrics, pretrain_each, run_ranks
from parity import LLAMA, TINY
from wandb_records import read_run

MTP = [*LLAMA, "--model.mtp_num_layers=2", "--model.mtp_loss_scaling_factor=0.3", "--train.train_iters=4"]
RUNS = {
    "dp 2": ["--logging.wandb_project=megalite-test", "--logging.wandb_mode=offline", "--logging.wandb_dir={root}"],
    "pp 2, saved at step 2": ["--parallel.pp=2", "--checkpoint.save={root}/pp2", "--train.exit_interval=2"],
    "dp 2, resumed": ["--checkpoint.load={root}/pp2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    run_ranks(2, pretrain_each, [[*TINY, *MTP, *(arg.format(root=root) for arg in extra),
                                  f"--logging.metrics_file={root}/run-{index}.jsonl"]
                                 for index, extra in enumerate(RUNS.values())])
    (wandb,) = (root / "wandb").glob("offline-run-*")
    return {name: metrics(root / f"run-{i}.jsonl") for i, name in enumerate(RUNS)} | {"W&B": read_run(wandb)}


def test_the_metrics_file_has_each_depths_loss_and_pp2_equals_dp2(runs):
    records = runs["dp 2"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["mtp_1_loss"] > 0 and r["mtp_2_loss"] > 0 and r["loss"] > 0 for r in records)
    saved = runs["pp 2, saved at step 2"]
    for mine, one in zip(saved, records[:2], strict=True):
        for key in ("loss", "grad_norm", "mtp_1_loss", "mtp_2_loss"):
            assert mine[key] == pytest.approx(one[key], rel=1e-5), key


def test_wandb_gets_each_depths_loss_beside_the_main_loss(runs):
    """The logging rank's W&B run has, at every step, the main loss and each depth's, as the metrics file has them."""
    logged = {r["_step"]: r for r in runs["W&B"]["history"]}
    assert sorted(logged) == [1, 2, 3, 4]
    for record in runs["dp 2"]:
        for key in ("loss", "mtp_1_loss", "mtp_2_loss"):
            assert logged[record["step"]][key] == pytest.approx(record[key], rel=1e-6), key


def test_a_run_saved_at_pp2_resumes_at_dp2(runs):
    resumed, reference = runs["dp 2, resumed"], runs["dp 2"][2:]
    assert [r["step"] for r in resumed] == [3, 4]
    for mine, one in zip(resumed, reference, strict=True):
        for key in ("loss", "grad_norm", "mtp_1_loss", "mtp_2_loss"):
            assert mine[key] == pytest.approx(one[key], rel=1e-5), key
