"""Collators on small hand-written features: exact tensors, label masks, position ids, errors."""

import doctest

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.collators import (
    LeftPaddingCollator,
    PackingCollator,
    PaddingCollator,
    packing,
    padding,
    position_ids_from_lengths,
)


def tensor(rows):
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("module", [packing, padding], ids=lambda module: module.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- position ids


def test_position_ids_from_lengths():
    assert_close(position_ids_from_lengths([3, 1, 2]), tensor([0, 1, 2, 0, 0, 1]))
    assert_close(position_ids_from_lengths([4]), tensor([0, 1, 2, 3]))


def test_position_ids_reject_empty_sequences():
    with pytest.raises(ValueError, match="must be >= 1"):
        position_ids_from_lengths([2, 0, 1])


# ---------------------------------------------------------------- PaddingCollator


def test_padding_right_with_completion_mask():
    collator = PaddingCollator(pad_token_id=0)
    batch = collator(
        [
            {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
            {"input_ids": [5, 6], "completion_mask": [0, 1]},
        ]
    )
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert_close(batch["input_ids"], tensor([[1, 2, 3, 4], [5, 6, 0, 0]]))
    assert_close(batch["attention_mask"], tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
    assert_close(batch["labels"], tensor([[-100, -100, 3, 4], [-100, 6, -100, -100]]))


def test_padding_without_completion_mask_trains_on_everything():
    batch = PaddingCollator(pad_token_id=9)([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert_close(batch["input_ids"], tensor([[1, 2], [3, 9]]))
    assert_close(batch["labels"], tensor([[1, 2], [3, -100]]))


def test_padding_completion_only_loss_off_ignores_mask():
    collator = PaddingCollator(pad_token_id=0, completion_only_loss=False)
    batch = collator([{"input_ids": [1, 2, 3], "completion_mask": [0, 0, 1]}])
    assert_close(batch["labels"], tensor([[1, 2, 3]]))


def test_padding_given_labels_and_assistant_masks():
    collator = PaddingCollator(pad_token_id=0, completion_only_loss=False, assistant_only_loss=True)
    batch = collator(
        [
            {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4], "assistant_masks": [0, 1, 0, 1]},
            {"input_ids": [5, 6, 7], "assistant_masks": [1, 1, 0]},
        ]
    )
    assert_close(batch["labels"], tensor([[-100, 2, -100, 4], [5, 6, -100, -100]]))


def test_padding_both_masks_combine():
    collator = PaddingCollator(pad_token_id=0, assistant_only_loss=True)
    batch = collator([{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1], "assistant_masks": [1, 1, 0, 1]}])
    assert_close(batch["labels"], tensor([[-100, 2, -100, 4]]))


def test_padding_left_and_multiple_of():
    collator = PaddingCollator(pad_token_id=0, pad_to_multiple_of=4, padding_side="left")
    batch = collator([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7]}])
    assert_close(batch["input_ids"], tensor([[0, 0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0, 6, 7]]))
    assert_close(batch["attention_mask"], tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]))
    assert_close(batch["labels"][1], tensor([-100] * 6 + [6, 7]))


def test_padding_accepts_tensor_features():
    batch = PaddingCollator(pad_token_id=0)([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3])}])
    assert_close(batch["input_ids"], tensor([[1, 2], [3, 0]]))


def test_padding_requires_pad_token_id():
    with pytest.raises(ValueError, match="tokenizer has no pad token; set tokenizer.pad_token or SFTConfig.pad_token"):
        PaddingCollator(pad_token_id=None)


