"""Mock data needs no corpus and no tokenizer: a config that still names tokenizer files trains without them."""

from __future__ import annotations

import math

from megalite.training.pretrain import pretrain

MISSING = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/nonexistent/vocab.json",
           "merge_file": "/nonexistent/merges.txt"}


def test_mock_data_never_opens_the_tokenizer_files(tiny):
    losses = pretrain(tiny(data=MISSING, train={"train_iters": 2})).losses
    # the vocabulary is model.vocab_size (300), not GPT-2's 50257: the first loss is about ln(300)
    assert abs(losses[1] - math.log(300)) < 0.5
