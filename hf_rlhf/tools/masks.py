"""Packing a multi-turn response into tensors: the policy's tokens and the environment's, told apart (torch only).

A multi-turn response is, per row, a list of token ids and a parallel list of flags: 1 where the policy sampled
the token (its turns, each up to and including its stop token), 0 where the rollout appended it (tool results and
the template's turn markers around them: `hf_rlhf.tools.parsing.tool_suffix_ids`). Both kinds are in the context
the policy saw (`context_mask`), only the policy's are trained on (`loss_mask`): as TRL 1.16's GRPOTrainer
`tool_mask` (trl/trainer/grpo_trainer.py, `_tool_call_loop`), with the ids kept as generated (no re-tokenization).
"""

from __future__ import annotations

import torch


def pack_turns(ids: list[list[int]], policy_flags: list[list[int]], pad_id: int, width: int | None = None,
               device=None) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]:
    """Right-pad B rows of response tokens into (B, R) tensors.

    Args:
        ids: B lists of token ids (the response side only: prompts are separate, left-padded).
        policy_flags: B lists of 0/1 of the same lengths: 1 on tokens the policy generated.
        pad_id: the id written after each row's end.
        width: R; None: the longest row (at least 1).
        device: of the returned tensors.

    Returns:
        (response_ids (B, R) long, loss_mask (B, R) long: 1 on policy tokens, context_mask (B, R) long: 1 on every
        real token, policy or environment). `loss_mask <= context_mask` everywhere.

    Raises:
        ValueError: a row's flags do not match its ids in length, a flag is not 0/1, or a row is longer than `width`.
    """
    if len(ids) != len(policy_flags):
        raise ValueError(f"{len(ids)} rows of ids but {len(policy_flags)} rows of flags")
    longest = max((len(row) for row in ids), default=0)
    width = max(longest, 1) if width is None else width
    out_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(ids), width), dtype=torch.long)
    context_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, (row, flags) in enumerate(zip(ids, policy_flags)):
        if len(row) != len(flags):
            raise ValueError(f"row {i}: {len(row)} ids but {len(flags)} flags")
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} tokens, more than width={width}")
        if any(f not in (0, 1) for f in flags):
            raise ValueError(f"row {i}: policy flags must be 0 or 1")
        n = len(row)
        out_ids[i, :n] = torch.tensor(row, dtype=torch.long)
        loss_mask[i, :n] = torch.tensor(flags, dtype=torch.long)
        context_mask[i, :n] = 1
    return out_ids.to(device), loss_mask.to(device), context_mask.to(device)
