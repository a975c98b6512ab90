"""Pairwise collation for reward models: the chosen and rejected sequences of a batch go through the model together.

Three layouts of the same B pairs, each giving every sequence the same reward:

    padded          (2B, T) rows, chosen first then rejected; right or left padding.
    padding_free    one (1, N) row of the 2B sequences end to end, `position_ids` restarting at 0 for each
                    (transformers then keeps them apart; flash attention gets `cu_seq_lens_*`).
    prefix_sharing  (B, T) rows [shared prefix | chosen tail | rejected tail]: the tokens both sides share
                    (usually the prompt) are computed once; the rejected tail attends to the prefix and itself
                    but not the chosen tail, through a (B, 1, T, T) boolean mask, with its positions continuing
                    from the prefix as if the chosen tail were not there.

Layouts with more than one sequence per row carry `last_token_index`: the position of each sequence's last token
in the flattened scores (chosen 0..B-1, then rejected), which `models.value_head.gather_last_token_scores` reads.
"""

from __future__ import annotations

from typing import Any

import torch

from .packing import PackingCollator
from .padding import as_list, check_pad_token_id, pad_sequences, position_ids_from_mask

PAIR_KEYS = ("chosen_ids", "rejected_ids")


def shared_prefix_length(chosen: list[int], rejected: list[int]) -> int:
    """Length of the common prefix of two token lists, leaving each at least one token of its own.

    >>> shared_prefix_length([1, 2, 3, 4], [1, 2, 5])
    2
    >>> shared_prefix_length([1, 2, 3], [1, 2])  # rejected is a prefix: it keeps its last token
    1
    """
    limit = min(len(chosen), len(rejected)) - 1
    n = 0
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    return n


def prefix_sharing_mask(segment_ids: torch.Tensor) -> torch.BoolTensor:
    """Attention mask of prefix-shared rows: causal, no padding keys, rejected tail blind to the chosen tail.

    Args:
        segment_ids: (B, T) 0 on the shared prefix, 1 on the chosen tail, 2 on the rejected tail, -1 on padding
            (right padding only).

    Returns:
        BoolTensor (B, 1, T, T), True where query (dim 2) may attend to key (dim 3). Padding queries attend
        causally to the real tokens, so no row is all False (sdpa would return NaN).

    >>> prefix_sharing_mask(torch.tensor([[0, 1, 2, -1]]))[0, 0].int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 1, 0]], dtype=torch.int32)
    """
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    query, key = segment_ids[:, :, None], segment_ids[:, None, :]
    allowed = causal & (key >= 0) & ~((query == 2) & (key == 1))
    return allowed[:, None]


