"""Padding collators: right padding for the unpacked SFT baseline, left padding for generation and scoring.

Also home of the label rules shared with `PackingCollator` (`masked_labels`), so that packed and padded
batches always agree on which tokens are trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100

NO_PAD_TOKEN_MESSAGE = "tokenizer has no pad token; set tokenizer.pad_token or SFTConfig.pad_token"


def as_list(values: Any) -> list:
    """A feature's values as a Python list: features come as lists, or as torch / numpy arrays from a formatted
    dataset."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def check_pad_token_id(pad_token_id: int | None) -> int:
    """Return `pad_token_id`, or raise a ValueError that says how to set one."""
    if pad_token_id is None:
        raise ValueError(NO_PAD_TOKEN_MESSAGE)
    return int(pad_token_id)


def masked_labels(
    features: list[dict[str, Any]], completion_only_loss: bool = True, assistant_only_loss: bool = False
) -> list[list[int]]:
    """Labels of each feature, with -100 on the tokens that are not trained on (the rules of every collator here).

    Labels are `feature["labels"]` if given, else `feature["input_ids"]`. With `completion_only_loss`, labels are
    -100 where `completion_mask` is 0; with `assistant_only_loss`, where `assistant_masks` is 0. A batch in which
    no feature has a `completion_mask` is language-modeling data (no prompt) and is trained on whole, so the
    default `completion_only_loss=True` suits both kinds of data; a batch where only some features have one is
    an error, as is `assistant_only_loss` without `assistant_masks` (unless the feature has `labels`, which the
    trainers' dataset preparation builds from the masks, as TRL's).

    Args:
        features: B dicts with `input_ids` (T_i,) and optionally `labels` (T_i,), `completion_mask` (T_i,),
            `assistant_masks` (T_i,), all 0/1 masks with 1 on the tokens to train on.
        completion_only_loss: mask the prompt out using `completion_mask`.
        assistant_only_loss: mask everything but assistant turns using `assistant_masks`.

    Returns:
        B lists of ints, of lengths T_i.

    Raises:
        ValueError: naming the missing key and row when a mask that the flags ask for is missing, or a mask
            whose length differs from `input_ids`.

    >>> masked_labels([
    ...     {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
    ...     {"input_ids": [8, 9], "labels": [-100, 9], "completion_mask": [1, 1]},
    ... ])
    [[-100, 6, 7], [-100, 9]]
    """
    mask_keys = []
    if completion_only_loss and any("completion_mask" in feature for feature in features):
        mask_keys.append("completion_mask")
    if assistant_only_loss:
        mask_keys.append("assistant_masks")
    all_labels = []
    for row, feature in enumerate(features):
        input_ids = as_list(feature["input_ids"])
        labels = as_list(feature["labels"]) if "labels" in feature else list(input_ids)
        for key in mask_keys:
            if key not in feature and "labels" in feature and key == "assistant_masks":
                continue  # labels built from the masks when the dataset was prepared (TRL's `labels` column)
            if key not in feature:
                raise ValueError(_missing_mask_message(key, row))
            mask = as_list(feature[key])
            if len(mask) != len(input_ids):
                raise ValueError(f"row {row}: '{key}' has length {len(mask)} but 'input_ids' has {len(input_ids)}")
            labels = [label if keep else IGNORE_INDEX for label, keep in zip(labels, mask)]
        all_labels.append(labels)
    return all_labels


def _missing_mask_message(key: str, row: int) -> str:
    if key == "assistant_masks":
        return (
            f"assistant_only_loss=True but row {row} has no 'assistant_masks'; tokenize with "
            "return_assistant_tokens_mask=True (a chat template with {% generation %}) or set assistant_only_loss=False"
        )
    return (
        f"completion_only_loss=True but row {row} has no 'completion_mask' while other rows of the batch have one; "
        "give every example a completion_mask or set completion_only_loss=False"
    )


