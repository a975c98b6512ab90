"""SFT's logged metrics as pure functions: entropy over the loss tokens, real tokens of packed and padded batches."""

import math

import torch
from torch.testing import assert_close

from hf_rlhf.collators import PackingCollator
from hf_rlhf.trainers.metrics import real_token_count
from hf_rlhf.trainers.sft_trainer import packed_real_token_count, token_accuracy_counts, token_entropy_sum


def test_entropy_sum_over_loss_tokens_only():
    logits = torch.zeros(2, 4, 8)  # uniform: log 8 nats per position
    logits[1, 2] = torch.tensor([100.0] + [0.0] * 7)  # one near one-hot prediction: ~0 nats
    labels = torch.tensor([[5, 1, -100, 2], [5, 3, 4, -100]])
    # shifted labels: row 0 -> [1, -100, 2] (positions 0, 2); row 1 -> [3, 4, -100] (positions 0, 1)
    assert_close(token_entropy_sum(logits, labels), torch.tensor(4 * math.log(8)))
    labels[1, 3] = 7  # now position 2 of row 1, the one-hot one, counts too: it adds ~0
    assert_close(token_entropy_sum(logits, labels), torch.tensor(4 * math.log(8)), atol=1e-4, rtol=0)
    _, total = token_accuracy_counts(logits, labels)
    assert total == 5  # the mean entropy is the sum over accuracy's token count


def test_entropy_matches_a_direct_computation():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    labels[0, 2] = labels[2, 4] = -100
    probs = logits[:, :-1].softmax(-1)
    per_token = -(probs * probs.log()).sum(-1)
    assert_close(token_entropy_sum(logits, labels), per_token[labels[:, 1:] != -100].sum())


def test_real_tokens_of_packed_rows_leave_out_the_padding_sequence():
    features = [{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]}, {"input_ids": [1, 2], "seq_lengths": [2]},
                {"input_ids": [3, 4, 0], "seq_lengths": [3]}]  # a real 0 id (the pad id) inside a document
    batch = PackingCollator(pad_token_id=0, flatten=False)(features)
    assert batch["input_ids"].shape == (3, 5)
    count = packed_real_token_count(batch["input_ids"], batch["position_ids"], batch["labels"], 0)
    assert int(count) == 5 + 2 + 3
    flat = PackingCollator(pad_token_id=0, flatten=True)(features)  # one row, no padding
    assert int(packed_real_token_count(flat["input_ids"], flat["position_ids"], flat["labels"], 0)) == 10
    padded = PackingCollator(pad_token_id=0, flatten=True, pad_to_multiple_of=16)(features)
    assert padded["input_ids"].shape == (1, 16)
    assert int(packed_real_token_count(padded["input_ids"], padded["position_ids"], padded["labels"], 0)) == 10


def test_real_tokens_of_padded_batches_are_the_attention_mask():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0],
                                                                                            [1, 1, 0, 0]])}
    assert int(real_token_count(batch)) == 5
    assert int(real_token_count({"input_ids": torch.ones(1, 7, dtype=torch.long),
                                 "position_ids": torch.arange(7)[None]})) == 7
