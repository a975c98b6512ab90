"""PPO's clipped policy and value losses (torch only).

Each loss is a token mean over the mask, or, given `normalizer`, a token sum divided by it: the
trainer passes the token count of the whole minibatch, so that micro-batches of gradient
accumulation add up to the exact token mean of the minibatch. The stats are detached means over
the tokens of the call.
"""

from __future__ import annotations

import torch

from hf_rlhf.tensors import masked_mean, masked_sum


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None) -> torch.Tensor:
    if normalizer is None:
        return masked_mean(per_token, mask)
    if not isinstance(normalizer, torch.Tensor) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return masked_sum(per_token, mask) / normalizer


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017, arXiv:1707.06347, Eq. 7).

    As `trl.PPOTrainer` and OpenRLHF's `PolicyLoss`:

        ratio = exp(logp - logp_old);   loss = mean(max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε)))

    Args:
        logprobs: (B, T) log-probabilities of the response tokens under the current policy (with grad).
        old_logprobs: (B, T) the same at rollout time (treated as constants).
        advantages: (B, T) advantages, usually whitened (treated as constants).
        mask: (B, T) 1 on response tokens.
        cliprange: ε, > 0.
        normalizer: None for the masked mean; else the loss is the masked sum divided by it.

    Returns:
        (loss, stats): loss is 0-dim; stats are detached 0-dim tensors: "clipfrac" (fraction of
        tokens where the clipped term binds), "approxkl" (½·mean((logp - logp_old)²)), "ratio" (mean).
    """
    per_token, stats = policy_loss_per_token(logprobs, old_logprobs, advantages, mask, cliprange)
    return _reduce(per_token, mask, normalizer), stats


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_sum")


def importance_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """Log importance weights of the policy ratio, per token or per sequence (GSPO, Zheng et al. 2025,
    arXiv:2507.18071).

    As `trl.GRPOTrainer._compute_loss` (TRL 1.16, trl/trainer/grpo_trainer.py:3083-3093): "token" keeps
    log(π/π_old) per token; "sequence" is the masked mean of it over each response, one weight per sequence
    (broadcast here to every token of the row, where TRL keeps shape (B, 1); the reductions then agree).
    "sequence_sum" is the masked sum, the log-ratio of the whole response's probabilities, as
    `trl.RLOOTrainer._compute_loss` (TRL 1.16, trl/trainer/rloo_trainer.py: `logps - old_logps` of the summed
    per-token log-probs).

    Args:
        log_ratio: (B, T) logp - logp_old.
        mask: (B, T) 1 on response tokens.
        level: "token", "sequence" or "sequence_sum".

    Returns:
        (B, T).
    """
    if level == "token":
        return log_ratio
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")
    total = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
    if level == "sequence_sum":
        return total.expand_as(log_ratio)
    tokens = mask.sum(dim=-1, keepdim=True).to(log_ratio.dtype).clamp(min=1.0)
    return (total / tokens).expand_as(log_ratio)


def policy_loss_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` before its reduction: max(-A·ratio, -A·clip(ratio, 1-ε_low, 1+ε_high)) per token.

    For the other reductions (`hf_rlhf.rl.critic_free.aggregate_loss`, TRL's GRPO `loss_type`) and for adding a
    per-token KL term first, as GRPO does. With `cliprange_high` (DAPO's clip-higher, TRL's `epsilon_high`) the upper
    bound differs from the lower one; with `importance_sampling_level="sequence"` the ratio is GSPO's per-sequence
    one (`importance_log_weights`). Both as `trl.GRPOTrainer._compute_loss` (TRL 1.16,
    trl/trainer/grpo_trainer.py:3083-3120: `coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)`,
    `-min(coef_1·A, coef_2·A)`).

    Args:
        As `policy_loss` (all (B, T)), plus:
        cliprange_high: ε_high, > 0; None: ε_high = ε (`cliprange`).
        importance_sampling_level: "token" or "sequence".
        delta: two-sided clipping (TRL's `delta`, INTELLECT-2): the unclipped term's ratio capped at δ, so a
            negative advantage's loss stays bounded; None: no cap.

    Returns:
        (per_token_loss (B, T) with grad, stats as `policy_loss`'s; "approxkl" is always per token).
    """
    if not cliprange > 0:
        raise ValueError(f"cliprange must be > 0, got {cliprange}")
    high = cliprange if cliprange_high is None else cliprange_high
    if not high > 0:
        raise ValueError(f"cliprange_high must be > 0, got {cliprange_high}")
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(importance_log_weights(log_ratio, mask, importance_sampling_level))
    unclipped = -advantages * (ratio if delta is None else torch.clamp(ratio, max=delta))
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approxkl": 0.5 * masked_mean(log_ratio.square(), mask),
            "ratio": masked_mean(ratio, mask),
        }
    return torch.maximum(unclipped, clipped), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of PPO, as in OpenAI baselines' `ppo2`, `trl.PPOTrainer` and OpenRLHF's `ValueLoss`.

        V_clip = V_old + clip(V - V_old, -ε_v, ε_v);   loss = ½·mean(max((V - R)², (V_clip - R)²))

    Args:
        values: (B, T) current value predictions (with grad).
        old_values: (B, T) predictions at rollout time (treated as constants).
        returns: (B, T) targets R from `gae` (treated as constants).
        mask: (B, T) 1 on response tokens.
        cliprange_value: ε_v, > 0.
        normalizer: None for the masked mean; else the loss is the masked sum divided by it.

    Returns:
        (loss, stats): loss is 0-dim; stats["clipfrac"] is the detached fraction of tokens where
        the clipped term is the larger.
    """
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    loss = 0.5 * _reduce(torch.maximum(unclipped_error, clipped_error), mask, normalizer)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped_error > unclipped_error).to(values.dtype), mask)}
    return loss, stats
