"""Padding-free packing: a batch becomes one row whose examples cannot see or predict each other.

The row carries `position_ids` that restart at 0 for every example. transformers reads those restarts as
sequence boundaries (`masking_utils.find_packed_sequence_indices`) and builds a block-diagonal causal mask for
sdpa/eager, and flash attention takes the same boundaries as `cu_seq_lens_*`. Either way the per-token loss
equals that of running each example alone (tests/integration/test_packing_equivalence.py), with one hazard:
transformers only looks for packed sequences when there is no KV cache, so the model must be called with
`use_cache=False` (or `config.use_cache=False`); with a cache, examples attend across their boundaries.
"""

from __future__ import annotations

from typing import Any

import torch

from .padding import IGNORE_INDEX, _as_list, masked_labels

# The column `trl.pack_dataset(..., strategy="bfd" | "bfd_split")` adds: lengths of the examples in a packed row.
SEQ_LENGTHS_KEY = "seq_lengths"


def position_ids_from_lengths(lengths: list[int]) -> torch.LongTensor:
    """Position ids of sequences laid end to end, restarting at 0 at the start of each.

    Args:
        lengths: the N sequence lengths, each >= 1.

    Returns:
        LongTensor (sum(lengths),).

    >>> position_ids_from_lengths([3, 1, 2])
    tensor([0, 1, 2, 0, 0, 1])
    """
    if any(length < 1 for length in lengths):
        raise ValueError(f"sequence lengths must be >= 1, got {list(lengths)}")
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)


class PackingCollator:
    """Concatenate a batch into one (1, N) row with per-example `position_ids` and no attention mask.

    Each feature is one example, or a row pre-packed by `trl.pack_dataset` whose `seq_lengths` list the
    examples it holds; both are split into sequences the same way. Labels follow `masked_labels` and are also
    -100 at the first token of every sequence, so that no sequence's last token is trained to predict the next
    sequence's first (the model shifts labels by one internally).

    Args:
        completion_only_loss: train only on completion tokens of features that carry a `completion_mask`.
        assistant_only_loss: train only on assistant tokens (features must carry `assistant_masks`).
        return_flash_attention_kwargs: also return `cu_seq_lens_q`, `cu_seq_lens_k` (int32, (S + 1,)) and
            `max_length_q`, `max_length_k` (python ints), the names of transformers' `FlashAttentionKwargs`;
            they save flash attention from deriving the boundaries from `position_ids` in every layer.
        pad_to_multiple_of: pad N up to a multiple of this with one dummy sequence (its own position ids,
            labels -100), which changes no loss.
        pad_token_id: token of the dummy sequence; 0 when None (never trained on, it only has to be in vocab).

    Returns (from `__call__`):
        dict with `input_ids` (1, N), `labels` (1, N), `position_ids` (1, N) and, if asked, the flash kwargs
        over the S sequences (dummy included).

    >>> collator = PackingCollator(return_flash_attention_kwargs=True)
    >>> examples = [
    ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
    ...     {"input_ids": [4, 5, 6, 7], "completion_mask": [0, 0, 1, 1], "seq_lengths": [2, 2]},
    ... ]
    >>> collator(examples)  # doctest: +NORMALIZE_WHITESPACE
    {'input_ids': tensor([[1, 2, 3, 4, 5, 6, 7]]),
     'labels': tensor([[-100, 2, 3, -100, -100, -100, 7]]),
     'position_ids': tensor([[0, 1, 2, 0, 1, 0, 1]]),
     'cu_seq_lens_q': tensor([0, 3, 5, 7], dtype=torch.int32),
     'cu_seq_lens_k': tensor([0, 3, 5, 7], dtype=torch.int32),
     'max_length_q': 3,
     'max_length_k': 3}
    """

    def __init__(
        self,
        completion_only_loss: bool = True,
        assistant_only_loss: bool = False,
        return_flash_attention_kwargs: bool = False,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int | None = None,
    ):
        self.completion_only_loss = completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.return_flash_attention_kwargs = return_flash_attention_kwargs
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        input_ids: list[int] = []
        labels: list[int] = []
        lengths: list[int] = []
        for row, (feature, row_labels) in enumerate(
            zip(features, masked_labels(features, self.completion_only_loss, self.assistant_only_loss))
        ):
            row_ids = _as_list(feature["input_ids"])
            if len(row_ids) == 0:
                raise ValueError(f"row {row} has an empty 'input_ids'")
            row_lengths = _as_list(feature.get(SEQ_LENGTHS_KEY, [len(row_ids)]))
            if sum(row_lengths) != len(row_ids):
                total = sum(row_lengths)
                raise ValueError(f"row {row}: '{SEQ_LENGTHS_KEY}' sum to {total} but 'input_ids' has {len(row_ids)}")
            input_ids += row_ids
            labels += row_labels
            lengths += row_lengths

        padding = -len(input_ids) % self.pad_to_multiple_of if self.pad_to_multiple_of else 0
        if padding:
            # One dummy sequence rather than `padding` sequences of length 1: one more boundary, not many.
            input_ids += [self.pad_token_id if self.pad_token_id is not None else 0] * padding
            labels += [IGNORE_INDEX] * padding
            lengths.append(padding)

        position_ids = position_ids_from_lengths(lengths)
        labels = torch.tensor(labels, dtype=torch.long)
        labels[position_ids == 0] = IGNORE_INDEX
        batch = {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": labels[None],
            "position_ids": position_ids[None],
        }
        if self.return_flash_attention_kwargs:
            cu_seq_lens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu_seq_lens
            batch["max_length_q"] = batch["max_length_k"] = max(lengths)
        return batch
