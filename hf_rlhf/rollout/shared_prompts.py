"""Prompt sharing: the completions of one prompt in one row, the prompt computed once (`PPOConfig.prefix_sharing`).

GRPO, RLOO and REINFORCE++-baseline sample G completions per prompt, and the padded layout runs the prompt G times
in every forward and backward (the reference's, the policy's): with prompts as long as the completions, more than
half of the work. The shared layout puts each distinct prompt of a batch once in a row, followed by its completions
side by side, each `R` columns wide:

    row u = [prompt u (left-padded, Q) | completion 1 (R) | completion 2 (R) | ... | completion k_max (R)]

with a (U, 1, T, T) boolean attention mask in which a completion attends to its prompt's real tokens and, causally,
to its own real tokens only; its `position_ids` continue from its prompt as in the padded layout. Every real token
thus sees exactly what it sees in the padded layout (`hf_rlhf.policy_value.sequence_inputs`), so logits and values
agree with it to float rounding. It is DPO's `prefix_sharing` (`hf_rlhf.collators.pairwise`) with G tails; like it,
it needs an attention that takes a 4D mask (sdpa, eager) and, on sliding-window models, sequences within the window
(`hf_rlhf.models.packing_check.check_packing_exact` checks the model before training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tensors import prompt_groups


@dataclass
class SharedPromptLayout:
    """Model inputs of the shared layout and where each row's response positions are in it.

    inputs: {"input_ids" (U, T), "attention_mask" (U, 1, T, T) bool, "position_ids" (U, T)}, T = Q + k_max * R.
    group: (B,) the layout row u of each batch row.
    index: (B, R) for each batch row and response token t, the kept-logits position that predicts it: 0 is the
        prompt's last column (Q - 1) and `logits_to_keep` = `keep` keeps columns Q - 1 .. T - 1.
    keep: k_max * R + 1.
    """

    inputs: dict
    group: torch.LongTensor
    index: torch.LongTensor
    keep: int

    def gather(self, kept: torch.Tensor) -> torch.Tensor:
        """(U, keep, ...) per-position outputs (logits, values) -> (B, R, ...) in the padded layout's order."""
        return kept[self.group[:, None], self.index]


def shared_prompt_layout(query_ids: torch.LongTensor, query_mask: torch.Tensor, response_ids: torch.LongTensor,
                         response_mask: torch.Tensor, pad_token_id: int = 0) -> SharedPromptLayout | None:
    """Lay out B (prompt, response) rows with each distinct prompt once; None when no two rows share a prompt.

    Args:
        query_ids, query_mask: (B, Q) left-padded prompts; rows are the same prompt when ids and mask are equal.
        response_ids, response_mask: (B, R) right-padded responses (the mask: what the response side attends to).
        pad_token_id: put in the unused columns (masked out).

    Returns:
        A `SharedPromptLayout`, or None (every prompt distinct: nothing to share).

    >>> layout = shared_prompt_layout(torch.tensor([[0, 5], [0, 5], [6, 7]]), torch.tensor([[0, 1], [0, 1], [1, 1]]),
    ...                               torch.tensor([[1, 2], [3, 0], [4, 0]]), torch.tensor([[1, 1], [1, 0], [1, 0]]))
    >>> layout.inputs["input_ids"]
    tensor([[0, 5, 1, 2, 3, 0],
            [6, 7, 4, 0, 0, 0]])
    >>> layout.inputs["position_ids"]
    tensor([[0, 0, 1, 2, 1, 1],
            [0, 1, 2, 2, 0, 0]])
    >>> layout.group.tolist(), layout.index.tolist(), layout.keep
    ([0, 0, 1], [[0, 1], [0, 3], [0, 1]], 5)
    """
    batch, width = query_ids.shape
    length = response_ids.shape[1]
    device = query_ids.device
    group, first = prompt_groups(query_ids, query_mask)
    counts = torch.bincount(group)
    k_max = int(counts.max())
    if k_max == 1:
        return None
    groups = counts.shape[0]
    # slot of each row among its group's rows, in batch order
    order = torch.sort(group, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(group)
    slot[order] = torch.arange(batch, device=device) - starts[group[order]]

    total = width + k_max * length
    columns = width + slot[:, None] * length + torch.arange(length, device=device)  # (B, R) response columns
    rows = group[:, None].expand(-1, length)
    input_ids = torch.full((groups, total), pad_token_id, dtype=query_ids.dtype, device=device)
    input_ids[:, :width] = query_ids[first]
    input_ids[rows, columns] = response_ids
    # the padded layout's positions (`sequence_inputs`): real tokens counted from the prompt's first
    padded_mask = torch.cat([query_mask, response_mask], dim=1).long()
    padded_positions = (padded_mask.cumsum(-1) - 1).clamp(min=0)
    position_ids = torch.zeros((groups, total), dtype=torch.long, device=device)
    position_ids[:, :width] = padded_positions[first, :width]
    position_ids[rows, columns] = padded_positions[:, width:]
    # segment: 0 prompt token, s + 1 the token of the completion in slot s, -1 padding
    segment = torch.full((groups, total), -1, dtype=torch.long, device=device)
    segment[:, :width] = torch.where(query_mask[first].bool(), 0, -1)
    segment[rows, columns] = torch.where(response_mask.bool(), slot[:, None] + 1, -1)
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    query, key = segment[:, :, None], segment[:, None, :]
    allowed = causal & (key >= 0) & ((key == 0) | (key == query))
    allowed |= torch.eye(total, dtype=torch.bool, device=device) & (query < 0)  # padding: itself (no NaN row)
    index = slot[:, None] * length + torch.arange(length, device=device)
    index[:, 0] = 0  # the first response token is predicted at the prompt's last column
    return SharedPromptLayout(
        inputs={"input_ids": input_ids, "attention_mask": allowed[:, None], "position_ids": position_ids},
        group=group, index=index, keep=k_max * length + 1)
