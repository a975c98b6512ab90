"""trl 1.16 GRPOTrainer's logged metrics, computed from a rollout and a loss forward (names as TRL logs them).

Rollout (`_generate_and_score_completions`, trl/trainer/grpo_trainer.py:2229-2256, 2740-2750): `completions/*`
lengths (policy tokens only: tool results are not counted, as TRL), `completions/clipped_ratio`,
`rewards/{name}/mean|std`, `reward`, `reward_std`, `frac_reward_zero_std`. Loss (`_compute_loss`, 3238-3253):
`clip_ratio/low_mean|high_mean|region_mean` (token means) and `clip_ratio/low_min|high_max` (extremes of the
per-sequence means). Every input here is already gathered over ranks where TRL gathers it.
"""

from __future__ import annotations

import torch

from ..rl.critic_free import nanstd


def completion_metrics(lengths: torch.Tensor, stopped: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/*`.

    Args:
        lengths: (N,) policy tokens of each completion, over all ranks.
        stopped: (N,) bool, the completion ended with the stop token.
    """
    lengths = lengths.float()
    out = {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
           "completions/max_length": lengths.max().item(),
           "completions/clipped_ratio": (~stopped).float().mean().item()}
    terminated = lengths[stopped] if stopped.any() else torch.zeros(1)  # TRL logs 0 when none terminated
    out.update({"completions/mean_terminated_length": terminated.mean().item(),
                "completions/min_terminated_length": terminated.min().item(),
                "completions/max_terminated_length": terminated.max().item()})
    return out


def _std(x: torch.Tensor) -> torch.Tensor:
    """The unbiased std of a 1-D tensor over its non-NaN values (TRL's `nanstd`); 0 for a single value."""
    x = x[~torch.isnan(x)]
    return x.std() if x.numel() > 1 else torch.zeros(())


def reward_metrics(per_func: torch.Tensor, names: list[str], weights: torch.Tensor,
                   num_generations: int) -> dict[str, float]:
    """TRL's reward metrics.

    Args:
        per_func: (K, N) each reward function's scores of the N completions (all ranks, groups of
            `num_generations` consecutive completions).
        names: the K functions' names.
        weights: (K,) `reward_weights`.
    """
    out = {}
    for name, scores in zip(names, per_func):  # NaN: rows the function did not score (TRL's None), left out
        out[f"rewards/{name}/mean"] = torch.nanmean(scores).item()
        out[f"rewards/{name}/std"] = _std(scores).item()
    rewards = (weights[:, None] * per_func).nansum(0).masked_fill(torch.isnan(per_func).all(0), float("nan"))
    groups = rewards.reshape(-1, num_generations)
    group_std = nanstd(groups, dim=1) if num_generations > 1 else torch.zeros(groups.shape[0])
    out.update({"reward": torch.nanmean(rewards).item(), "reward_std": _std(rewards).item(),
                "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()})
    return out


def clip_metrics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, low: float,
                 high: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """TRL's clip ratios of one micro-batch: a ratio below 1 - low with a negative advantage, or above 1 + high
    with a positive one.

    Args:
        ratio: (B, T) importance ratio (per token, or one value per sequence broadcast over its tokens).
        advantages: (B, T).
        mask: (B, T) policy tokens.

    Returns:
        ({name: token sum} for the token means, {name: (B,) per-sequence means} for `low_min` / `high_max`).
    """
    mask = mask.float()
    low_clipped = ((ratio < 1 - low) & (advantages < 0)).float()
    high_clipped = ((ratio > 1 + high) & (advantages > 0)).float()
    region = torch.maximum(low_clipped, high_clipped)
    sums = {"clip_ratio/low_mean": (low_clipped * mask).sum(), "clip_ratio/high_mean": (high_clipped * mask).sum(),
            "clip_ratio/region_mean": (region * mask).sum()}
    tokens = mask.sum(-1).clamp(min=1.0)
    per_sequence = {"clip_ratio/low_min": (low_clipped * mask).sum(-1) / tokens,
                    "clip_ratio/high_max": (high_clipped * mask).sum(-1) / tokens}
    return sums, per_sequence