def test_padding_rejects_prepacked_rows():
    with pytest.raises(ValueError, match="PackingCollator"):
        PaddingCollator(pad_token_id=0)([{"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}])


def test_missing_assistant_masks_is_named():
    collator = PaddingCollator(pad_token_id=0, assistant_only_loss=True)
    with pytest.raises(ValueError, match="row 1 has no 'assistant_masks'"):
        collator([{"input_ids": [1, 2], "assistant_masks": [1, 1]}, {"input_ids": [3]}])


def test_completion_mask_missing_from_some_rows_is_named():
    collator = PaddingCollator(pad_token_id=0)
    with pytest.raises(ValueError, match="row 0 has no 'completion_mask'"):
        collator([{"input_ids": [1, 2]}, {"input_ids": [3], "completion_mask": [1]}])


def test_mask_of_wrong_length_is_named():
    with pytest.raises(ValueError, match="'completion_mask' has length 2"):
        PaddingCollator(pad_token_id=0)([{"input_ids": [1, 2, 3], "completion_mask": [0, 1]}])


# ---------------------------------------------------------------- PackingCollator


def test_packing_concatenates_into_one_row():
    collator = PackingCollator()
    batch = collator(
        [
            {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
            {"input_ids": [4, 5], "completion_mask": [1, 1]},
            {"input_ids": [6, 7, 8, 9], "completion_mask": [0, 0, 1, 1]},
        ]
    )
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: it would hide the boundaries
    assert_close(batch["input_ids"], tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]]))
    assert_close(batch["position_ids"], tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    # -100 at each example's first token (here example 2's, whose completion_mask is 1 there) and on prompts.
    assert_close(batch["labels"], tensor([[-100, 2, 3, -100, 5, -100, -100, 8, 9]]))


def test_packing_given_labels_and_assistant_masks():
    collator = PackingCollator(completion_only_loss=False, assistant_only_loss=True)
    batch = collator(
        [
            {"input_ids": [1, 2, 3], "labels": [11, 12, 13], "assistant_masks": [1, 0, 1]},
            {"input_ids": [4, 5], "labels": [14, 15], "assistant_masks": [1, 1]},
        ]
    )
    assert_close(batch["labels"], tensor([[-100, -100, 13, -100, 15]]))


def test_packing_flash_attention_kwargs():
    batch = PackingCollator(return_flash_attention_kwargs=True)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[key].dtype == torch.int32
        assert_close(batch[key], torch.tensor([0, 3, 5], dtype=torch.int32))
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    assert type(batch["max_length_q"]) is int


def test_packing_prepacked_rows_restart_positions_per_sub_sequence():
    collator = PackingCollator(return_flash_attention_kwargs=True)
    batch = collator(
        [
            {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]},
            {"input_ids": [6, 7], "seq_lengths": [2]},
            {"input_ids": [8, 9, 10]},  # a plain example can share the batch with pre-packed rows
        ]
    )
    assert_close(batch["position_ids"], tensor([[0, 1, 2, 0, 1, 0, 1, 0, 1, 2]]))
    assert_close(batch["labels"], tensor([[-100, 2, 3, -100, 5, -100, 7, -100, 9, 10]]))
    assert_close(batch["cu_seq_lens_q"], torch.tensor([0, 3, 5, 7, 10], dtype=torch.int32))
    assert batch["max_length_q"] == 3


def test_packing_pad_to_multiple_of_adds_one_dummy_sequence():
    collator = PackingCollator(pad_to_multiple_of=4, pad_token_id=0, return_flash_attention_kwargs=True)
    batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert_close(batch["input_ids"], tensor([[1, 2, 3, 4, 5, 0, 0, 0]]))
    assert_close(batch["position_ids"], tensor([[0, 1, 2, 0, 1, 0, 1, 2]]))
    assert_close(batch["labels"], tensor([[-100, 2, 3, -100, 5, -100, -100, -100]]))
    assert_close(batch["cu_seq_lens_q"], torch.tensor([0, 3, 5, 8], dtype=torch.int32))


def test_packing_pad_to_multiple_of_when_already_a_multiple():
    batch = PackingCollator(pad_to_multiple_of=5)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert_close(batch["input_ids"], tensor([[1, 2, 3, 4, 5]]))


def test_packing_errors():
    with pytest.raises(ValueError, match="row 1 has an empty 'input_ids'"):
        PackingCollator()([{"input_ids": [1]}, {"input_ids": []}])
    with pytest.raises(ValueError, match="'seq_lengths' sum to 4"):
        PackingCollator()([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}])
    with pytest.raises(ValueError, match="row 0 has no 'assistant_masks'"):
        PackingCollator(assistant_only_loss=True)([{"input_ids": [1, 2]}])


def test_packing_unflattened_keeps_one_row_per_feature():
    collator = PackingCollator(flatten=False, pad_token_id=0)
    batch = collator(
        [
            {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]},
            {"input_ids": [6, 7], "seq_lengths": [2]},
            {"input_ids": [8, 9, 10]},  # a plain example is a row of its own
        ]
    )
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    # shorter rows end in one dummy sequence: pad tokens, labels -100, positions restarting at 0
    assert_close(batch["input_ids"], tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 0, 0]]))
    assert_close(batch["position_ids"], tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2], [0, 1, 2, 0, 1]]))
    assert_close(
        batch["labels"],
        tensor([[-100, 2, 3, -100, 5], [-100, 7, -100, -100, -100], [-100, 9, 10, -100, -100]]),
    )


