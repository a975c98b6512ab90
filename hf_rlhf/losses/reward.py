"""Pairwise reward-model loss and metrics: pure tensor functions (torch only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pairwise_reward_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Bradley-Terry loss of a batch of preference pairs, with an optional margin and reward centering.

        loss = mean(-log σ(r_c - r_r - m)) + c · mean((r_c + r_r)²)

    The margin follows Llama 2 (Touvron et al. 2023, Eq. 2); the centering term Eisenstein et al. 2023
    (https://huggingface.co/papers/2312.09244, Eq. 2); both as in `trl.RewardTrainer.compute_loss`.

    Args:
        chosen_rewards: (B,) reward of each chosen sequence.
        rejected_rewards: (B,) reward of each rejected sequence.
        margin: (B,) required gap between the two rewards, or None for 0.
        center_rewards_coefficient: c above; None or 0 switches the term off.

    Returns:
        0-dim tensor.
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_rewards.ndim != 1:
        raise ValueError(f"chosen and rejected rewards must both have shape (B,), got "
                         f"{tuple(chosen_rewards.shape)} and {tuple(rejected_rewards.shape)}")
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen_rewards + rejected_rewards) ** 2).mean()
    return loss


def pairwise_metric_sums(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Sums over a batch of the pairwise metrics (correct pairs, margin, chosen and rejected rewards), then the
    number of pairs.

    Sums (not means) so that batches of different sizes, and processes, add up exactly; divide by the
    last entry. A tie counts as wrong, as in TRL.

    Args:
        chosen_rewards: (B,).
        rejected_rewards: (B,).

    Returns:
        (5,) float tensor: [#(r_c > r_r), Σ(r_c - r_r), Σ r_c, Σ r_r, B].
    """
    chosen, rejected = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return torch.stack([
        (chosen > rejected).float().sum(),
        (chosen - rejected).sum(),
        chosen.sum(),
        rejected.sum(),
        torch.tensor(float(chosen.numel()), device=chosen.device),
    ])
