"""PairwiseCollator: padded (right / left), padding-free and prefix-shared layouts, by hand."""

import doctest

import pytest
import torch

from hf_rlhf.collators import PairwiseCollator, pairwise
from hf_rlhf.collators.pairwise import prefix_sharing_mask, shared_prefix_length

PAIRS = [
    {"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2, 4, 5]},
    {"chosen_ids": [6, 7], "rejected_ids": [8]},
]


def test_docstring_examples_run():
    result = doctest.testmod(pairwise, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0


def test_right_padding_chosen_first():
    batch = PairwiseCollator(pad_token_id=0)(PAIRS)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 7, 0, 0], [1, 2, 4, 5], [8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert set(batch) == {"input_ids", "attention_mask"}


def test_left_padding_and_multiple_of():
    batch = PairwiseCollator(pad_token_id=9, padding_side="left", pad_to_multiple_of=3)(PAIRS)
    assert batch["input_ids"].tolist() == [[9, 9, 9, 1, 2, 3], [9, 9, 9, 9, 6, 7], [9, 9, 1, 2, 4, 5],
                                           [9, 9, 9, 9, 9, 8]]
    assert batch["attention_mask"][:, -1].tolist() == [1, 1, 1, 1]
    # positions count real tokens only, so that absolute position embeddings (GPT-2) do not see the padding
    assert batch["position_ids"].tolist() == [[0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 2, 3],
                                              [0, 0, 0, 0, 0, 0]]


def test_margin_is_a_float_tensor_and_must_be_in_every_row():
    rows = [dict(PAIRS[0], margin=1), dict(PAIRS[1], margin=0.25)]
    for layout in ({}, {"padding_free": True}, {"prefix_sharing": True}):
        batch = PairwiseCollator(pad_token_id=0, **layout)(rows)
        assert batch["margin"].dtype == torch.float32 and batch["margin"].tolist() == [1.0, 0.25]
    with pytest.raises(ValueError, match="row 1 has no 'margin'"):
        PairwiseCollator(pad_token_id=0)([rows[0], PAIRS[1]])


def test_padding_free_row():
    batch = PairwiseCollator(pad_token_id=0, padding_free=True, return_flash_attention_kwargs=True)(PAIRS)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 6, 7, 1, 2, 4, 5, 8]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]]
    assert batch["last_token_index"].tolist() == [2, 4, 8, 9]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 10] and batch["max_length_k"] == 4
    assert "attention_mask" not in batch and "labels" not in batch


def test_padding_free_pad_to_multiple_of_adds_one_dummy_sequence_not_read():
    batch = PairwiseCollator(pad_token_id=0, padding_free=True, pad_to_multiple_of=8)(PAIRS)
    assert batch["input_ids"].shape == (1, 16)
    assert batch["position_ids"][0, 10:].tolist() == list(range(6))
    assert batch["last_token_index"].tolist() == [2, 4, 8, 9]


def test_shared_prefix_length_leaves_each_side_a_token():
    assert shared_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert shared_prefix_length([1, 2, 3], [1, 2]) == 1
    assert shared_prefix_length([1, 2], [1, 2, 3]) == 1
    assert shared_prefix_length([5], [6]) == 0
    assert shared_prefix_length([5, 1], [6, 1]) == 0


def test_prefix_sharing_rows_positions_and_indices():
    batch = PairwiseCollator(pad_token_id=0, prefix_sharing=True)(PAIRS)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    # rejected tail positions continue from the shared prefix, as if the chosen tail were absent
    assert batch["position_ids"].tolist() == [[0, 1, 2, 2, 3], [0, 1, 0, 0, 0]]
    # flat positions in (B * T): chosen ends (2, 5 + 1), rejected ends (4, 5 + 2)
    assert batch["last_token_index"].tolist() == [2, 6, 4, 7]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0],
                                         [1, 1, 1, 0, 0],
                                         [1, 1, 0, 1, 0],   # rejected tail: prefix + itself, not the chosen tail
                                         [1, 1, 0, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0],
                                         [0, 0, 1, 0, 0],   # no shared prefix: rejected sees only itself
                                         [1, 1, 1, 0, 0],   # padding queries: causal over real keys
                                         [1, 1, 1, 0, 0]]


def test_prefix_sharing_mask_has_no_empty_row():
    segments = torch.tensor([[0, 0, 1, 2, 2, -1, -1], [1, 1, 2, -1, -1, -1, -1]])
    assert prefix_sharing_mask(segments).any(-1).all()


@pytest.mark.parametrize("layout", [{}, {"padding_free": True}, {"prefix_sharing": True}])
def test_missing_or_empty_sides_are_errors(layout):
    collator = PairwiseCollator(pad_token_id=0, **layout)
    with pytest.raises(ValueError, match="row 1 has no 'rejected_ids'"):
        collator([PAIRS[0], {"chosen_ids": [1]}])
    with pytest.raises(ValueError, match="row 0 has an empty 'chosen_ids'"):
        collator([{"chosen_ids": [], "rejected_ids": [1]}])


def test_bad_options():
    with pytest.raises(ValueError, match="choose one"):
        PairwiseCollator(pad_token_id=0, padding_free=True, prefix_sharing=True)
    with pytest.raises(ValueError, match="padding_side"):
        PairwiseCollator(pad_token_id=0, padding_side="middle")
    with pytest.raises(ValueError, match="pad token"):
        PairwiseCollator(pad_token_id=None)
