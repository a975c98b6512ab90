"""DPO batches laid out without TRL's padded chosen‖rejected rows; the same log-probs, read through a gather.

Prefix sharing (`PrefixSharedPreferenceCollator`), each pair's prompt computed once, both completions attending to it:

    row i = [prompt_i | chosen completion_i | rejected completion_i]   (B, T), right-padded

The rejected completion attends to the prompt and to itself but not to the chosen completion (a (B, 1, T, T)
boolean mask, `collators.pairwise.prefix_sharing_mask`), with positions continuing from the prompt as if the chosen
completion were not there: every completion token gets the logits it gets in TRL's padded chosen‖rejected layout.
The log-prob of completion token j is read at the logit that predicts it: the previous token of its own sequence,
which for the first token of either completion is the prompt's last token (`logit_index`).

Padding-free (`PaddingFreePreferenceCollator`): the 2B sequences prompt + chosen (pairs 0..B-1), then
prompt + rejected, end to end in one (1, N) row, `position_ids` restarting at 0 for each (transformers keeps them
apart, as for SFT packing: `collators.packing`); no padding at all.

Truncation is TRL's `keep_start` per sequence (prompt + completion cut at `max_length`).
"""

from __future__ import annotations

from typing import Any

import torch

from .packing import PackingCollator
from .padding import as_list, check_pad_token_id, pad_sequences
from .pairwise import prefix_sharing_mask


