"""KTO batches laid out without TRL's padded rows; the same log-probs, read through a gather.

- Padding-free (`PaddingFreeUnpairedCollator`): the B prompt + completion sequences end to end in one row, and the B
  prompt + mismatched (KL) completion sequences in another, each laid out by
  `collators.dpo.PaddingFreePreferenceCollator` (`position_ids` restarting at 0 per sequence).
- Prefix sharing (`PrefixSharedUnpairedCollator`): one row per row of data, [prompt | completion | mismatched
  completion], the prompt computed once for both sequences (`collators.dpo.PrefixSharedPreferenceCollator`'s 4D mask:
  the mismatched completion attends to the prompt and itself, positions continuing from the prompt).
- Prompt cache (`PromptCachedUnpairedCollator`, `prefix_sharing` where the model's KV cache is exact): TRL's padded
  prompt + completion rows, and the mismatched completions as rows of their own that read the prompt from the
  matched rows' KV cache (`KL_attention_mask` over the cache's columns and their own, `KL_position_ids` continuing
  from the prompt).

The padded layout is trl's own `DataCollatorForUnpairedPreference`.
"""

from __future__ import annotations

from typing import Any

import torch

from .dpo import PaddingFreePreferenceCollator, PrefixSharedPreferenceCollator


class PaddingFreeUnpairedCollator:
    """Collate tokenized KTO rows (`prompt_ids`, `completion_ids`, `label`, optionally `KL_completion_ids`,
    `ref_logps`, `ref_KL_logps`) into padding-free rows.

    Args:
        pad_token_id, max_length, pad_to_multiple_of, return_flash_attention_kwargs: as for
            `PaddingFreePreferenceCollator` (keep-start truncation of each prompt + completion at `max_length`).

    Returns (from `__call__`), for B rows: the matched sequences' `input_ids` (1, N), `position_ids`, `row_index`,
    `logit_index`, `target_ids`, `gather_mask`, `sequence_lengths` (B,); the same for the mismatched ones prefixed
    `KL_`; `label` (B,) bool; `ref_logps` / `ref_KL_logps` (B,) when the rows have them.

    >>> batch = PaddingFreeUnpairedCollator(0)([{"prompt_ids": [1], "completion_ids": [2, 3], "label": True,
    ...                                          "KL_completion_ids": [4]}, {"prompt_ids": [5], "completion_ids": [4],
    ...                                          "label": False, "KL_completion_ids": [2, 3]}])
    >>> batch["input_ids"], batch["KL_input_ids"], batch["label"]  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[1, 2, 3, 5, 4]]), tensor([[1, 4, 5, 2, 3]]), tensor([ True, False]))
    """

    def __init__(self, pad_token_id: int | None, max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 return_flash_attention_kwargs: bool = False):
        kwargs = dict(pad_token_id=pad_token_id, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                      return_flash_attention_kwargs=return_flash_attention_kwargs)
        self.matched = PaddingFreePreferenceCollator(**kwargs, sides=("completion_ids",))
        self.mismatched = PaddingFreePreferenceCollator(**kwargs, sides=("KL_completion_ids",))

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.matched(features)
        if "KL_completion_ids" in features[0]:
            batch.update({f"KL_{k}": v for k, v in self.mismatched(features).items()})
        for key in ("ref_logps", "ref_KL_logps"):
            if key in features[0]:
                batch[key] = torch.tensor([float(f[key]) for f in features])
        batch["label"] = torch.tensor([bool(f["label"]) for f in features])
        return batch


class PrefixSharedUnpairedCollator:
    """Collate tokenized KTO rows with their mismatched completions (`prompt_ids`, `completion_ids`,
    `KL_completion_ids`, `label`, optionally `ref_logps`, `ref_KL_logps`) into prefix-shared rows [prompt | completion
    | mismatched completion] (keep-start truncation of each prompt + completion at `max_length`, as TRL's).

    Returns (from `__call__`): `PrefixSharedPreferenceCollator`'s batch for 2B sequences (the B matched ones, then the
    B mismatched ones), `label` (B,) bool, and `ref_logps` / `ref_KL_logps` (B,) when the rows have them.

    >>> batch = PrefixSharedUnpairedCollator(0)([{"prompt_ids": [1, 2], "completion_ids": [3, 4], "label": True,
    ...                                           "KL_completion_ids": [5]}])
    >>> batch["input_ids"], batch["logit_index"], batch["label"]  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[1, 2, 3, 4, 5]]), tensor([[1, 2], [1, 0]]), tensor([True]))
    """

    def __init__(self, pad_token_id: int | None, max_length: int | None = None, pad_to_multiple_of: int | None = None):
        self.shared = PrefixSharedPreferenceCollator(pad_token_id, max_length, pad_to_multiple_of)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.shared([{"prompt_ids": f["prompt_ids"], "chosen_ids": f["completion_ids"],
                              "rejected_ids": f["KL_completion_ids"]} for f in features])
        for key in ("ref_logps", "ref_KL_logps"):
            if key in features[0]:
                batch[key] = torch.tensor([float(f[key]) for f in features])
        batch["label"] = torch.tensor([bool(f["label"]) for f in features])
        return batch