class PairwiseCollator:
    """Collate tokenized preference pairs into one batch of 2B sequences (chosen first, then rejected).

    Args:
        pad_token_id: id put in the padding.
        padding_side: "right" or "left" (padded layout).
        padding_free: one (1, N) row with restarted `position_ids` and `last_token_index`.
        prefix_sharing: (B, T) rows with the shared prefix computed once (see the module docstring).
        pad_to_multiple_of: round T (or N) up to a multiple of this.
        return_flash_attention_kwargs: padding_free only: also return `cu_seq_lens_q/k`, `max_length_q/k`.

    Features: dicts with `chosen_ids`, `rejected_ids` (lists of ints) and optionally `margin` (float).

    Returns (from `__call__`):
        padded: `input_ids` (2B, T), `attention_mask` (2B, T) [+ `position_ids` (2B, T) with left padding].
        padding_free: `input_ids` (1, N), `position_ids` (1, N), `last_token_index` (2B,) [+ flash kwargs].
        prefix_sharing: `input_ids` (B, T), `attention_mask` (B, 1, T, T) bool, `position_ids` (B, T),
            `last_token_index` (2B,).
        And `margin` (B,) float32 when the features have one.

    >>> collator = PairwiseCollator(pad_token_id=0)
    >>> examples = [
    ...     {"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2, 4, 5], "margin": 0.5},
    ...     {"chosen_ids": [6, 7], "rejected_ids": [8], "margin": 1.0},
    ... ]
    >>> collator(examples)  # doctest: +NORMALIZE_WHITESPACE
    {'input_ids': tensor([[1, 2, 3, 0],
                          [6, 7, 0, 0],
                          [1, 2, 4, 5],
                          [8, 0, 0, 0]]),
     'attention_mask': tensor([[1, 1, 1, 0],
                               [1, 1, 0, 0],
                               [1, 1, 1, 1],
                               [1, 0, 0, 0]]),
     'margin': tensor([0.5000, 1.0000])}
    >>> PairwiseCollator(pad_token_id=0, padding_free=True)(examples)  # doctest: +NORMALIZE_WHITESPACE
    {'input_ids': tensor([[1, 2, 3, 6, 7, 1, 2, 4, 5, 8]]),
     'position_ids': tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]]),
     'last_token_index': tensor([2, 4, 8, 9]),
     'margin': tensor([0.5000, 1.0000])}
    >>> batch = PairwiseCollator(pad_token_id=0, prefix_sharing=True)(examples)
    >>> batch["input_ids"], batch["position_ids"], batch["last_token_index"]  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[1, 2, 3, 4, 5],
             [6, 7, 8, 0, 0]]),
     tensor([[0, 1, 2, 2, 3],
             [0, 1, 0, 0, 0]]),
     tensor([2, 6, 4, 7]))
    """

    def __init__(
        self,
        pad_token_id: int | None,
        padding_side: str = "right",
        padding_free: bool = False,
        prefix_sharing: bool = False,
        pad_to_multiple_of: int | None = None,
        return_flash_attention_kwargs: bool = False,
    ):
        if padding_free and prefix_sharing:
            raise ValueError("padding_free and prefix_sharing are different layouts; choose one")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        self.pad_token_id = check_pad_token_id(pad_token_id)
        self.padding_side = padding_side
        self.padding_free = padding_free
        self.prefix_sharing = prefix_sharing
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_flash_attention_kwargs = return_flash_attention_kwargs

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        chosen, rejected = self._pairs(features)
        if self.padding_free:
            batch = self._packed(chosen, rejected)
        elif self.prefix_sharing:
            batch = self._shared(chosen, rejected)
        else:
            pad = dict(padding_side=self.padding_side, pad_to_multiple_of=self.pad_to_multiple_of)
            sequences = chosen + rejected
            batch = {"input_ids": pad_sequences(sequences, self.pad_token_id, **pad),
                     "attention_mask": pad_sequences([[1] * len(s) for s in sequences], 0, **pad)}
            if self.padding_side == "left":  # absolute position embeddings (GPT-2) must not see the padding
                batch["position_ids"] = position_ids_from_mask(batch["attention_mask"])
        margin = self._margin(features)
        if margin is not None:
            batch["margin"] = margin
        return batch

    @staticmethod
    def _pairs(features) -> tuple[list[list[int]], list[list[int]]]:
        sides = {key: [] for key in PAIR_KEYS}
        for row, feature in enumerate(features):
            for key in PAIR_KEYS:
                if key not in feature:
                    raise ValueError(f"row {row} has no {key!r}: tokenize the pairs first (prepare_preference_dataset)")
                ids = as_list(feature[key])
                if len(ids) == 0:
                    raise ValueError(f"row {row} has an empty {key!r}: there is no last token to read a reward at")
                sides[key].append(ids)
        return sides["chosen_ids"], sides["rejected_ids"]

    @staticmethod
    def _margin(features) -> torch.Tensor | None:
        has = ["margin" in f for f in features]
        if not any(has):
            return None
        if not all(has):
            raise ValueError(f"row {has.index(False)} has no 'margin' while other rows of the batch have one")
        return torch.tensor([float(f["margin"]) for f in features], dtype=torch.float32)

    def _packed(self, chosen, rejected) -> dict[str, Any]:
        # PackingCollator lays the sequences end to end (its labels are not needed here)
        packer = PackingCollator(completion_only_loss=False,
                                 return_flash_attention_kwargs=self.return_flash_attention_kwargs,
                                 pad_to_multiple_of=self.pad_to_multiple_of, pad_token_id=self.pad_token_id)
        sequences = chosen + rejected
        batch = packer([{"input_ids": s} for s in sequences])
        del batch["labels"]
        lengths = torch.tensor([len(s) for s in sequences])
        batch["last_token_index"] = lengths.cumsum(0) - 1
        order = ["input_ids", "position_ids", "last_token_index"]
        return {k: batch[k] for k in order} | {k: v for k, v in batch.items() if k not in order}

    # pad_sequences, not trl's `pad`: the same tensors (tests/unit/test_library_adoption.py), and trl's made the
    # padded layout 1.3x slower (256 pairs of 20-300 tokens: 35 vs 46 ms, best of 15 on this CPU)
    def _shared(self, chosen, rejected) -> dict[str, Any]:
        rows, segments, positions, ends = [], [], [], ([], [])
        for c, r in zip(chosen, rejected):
            n = shared_prefix_length(c, r)
            tail_c, tail_r = c[n:], r[n:]
            rows.append(c + tail_r)
            segments.append([0] * n + [1] * len(tail_c) + [2] * len(tail_r))
            positions.append(list(range(len(c))) + list(range(n, len(r))))
            ends[0].append(len(c) - 1)
            ends[1].append(len(c) + len(tail_r) - 1)
        pad = dict(padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of)
        input_ids = pad_sequences(rows, self.pad_token_id, **pad)
        width = input_ids.shape[1]
        offsets = torch.arange(len(rows)) * width
        return {
            "input_ids": input_ids,
            "attention_mask": prefix_sharing_mask(pad_sequences(segments, -1, **pad)),
            "position_ids": pad_sequences(positions, 0, **pad),
            "last_token_index": torch.cat([offsets + torch.tensor(ends[0]), offsets + torch.tensor(ends[1])]),
        }
