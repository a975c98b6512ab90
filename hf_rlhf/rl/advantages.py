"""Per-token rewards with the KL penalty, and Generalised Advantage Estimation (torch only)."""

from __future__ import annotations

import torch

from ..tensors import last_true_indices


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Rewards of each response token: -β·KL on every token, plus the sequence score on the last one.

    As in Ziegler et al. 2019 (Fine-Tuning Language Models from Human Preferences) and
    `trl.PPOTrainer`, except that the score goes on the last *real* token (the last position where
    `response_mask` is 1), never on a pad (TRL issue #3750).

    Args:
        scores: (B,) score of each whole sequence (reward model or verifier).
        kl: (B, T) per-token KL estimate (`kl_penalty`); values outside the mask are ignored.
        response_mask: (B, T) 1 on response tokens, 0 on padding; every row needs ≥ 1 token.
        kl_coef: β, the current value of the KL controller.

    Returns:
        (B, T) in the dtype of `kl`, 0 outside the mask.

    Raises:
        ValueError: a row has no response token (its score would have nowhere to go).
    """
    keep = response_mask.bool()
    empty = (~keep.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} have an empty response_mask: their score has no token to go on")
    rewards = torch.where(keep, -kl_coef * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    last = last_true_indices(keep).unsqueeze(-1)
    return rewards.scatter_add(-1, last, scores.to(rewards.dtype).unsqueeze(-1))


def gae(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, Eq. 16), backwards over the response.

        δ_t = r_t + γ·V_{t+1} - V_t;   A_t = δ_t + γ·λ·A_{t+1};   returns_t = A_t + V_t

    with V = 0 after the last real token (the episode ends there). Positions outside the mask are
    skipped, as if absent: each row's real tokens are treated as one contiguous episode, so a
    padded row gives exactly what the same row alone gives, whatever the padding side. The
    results are targets, so they are computed without gradient.

    Args:
        rewards: (B, T) per-token rewards (`per_token_rewards`).
        values: (B, T) value estimates V_t of the state before each response token is chosen.
        response_mask: (B, T) 1 on response tokens, 0 on padding.
        gamma: discount γ.
        lam: GAE λ.

    Returns:
        (advantages, returns): each (B, T), 0 outside the mask.
    """
    rewards, values = rewards.detach(), values.detach()
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # V after the last real token
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # a pad neither produces an advantage nor breaks the chain between the real tokens around it
        advantages[:, t] = torch.where(keep[:, t], advantage, zero)
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
    returns = torch.where(keep, advantages + values, zero)
    return advantages, returns