class PromptCachedUnpairedCollator:
    """Collate tokenized KTO rows (`prompt_ids`, `completion_ids`, `KL_completion_ids`, `label`, optionally
    `ref_logps`, `ref_KL_logps`) for one forward over the prompt + completion sequences whose KV cache the mismatched
    completions then read: each prompt computed once, the mismatched tokens in a forward of their own.

    Args:
        pad_token_id, max_length, pad_to_multiple_of: as TRL's `DataCollatorForUnpairedPreference` (keep-start
            truncation of each prompt + completion and prompt + mismatched completion at `max_length`).

    Returns (from `__call__`), for B rows: TRL's matched batch, `input_ids` / `attention_mask` / `completion_mask`
    (B, T) (right-padded [prompt | completion]); `KL_input_ids` (B, T') the last prompt token then the mismatched
    completion ([p_last | KL completion], right-padded), `KL_completion_mask` (B, T') its completion tokens,
    `KL_position_ids` (B, T') continuing from the prompt, `KL_attention_mask` (B, T + T') the cache columns the row
    reads (its prompt but the last token, which it carries itself) then its own real tokens; `label` (B,) bool;
    `ref_logps` / `ref_KL_logps` (B,) when the rows have them. A row whose prompt is empty reads nothing from the
    cache and starts at position 0, as in TRL's layout.

    >>> batch = PromptCachedUnpairedCollator(0)([{"prompt_ids": [1, 2], "completion_ids": [3, 4], "label": True,
    ...                                           "KL_completion_ids": [5]}])
    >>> batch["input_ids"], batch["KL_input_ids"], batch["KL_position_ids"], batch["KL_attention_mask"]
    (tensor([[1, 2, 3, 4]]), tensor([[2, 5]]), tensor([[1, 2]]), tensor([[1, 0, 0, 0, 1, 1]]))
    """

    def __init__(self, pad_token_id: int | None, max_length: int | None = None, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self.max_length, self.multiple = max_length, pad_to_multiple_of

    def _padded(self, rows: list[list[int]], value: int, width: int | None = None) -> torch.Tensor:
        width = width or max(len(row) for row in rows)
        width = -(-width // self.multiple) * self.multiple if self.multiple else width
        out = torch.full((len(rows), width), value, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        matched, kl, kl_masks, starts = [], [], [], []
        for f in features:
            ids = (list(f["prompt_ids"]) + list(f["completion_ids"]))[: self.max_length]
            matched.append((ids, ([0] * len(f["prompt_ids"]) + [1] * len(f["completion_ids"]))[: self.max_length]))
            ids = (list(f["prompt_ids"]) + list(f["KL_completion_ids"]))[: self.max_length]
            prompt = min(len(f["prompt_ids"]), len(ids))
            start = max(prompt - 1, 0)  # the last prompt token predicts the first completion token
            kl.append(ids[start:])
            kl_masks.append([0] * (prompt - start) + [1] * (len(ids) - prompt))
            starts.append(start)
        batch = {"input_ids": self._padded([ids for ids, _ in matched], self.pad_token_id),
                 "attention_mask": self._padded([[1] * len(ids) for ids, _ in matched], 0),
                 "completion_mask": self._padded([mask for _, mask in matched], 0)}
        cached = batch["input_ids"].shape[1]
        batch["KL_input_ids"] = self._padded(kl, self.pad_token_id)
        batch["KL_completion_mask"] = self._padded(kl_masks, 0)
        width = batch["KL_input_ids"].shape[1]
        batch["KL_attention_mask"] = self._padded(
            [[1] * start + [0] * (cached - start) + [1] * len(ids) for ids, start in zip(kl, starts)], 0,
            cached + width)
        batch["KL_position_ids"] = torch.tensor(starts)[:, None] + torch.arange(width)[None]
        for key in ("ref_logps", "ref_KL_logps"):
            if key in features[0]:
                batch[key] = torch.tensor([float(f[key]) for f in features])
        batch["label"] = torch.tensor([bool(f["label"]) for f in features])
        return batch


def split_unpaired_batch(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(matched, mismatched): a KTO batch's prompt + completion sequences and its prompt + mismatched (KL) completion
    sequences as two batches of the same layout (the `KL_` prefix dropped); `label` and the reference log-probs left
    out; mismatched is None when the batch has no KL sequences.

    >>> matched, mismatched = split_unpaired_batch({"input_ids": 1, "KL_input_ids": 2, "label": 3, "ref_logps": 4})
    >>> matched, mismatched
    ({'input_ids': 1}, {'input_ids': 2})
    """
    skip = ("label", "ref_logps", "ref_KL_logps")
    matched = {k: v for k, v in batch.items() if not k.startswith("KL_") and k not in skip}
    mismatched = {k[3:]: v for k, v in batch.items() if k.startswith("KL_") and k not in skip}
    return matched, mismatched or None


STACKABLE_KEYS = ("input_ids", "attention_mask", "completion_mask")


def stack_padded_batches(first: dict[str, Any], second: dict[str, Any], pad_token_id: int) -> dict[str, Any] | None:
    """Two right-padded batches (the matched and the mismatched sequences) as one (2B, T) batch, the shorter one padded
    to the longer's width: one reference forward instead of two (under causal attention a real token never sees the
    padding after it, so its log-prob is unchanged). None when a batch holds other keys (another layout).

    >>> a = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    >>> b = {"input_ids": torch.tensor([[4, 5]]), "attention_mask": torch.tensor([[1, 1]])}
    >>> stack_padded_batches(a, b, 0)["input_ids"]
    tensor([[1, 2, 3],
            [4, 5, 0]])
    """
    if not set(first) <= set(STACKABLE_KEYS) or set(first) != set(second) or "input_ids" not in first:
        return None
    width = max(first["input_ids"].shape[1], second["input_ids"].shape[1])
    return {key: torch.cat([torch.nn.functional.pad(batch[key], (0, width - batch[key].shape[1]),
                                                    value=pad_token_id if key == "input_ids" else 0)
                            for batch in (first, second)]) for key in first}