def test_packing_unflattened_pad_to_multiple_of():
    batch = PackingCollator(flatten=False, pad_to_multiple_of=4, pad_token_id=9)(
        [{"input_ids": [1, 2, 3, 4], "seq_lengths": [2, 2]}, {"input_ids": [5, 6, 7]}]
    )
    assert_close(batch["input_ids"], tensor([[1, 2, 3, 4], [5, 6, 7, 9]]))
    assert_close(batch["position_ids"], tensor([[0, 1, 0, 1], [0, 1, 2, 0]]))
    assert_close(batch["labels"], tensor([[-100, 2, -100, 4], [-100, 6, 7, -100]]))


def test_packing_unflattened_holds_the_flattened_tokens():
    features = [
        {"input_ids": [1, 2, 3, 4, 5, 6], "completion_mask": [0, 1, 1, 0, 1, 1], "seq_lengths": [3, 3]},
        {"input_ids": [7, 8], "completion_mask": [0, 1], "seq_lengths": [2]},
    ]
    flat = PackingCollator()(features)
    rows = PackingCollator(flatten=False)(features)
    real = torch.tensor([[True] * 6, [True] * 2 + [False] * 4])
    for key in ("input_ids", "labels", "position_ids"):
        assert_close(rows[key][real], flat[key][0])


def test_packing_unflattened_does_not_change_features():
    features = [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]
    PackingCollator(flatten=False, pad_to_multiple_of=8)(features)
    assert features == [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]


def test_packing_flash_kwargs_need_flatten():
    with pytest.raises(ValueError, match="set flatten=True"):
        PackingCollator(flatten=False, return_flash_attention_kwargs=True)


def test_packing_and_padding_share_label_rules():
    features = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1], "assistant_masks": [1, 1, 0, 1]},
        {"input_ids": [5, 6, 7], "completion_mask": [0, 0, 1], "assistant_masks": [1, 1, 1]},
    ]
    flags = dict(completion_only_loss=True, assistant_only_loss=True)
    padded = PaddingCollator(pad_token_id=0, **flags)(features)
    packed = PackingCollator(**flags)(features)
    padded_labels = padded["labels"][padded["attention_mask"].bool()]
    # Packing only adds -100 on each example's first token, which no causal LM predicts anyway.
    padded_labels[[0, 4]] = -100
    assert_close(packed["labels"][0], padded_labels)


# ---------------------------------------------------------------- LeftPaddingCollator


def test_left_padding_with_passthrough():
    collator = LeftPaddingCollator(pad_token_id=0)
    batch = collator(
        [
            {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "prompt": "a b c", "answer": "7"},
            {"input_ids": [4], "attention_mask": [1], "prompt": "d", "answer": "12"},
        ]
    )
    assert set(batch) == {"input_ids", "attention_mask", "position_ids", "prompt", "answer"}
    assert_close(batch["input_ids"], tensor([[1, 2, 3], [0, 0, 4]]))
    assert_close(batch["attention_mask"], tensor([[1, 1, 1], [0, 0, 1]]))
    assert_close(batch["position_ids"], tensor([[0, 1, 2], [0, 0, 0]]))
    assert batch["prompt"] == ["a b c", "d"]
    assert batch["answer"] == ["7", "12"]


def test_left_padding_without_passthrough_drops_other_keys():
    batch = LeftPaddingCollator(pad_token_id=0, passthrough=False)([{"input_ids": [1], "answer": "x"}])
    assert set(batch) == {"input_ids", "attention_mask", "position_ids"}


def test_left_padding_several_keys():
    collator = LeftPaddingCollator(pad_token_id=9, keys=("prompt_input_ids", "completion_input_ids"))
    batch = collator(
        [
            {"prompt_input_ids": [1, 2], "completion_input_ids": [3]},
            {"prompt_input_ids": [4], "completion_input_ids": [5, 6]},
        ]
    )
    assert_close(batch["prompt_input_ids"], tensor([[1, 2], [9, 4]]))
    assert_close(batch["prompt_attention_mask"], tensor([[1, 1], [0, 1]]))
    assert_close(batch["completion_input_ids"], tensor([[9, 3], [5, 6]]))
    assert_close(batch["completion_attention_mask"], tensor([[0, 1], [1, 1]]))
    assert_close(batch["prompt_position_ids"], tensor([[0, 1], [0, 0]]))
    assert_close(batch["completion_position_ids"], tensor([[0, 0], [0, 1]]))


def test_left_padding_errors():
    with pytest.raises(ValueError, match="tokenizer has no pad token"):
        LeftPaddingCollator(pad_token_id=None)
    with pytest.raises(ValueError, match="row 1 has an empty 'input_ids'"):
        LeftPaddingCollator(pad_token_id=0)([{"input_ids": [1]}, {"input_ids": []}])