class PrefixSharedPreferenceCollator:
    """Collate tokenized DPO pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`: completion tokens) into prefix-shared
    rows.

    Args:
        pad_token_id: id put in the padding.
        max_length: longest prompt + completion of either side (keep the start); None: no limit.
        pad_to_multiple_of: round T up to a multiple of this.

    Returns (from `__call__`), for B pairs:
        `input_ids` (B, T), `attention_mask` (B, 1, T, T) bool, `position_ids` (B, T);
        `row_index` (2B,), `logit_index` (2B, L), `target_ids` (2B, L), `gather_mask` (2B, L): for each sequence
        (chosen 0..B-1, then rejected), the row and positions of the logits that predict its L completion tokens;
        `sequence_lengths` (2B,) prompt + completion lengths; `ref_chosen_logps` / `ref_rejected_logps` (B,) when
        the features have them.

    >>> batch = PrefixSharedPreferenceCollator(0)([{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}])
    >>> batch["input_ids"], batch["position_ids"], batch["logit_index"]  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[1, 2, 3, 4, 5]]), tensor([[0, 1, 2, 3, 2]]), tensor([[1, 2], [1, 0]]))
    """

    def __init__(self, pad_token_id: int | None, max_length: int | None = None, pad_to_multiple_of: int | None = None):
        self.pad_token_id = check_pad_token_id(pad_token_id)
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        rows, segments, positions = [], [], []
        index, target, lengths = ([], []), ([], []), ([], [])
        for f in features:
            prompt, chosen, rejected = (as_list(f[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
            prompt, chosen = _keep_start(prompt, chosen, self.max_length)
            rejected = _keep_start(prompt, rejected, self.max_length)[1]
            n, c = len(prompt), len(chosen)
            rows.append(prompt + chosen + rejected)
            segments.append([0] * n + [1] * c + [2] * len(rejected))
            positions.append(list(range(n + c)) + list(range(n, n + len(rejected))))
            first = 0 if n > 0 else 1  # a sequence's first token has no logit predicting it
            index[0].append([n + j - 1 for j in range(first, c)])
            index[1].append([n - 1 if j == 0 else n + c + j - 1 for j in range(first, len(rejected))])
            target[0].append(chosen[first:])
            target[1].append(rejected[first:])
            lengths[0].append(n + c)
            lengths[1].append(n + len(rejected))
        pad = dict(padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of)
        gather = dict(padding_side="right")
        batch = {
            "input_ids": pad_sequences(rows, self.pad_token_id, **pad),
            "attention_mask": prefix_sharing_mask(pad_sequences(segments, -1, **pad)),
            "position_ids": pad_sequences(positions, 0, **pad),
            "row_index": torch.arange(len(rows)).repeat(2),
            "logit_index": pad_sequences(index[0] + index[1], 0, **gather),
            "target_ids": pad_sequences(target[0] + target[1], 0, **gather),
            "gather_mask": pad_sequences([[1] * len(t) for t in target[0] + target[1]], 0, **gather),
            "sequence_lengths": torch.tensor(lengths[0] + lengths[1]),
        }
        return _ref_logps(batch, features)


def _keep_start(prompt: list[int], completion: list[int], max_length: int | None) -> tuple[list[int], list[int]]:
    """TRL's `keep_start` of prompt + completion at `max_length` tokens: (prompt, completion) cut."""
    if max_length is None:
        return prompt, completion
    prompt = prompt[:max_length]
    return prompt, completion[: max_length - len(prompt)]


def _ref_logps(batch: dict, features: list[dict]) -> dict:
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        if key in features[0]:
            batch[key] = torch.tensor([float(f[key]) for f in features])
    return batch


class PaddingFreePreferenceCollator:
    """Collate tokenized DPO pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`: completion tokens) into one
    padding-free row: prompt + chosen of every pair, then prompt + rejected, end to end.

    Args:
        pad_token_id: id of the dummy sequence `pad_to_multiple_of` adds.
        max_length: longest prompt + completion of either side (keep the start); None: no limit.
        pad_to_multiple_of: round N up to a multiple of this.
        return_flash_attention_kwargs: also return `cu_seq_lens_q/k`, `max_length_q/k` (flash attention).
        sides: the completion columns laid out, each side's B sequences after the previous side's (KTO lays out
            `("completion_ids",)` alone, `collators.kto`).

    Returns (from `__call__`), for B pairs:
        `input_ids` (1, N), `position_ids` (1, N) [+ flash kwargs]; `row_index` (2B,) zeros, `logit_index` (2B, L),
        `target_ids` (2B, L), `gather_mask` (2B, L): for each sequence (chosen 0..B-1, then rejected) the positions
        of the logits that predict its L completion tokens; `sequence_lengths` (2B,); `ref_chosen_logps` /
        `ref_rejected_logps` (B,) when the features have them.

    >>> batch = PaddingFreePreferenceCollator(0)([{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}])
    >>> batch["input_ids"], batch["position_ids"], batch["logit_index"]  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[1, 2, 3, 4, 1, 2, 5]]), tensor([[0, 1, 2, 3, 0, 1, 2]]), tensor([[1, 2], [5, 0]]))
    """

    def __init__(self, pad_token_id: int | None, max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 return_flash_attention_kwargs: bool = False, sides: tuple[str, ...] = ("chosen_ids", "rejected_ids")):
        self.packer = PackingCollator(completion_only_loss=False, pad_to_multiple_of=pad_to_multiple_of,
                                      pad_token_id=check_pad_token_id(pad_token_id),
                                      return_flash_attention_kwargs=return_flash_attention_kwargs)
        self.max_length = max_length
        self.sides = sides

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        sequences, index, target = [], [], []
        start = 0
        for side in self.sides:
            for f in features:
                prompt, completion = _keep_start(as_list(f["prompt_ids"]), as_list(f[side]), self.max_length)
                n = len(prompt)
                first = 0 if n > 0 else 1  # a sequence's first token has no logit predicting it
                index.append([start + n + j - 1 for j in range(first, len(completion))])
                target.append(completion[first:])
                sequences.append(prompt + completion)
                start += n + len(completion)
        batch = self.packer([{"input_ids": s} for s in sequences])
        del batch["labels"]
        gather = dict(padding_side="right")
        batch.update({
            "row_index": torch.zeros(len(sequences), dtype=torch.long),
            "logit_index": pad_sequences(index, 0, **gather),
            "target_ids": pad_sequences(target, 0, **gather),
            "gather_mask": pad_sequences([[1] * len(t) for t in target], 0, **gather),
            "sequence_lengths": torch.tensor([len(s) for s in sequences]),
        })
        return _ref_logps(batch, features)
