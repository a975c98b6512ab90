"""Padding-free packing: examples share rows without seeing or predicting each other.

Rows carry `position_ids` that restart at 0 for every example. transformers reads those restarts as sequence
boundaries (`masking_utils.find_packed_sequence_indices`, row by row) and builds a block-diagonal causal mask for
sdpa/eager, and flash attention takes the same boundaries as `cu_seq_lens_*`. Either way the per-token loss
equals that of running each example alone (tests/integration/test_packing_equivalence.py), with one hazard:
transformers only looks for packed sequences when there is no KV cache, so the model must be called with
`use_cache=False` (or `config.use_cache=False`); with a cache, examples attend across their boundaries.

Two layouts: the whole batch end to end in one (1, N) row (`flatten=True`), which flash attention's varlen
kernels want; or one row per feature, (B, T) (`flatten=False`), for rows pre-packed by `trl.pack_dataset` on
sdpa/eager. sdpa and eager attend over a dense mask the size of a row, so one flattened row costs (B·T)² in
attention where B rows cost B·T² (bench/sft_packing.py: 3-4x the tokens/s at B=8, T=512 on CPU).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

from .padding import IGNORE_INDEX, as_list, masked_labels

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
    """Lay a batch out padding-free: per-example `position_ids`, no attention mask, one or B rows.

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
            Needs `flatten=True`.
        pad_to_multiple_of: pad the row length up to a multiple of this with one dummy sequence per row (its
            own position ids, labels -100), which changes no loss.
        pad_token_id: token of the dummy sequence; 0 when None (never trained on, it only has to be in vocab).
        flatten: True: concatenate the whole batch into one (1, N) row (flash attention, or plain examples).
            False: keep one row per feature, (B, T), each right-padded to the longest with one dummy sequence;
            on sdpa/eager this is the cheap layout for pre-packed rows (attention B·T² instead of (B·T)²).

    Returns (from `__call__`):
        dict with `input_ids`, `labels`, `position_ids`, each (1, N) when flattened, else (B, T), and, if asked,
        the flash kwargs over the S sequences (dummy included).

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
    >>> PackingCollator(flatten=False, pad_token_id=0)(examples)  # doctest: +NORMALIZE_WHITESPACE
    {'input_ids': tensor([[1, 2, 3, 0],
                          [4, 5, 6, 7]]),
     'labels': tensor([[-100,    2,    3, -100],
                       [-100, -100, -100,    7]]),
     'position_ids': tensor([[0, 1, 2, 0],
                             [0, 1, 0, 1]])}
    """

    def __init__(
        self,
        completion_only_loss: bool = True,
        assistant_only_loss: bool = False,
        return_flash_attention_kwargs: bool = False,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int | None = None,
        flatten: bool = True,
    ):
        if return_flash_attention_kwargs and not flatten:
            raise ValueError("return_flash_attention_kwargs describes one flattened row; set flatten=True")
        self.completion_only_loss = completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.return_flash_attention_kwargs = return_flash_attention_kwargs
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id
        self.flatten = flatten

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [
            _split_row(row, feature, row_labels)
            for row, (feature, row_labels) in enumerate(
                zip(features, masked_labels(features, self.completion_only_loss, self.assistant_only_loss))
            )
        ]
        if self.flatten:
            rows = [tuple(list(chain.from_iterable(parts)) for parts in zip(*rows))]
        width = max(len(input_ids) for input_ids, _, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        pad_id = self.pad_token_id if self.pad_token_id is not None else 0
        for input_ids, labels, lengths in rows:
            padding = width - len(input_ids)
            if padding:
                # One dummy sequence rather than `padding` sequences of length 1: one more boundary, not many.
                # (not trl's `pad`: it fills one constant, and the dummy needs its own position ids)
                input_ids += [pad_id] * padding
                labels += [IGNORE_INDEX] * padding
                lengths.append(padding)

        position_ids = torch.stack([position_ids_from_lengths(lengths) for _, _, lengths in rows])
        labels = torch.tensor([row_labels for _, row_labels, _ in rows], dtype=torch.long)
        labels[position_ids == 0] = IGNORE_INDEX
        batch = {
            "input_ids": torch.tensor([input_ids for input_ids, _, _ in rows], dtype=torch.long),
            "labels": labels,
            "position_ids": position_ids,
        }
        if self.return_flash_attention_kwargs:
            lengths = rows[0][2]
            cu_seq_lens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu_seq_lens
            batch["max_length_q"] = batch["max_length_k"] = max(lengths)
        return batch


def _split_row(row: int, feature: dict[str, Any], labels: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(input_ids, labels, sequence lengths) of one feature, checked; fresh lists the caller may extend."""
    input_ids = as_list(feature["input_ids"])
    if len(input_ids) == 0:
        raise ValueError(f"row {row} has an empty 'input_ids'")
    lengths = as_list(feature.get(SEQ_LENGTHS_KEY, [len(input_ids)]))
    if sum(lengths) != len(input_ids):
        raise ValueError(f"row {row}: '{SEQ_LENGTHS_KEY}' sum to {sum(lengths)} but 'input_ids' has {len(input_ids)}")
    return input_ids, list(labels), list(lengths)
