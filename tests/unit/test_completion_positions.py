"""Where a DPO forward needs logits (`use_logits_to_keep`): `padded_gather_index` and `logits_to_keep_per_row` on
hand-computed tensors, and the statistics read through them equal the full logits' on random logits."""

import doctest

import torch
from torch.testing import assert_close

from hf_rlhf import tensors
from hf_rlhf.losses import dpo as dpo_losses
from hf_rlhf.losses.dpo import (
    completion_logps,
    gathered_completion_logps,
    logits_to_keep_per_row,
    padded_gather_index,
    token_statistics,
)


def test_docstring_examples():
    result = doctest.testmod(dpo_losses, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 2 and result.failed == 0
    assert doctest.testmod(tensors).failed == 0


def test_is_right_padded():
    assert tensors.is_right_padded(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]))
    assert not tensors.is_right_padded(torch.tensor([[1, 1, 0, 1]]))  # a hole
    assert not tensors.is_right_padded(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))  # left padding


def test_padded_gather_index_by_hand():
    # row 0: prompt 2 tokens, completion 3; row 1: a gap in the mask (kept in order); row 2: no completion token
    input_ids = torch.tensor([[9, 8, 1, 2, 3, 0], [9, 4, 5, 6, 7, 0], [9, 8, 7, 0, 0, 0]])
    completion_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    g = padded_gather_index(input_ids, completion_mask)
    assert torch.equal(g["row_index"], torch.tensor([0, 1, 2]))
    # the logit at t predicts token t + 1: completion tokens at 2, 3, 4 are predicted at 1, 2, 3
    assert torch.equal(g["logit_index"], torch.tensor([[1, 2, 3], [0, 2, 3], [0, 0, 0]]))
    assert torch.equal(g["target_ids"], torch.tensor([[1, 2, 3], [4, 6, 7], [0, 0, 0]]))
    assert torch.equal(g["gather_mask"], torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0]]))


def test_padded_gather_index_of_no_completion_keeps_one_masked_slot():
    g = padded_gather_index(torch.tensor([[5, 6]]), torch.tensor([[0, 0]]))
    assert g["logit_index"].shape == (1, 1) and g["gather_mask"].sum() == 0


def test_logits_to_keep_per_row_by_hand():
    # prefix sharing: B = 2 rows, chosen 0..1 then rejected 0..1
    row_index = torch.tensor([0, 1, 0, 1])
    logit_index = torch.tensor([[2, 3], [1, 0], [2, 5], [1, 4]])
    keep, column = logits_to_keep_per_row(row_index, logit_index, 2)
    assert torch.equal(keep, torch.tensor([[2, 3, 2, 5], [1, 0, 1, 4]]))
    assert torch.equal(column, torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]]))
    # padding-free: one row holds every sequence
    keep, column = logits_to_keep_per_row(torch.zeros(3, dtype=torch.long), torch.tensor([[1, 2], [4, 0], [6, 7]]), 1)
    assert torch.equal(keep, torch.tensor([[1, 2, 4, 0, 6, 7]]))
    assert torch.equal(column, torch.tensor([[0, 1], [2, 3], [4, 5]]))
    # padded: one sequence per row, the positions unchanged
    keep, column = logits_to_keep_per_row(torch.arange(2), torch.tensor([[3, 4], [2, 0]]), 2)
    assert torch.equal(keep, torch.tensor([[3, 4], [2, 0]])) and torch.equal(column, torch.tensor([[0, 1], [0, 1]]))


def kept_logits(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """What a forward with `logits_to_keep=keep` (R, K) returns, from its full (R, T, V) logits."""
    return torch.take_along_dim(logits, keep.unsqueeze(-1), dim=1)


def test_padded_statistics_through_kept_logits_equal_the_full_ones():
    torch.manual_seed(0)
    n, t, v = 4, 7, 5
    logits, input_ids = torch.randn(n, t, v), torch.randint(0, v, (n, t))
    completion_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0, 0],
                                    [0, 0, 0, 0, 1, 1, 0]])
    full = completion_logps(logits, input_ids, completion_mask, ld_alpha=0.5)
    g = padded_gather_index(input_ids, completion_mask)
    keep, column = logits_to_keep_per_row(g["row_index"], g["logit_index"], n)
    selected = kept_logits(logits, keep)[g["row_index"].unsqueeze(1), column]
    kept = token_statistics(selected, g["target_ids"], g["gather_mask"], ld_alpha=0.5)
    for key in ("logps", "lengths"):
        assert_close(kept[key], full[key])
    for key in ("entropy", "mean_logits", "log_sum_sq_probs"):  # per token: equal sums over the scored tokens
        assert_close((kept[key] * kept["mask"]).sum(1), (full[key] * full["mask"]).sum(1))


def test_prefix_shared_statistics_through_kept_logits_equal_the_full_ones():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 5)
    row_index = torch.tensor([0, 1, 0, 1])
    logit_index = torch.tensor([[2, 3], [1, 0], [2, 5], [1, 4]])
    target_ids, gather_mask = torch.randint(0, 5, (4, 2)), torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    full = gathered_completion_logps(logits, row_index, logit_index, target_ids, gather_mask)
    keep, column = logits_to_keep_per_row(row_index, logit_index, 2)
    kept = token_statistics(kept_logits(logits, keep)[row_index.unsqueeze(1), column], target_ids, gather_mask)
    assert_close(kept["logps"], full["logps"])