def pad_sequences(
    sequences: Sequence[Sequence[int]],
    padding_value: int,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
) -> torch.LongTensor:
    """Stack int sequences of different lengths into one tensor, padding on one side.

    Args:
        sequences: B sequences of lengths T_i.
        padding_value: value put in the padding.
        padding_side: "right" or "left".
        pad_to_multiple_of: round T up to a multiple of this (tensor cores like multiples of 8).

    Returns:
        LongTensor (B, T) with T = max T_i, rounded up.

    >>> pad_sequences([[1, 2, 3], [4]], padding_value=0, padding_side="left", pad_to_multiple_of=4)
    tensor([[0, 1, 2, 3],
            [0, 0, 0, 4]])
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    length = max(len(seq) for seq in sequences)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(sequences), length), padding_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) == 0:
            continue
        values = torch.as_tensor(seq, dtype=torch.long)
        if padding_side == "right":
            out[row, : len(seq)] = values
        else:
            out[row, length - len(seq) :] = values
    return out


class PaddingCollator:
    """Pad a batch of tokenized examples into (B, T) tensors with an attention mask (the unpacked SFT baseline).

    Args:
        pad_token_id: id put in the padding of `input_ids`.
        completion_only_loss: train only on completion tokens of features that carry a `completion_mask`.
        assistant_only_loss: train only on assistant tokens (features must carry `assistant_masks`).
        pad_to_multiple_of: round T up to a multiple of this.
        padding_side: "right" (training) or "left".

    Returns (from `__call__`):
        dict with `input_ids` (B, T), `attention_mask` (B, T) 1 on tokens and 0 on padding, `labels` (B, T)
        -100 on padding and on tokens not trained on.

    >>> collator = PaddingCollator(pad_token_id=0)
    >>> examples = [
    ...     {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
    ...     {"input_ids": [4, 5], "completion_mask": [1, 1]},
    ... ]
    >>> collator(examples)  # doctest: +NORMALIZE_WHITESPACE
    {'input_ids': tensor([[1, 2, 3],
                          [4, 5, 0]]),
     'attention_mask': tensor([[1, 1, 1],
                               [1, 1, 0]]),
     'labels': tensor([[-100,    2,    3],
                       [   4,    5, -100]])}
    """

    def __init__(
        self,
        pad_token_id: int | None,
        completion_only_loss: bool = True,
        assistant_only_loss: bool = False,
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
    ):
        self.pad_token_id = check_pad_token_id(pad_token_id)
        self.completion_only_loss = completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if any("seq_lengths" in feature for feature in features):
            # Padding keeps a causal mask over the whole row, so a pre-packed row would attend across examples.
            raise ValueError("features carry 'seq_lengths' (pre-packed rows): collate them with PackingCollator")
        input_ids = [as_list(feature["input_ids"]) for feature in features]
        labels = masked_labels(features, self.completion_only_loss, self.assistant_only_loss)
        pad = dict(padding_side=self.padding_side, pad_to_multiple_of=self.pad_to_multiple_of)
        return {
            "input_ids": pad_sequences(input_ids, self.pad_token_id, **pad),
            "attention_mask": pad_sequences([[1] * len(ids) for ids in input_ids], 0, **pad),
            "labels": pad_sequences(labels, IGNORE_INDEX, **pad),
        }


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Positions that count real tokens only, as `generate` gives them: a row's outputs do not depend on its padding.

    Models with absolute position embeddings (GPT-2, GPT-NeoX's learned variants, ...) otherwise place a left-padded
    row's first token at position = its padding, and score it differently from the same row alone.

    Args:
        attention_mask: (B, T) 1 on tokens, 0 on padding (left or right).

    Returns:
        LongTensor (B, T): 0, 1, ... on each row's tokens; 0 on left padding (right padding repeats the last).

    >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]))
    tensor([[0, 0, 0, 1, 2],
            [0, 1, 2, 3, 3]])
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _companion_key(key: str, name: str) -> str | None:
    # TRL's naming: "input_ids" -> "attention_mask", "prompt_input_ids" -> "prompt_attention_mask" (same for positions).
    if key == "input_ids":
        return name
    if key.endswith("_input_ids"):
        return key[: -len("input_ids")] + name
    return None


class LeftPaddingCollator:
    """Left-pad token lists so that the last column holds each row's last token (generation, last-token scores).

    Args:
        pad_token_id: id put in the padding (-100 for a key named `labels`).
        keys: token-list keys to left-pad; each `*input_ids` key also gets its `*attention_mask` (1 on tokens) and
            its `*position_ids` (`position_ids_from_mask`: counting real tokens only, so that models with absolute
            position embeddings, e.g. GPT-2, give a row the outputs it has alone).
        passthrough: return every other feature key (e.g. "prompt" text, "answer" strings) as a python list of
            length B under the same name; when False they are dropped.

    Returns (from `__call__`):
        dict with, for `keys=("input_ids",)`, `input_ids` (B, T), `attention_mask` (B, T) and `position_ids` (B, T),
        plus the passthrough lists.

    Raises:
        ValueError: `pad_token_id` is None, or a row has an empty token list (named by its index).

    >>> collator = LeftPaddingCollator(pad_token_id=0)
    >>> examples = [{"input_ids": [1, 2, 3], "answer": "7"}, {"input_ids": [4, 5], "answer": "12"}]
    >>> collator(examples)  # doctest: +NORMALIZE_WHITESPACE
    {'input_ids': tensor([[1, 2, 3],
                          [0, 4, 5]]),
     'attention_mask': tensor([[1, 1, 1],
                               [0, 1, 1]]),
     'position_ids': tensor([[0, 1, 2],
                             [0, 0, 1]]),
     'answer': ['7', '12']}
    """

    def __init__(self, pad_token_id: int | None, keys: Sequence[str] = ("input_ids",), passthrough: bool = True):
        self.pad_token_id = check_pad_token_id(pad_token_id)
        self.keys = tuple(keys)
        self.passthrough = passthrough

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for key in self.keys:
            sequences = [as_list(feature[key]) for feature in features]
            for row, seq in enumerate(sequences):
                if len(seq) == 0:
                    # An all-padding row has no last token to generate from or to score.
                    raise ValueError(f"row {row} has an empty '{key}'")
            padding_value = IGNORE_INDEX if key == "labels" else self.pad_token_id
            batch[key] = pad_sequences(sequences, padding_value, padding_side="left")
            mask_key = _companion_key(key, "attention_mask")
            if mask_key is not None:
                batch[mask_key] = pad_sequences([[1] * len(seq) for seq in sequences], 0, padding_side="left")
                batch[_companion_key(key, "position_ids")] = position_ids_from_mask(batch[mask_key])
        if self.passthrough:
            # Masks and positions in the features are dropped: the ones built above match the new padding.
            for key in features[0]:
                if key not in batch:
                    batch[key] = [feature.get(key) for feature in features]
        return batch
