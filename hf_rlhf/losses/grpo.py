"""GRPO's policy-loss variants and token / sequence masks of trl 1.16 (torch only).

Everything here follows `trl.GRPOTrainer` (TRL 1.16, trl/trainer/grpo_trainer.py): `_compute_loss` (3020-3160:
the loss types, `delta`, the masks, the sampler correction), `get_off_policy_mask` (2945), `get_gamma_weights`
(2972), `get_high_entropy_mask` (1380) and the sampler's importance-sampling ratio of
`_generate_and_score_completions` (2627-2690, metrics 2860-2895). Shapes are ours: advantages are per token (B, T)
(constant over a row for the critic-free estimators) where TRL keeps (B, 1); a sequence-level quantity is broadcast
over its row, which gives TRL's reductions on the mask.
"""

from __future__ import annotations

import math

import torch

from ..tensors import masked_sum
from .ppo import importance_log_weights, policy_loss_per_token

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")  # PPO's clipped surrogate (with `delta`)
LOSS_TYPES = CLIPPED_LOSS_TYPES + ("cispo", "sapo", "vespo")
SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  sampling_ratio: torch.Tensor | None = None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                  k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO's gamma weight φ(w) = e^λ · w^k · e^(−λw) of the sequence ratio w (so φ(1) = 1), detached.

    As `trl.GRPOTrainer.get_gamma_weights`: w = exp(Σ_t clamp(log π/π_old, ±20) [+ Σ_t log of the sampler ratio]),
    log w clamped to [log 1e-8, 20]; k, λ from the advantage's sign (>= 0: the `_pos` pair).

    Args:
        advantages: (B,) one advantage per sequence.
        log_ratio: (B, T) log π_θ − log π_old.
        mask: (B, T) 1 on the tokens of the loss.
        sampling_ratio: (B, T) the sampler correction's ratio (`sampling_importance_ratio`), or None.
        k_pos, lambda_pos, k_neg, lambda_neg: TRL's `vespo_*`.

    Returns:
        (B,) φ.
    """
    with torch.no_grad():
        lower = math.log(1e-8)
        log_w = masked_sum(log_ratio.clamp(-20.0, 20.0), mask, dim=-1)
        if sampling_ratio is not None:
            log_w = log_w + torch.log(sampling_ratio).clamp(lower, 20.0).sum(-1)
        log_w = log_w.clamp(lower, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: drop a sequence whose advantage is negative and whose mean
    KL(sampler ‖ policy) over its tokens exceeds `threshold`. As `trl.GRPOTrainer.get_off_policy_mask`.

    Args:
        advantages: (B,).
        logprobs: (B, T) current policy log-probs (read detached).
        sampling_logprobs: (B, T) the log-probs the completions were sampled with (NaN: not scored, counts 0).
        mask: (B, T).
        threshold: δ.

    Returns:
        (B,) in the mask's dtype, 1 to keep.
    """
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)
    mean_kl = masked_sum(kl, mask, dim=-1) / mask.sum(-1).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor | None:
    """The `quantile` of the given token entropies (every process's, gathered), None when there are none.

    Args:
        entropies: (N,) entropies of the loss tokens.
        quantile: in [0, 1]; TRL passes 1 − `top_entropy_quantile`.
    """
    if entropies.numel() == 0:
        return None
    return torch.quantile(entropies.float(), quantile)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """Tokens whose entropy is at least `threshold` (`entropy_threshold`), padding never (TRL's
    `get_high_entropy_mask`; Wang et al. 2025, arXiv:2506.01939, "80/20").

    Args:
        entropies: (B, T) per-token entropy.
        mask: (B, T).
        threshold: 0-dim, or None (no token: all False).

    Returns:
        (B, T) bool.
    """
    if threshold is None:
        return torch.zeros_like(entropies, dtype=torch.bool)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


def grpo_policy_loss_per_token(
    loss_type: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    sampling_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy loss of TRL's GRPO `loss_type`, before the masks, the sampler correction and the KL.

    - clipped types (grpo, bnpo, dapo, dr_grpo, luspo): −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) with, given `delta`
      (two-sided clipping, INTELLECT-2), r capped at δ in the first term (`policy_loss_per_token`);
    - cispo (MiniMax-M1): −sg(min(r, ε_high))·A·log π;
    - sapo: −σ(τ·(r − 1))·4/τ·A, τ = `sapo_temperatures`[0] where A > 0, else [1];
    - vespo: −φ(w)·A·log π, φ from `gamma_weights` (k_pos, λ_pos, k_neg, λ_neg = `vespo`).

    r is the token ratio, or GSPO's sequence ratio with `importance_sampling_level="sequence"`. As TRL, ε_high
    defaults to ε_low, and cispo caps r at ε_high itself.

    Args:
        loss_type: one of `LOSS_TYPES`.
        logprobs, old_logprobs: (B, T) current (with grad) and rollout log-probs.
        advantages: (B, T) (rows constant for vespo, which reads column 0).
        mask: (B, T).
        epsilon_low, epsilon_high: the clip range.
        importance_sampling_level: "token" or "sequence".
        delta: the two-sided cap, or None.
        sapo_temperatures: (τ_pos, τ_neg).
        vespo: (k_pos, λ_pos, k_neg, λ_neg).
        sampling_ratio: (B, T) sampler-correction ratio (vespo folds it into w), or None.

    Returns:
        (per_token_loss (B, T), stats): stats hold the detached "ratio" (B, T) r, "clipfrac", "approxkl",
        "ratio_mean", and "phi" (B,) for vespo.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    high = epsilon_low if epsilon_high is None else epsilon_high
    if loss_type in CLIPPED_LOSS_TYPES:
        per_token, stats = policy_loss_per_token(logprobs, old_logprobs, advantages, mask, epsilon_low, high,
                                                 importance_sampling_level, delta=delta)
        with torch.no_grad():
            ratio = torch.exp(importance_log_weights(logprobs - old_logprobs, mask, importance_sampling_level))
        return per_token, {**stats, "ratio_mean": stats["ratio"], "ratio": ratio}
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(importance_log_weights(log_ratio, mask, importance_sampling_level))
    stats = {}
    if loss_type == "cispo":
        per_token = -ratio.clamp(max=high).detach() * advantages * logprobs
    elif loss_type == "sapo":
        tau = torch.where(advantages > 0, sapo_temperatures[0], sapo_temperatures[1]).to(ratio.dtype)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    else:  # vespo
        phi = gamma_weights(sequence_advantages(advantages, mask), log_ratio, mask, sampling_ratio, *vespo)
        per_token = -phi[:, None] * advantages * logprobs
        stats["phi"] = phi
    with torch.no_grad():
        stats.update({"ratio": ratio.detach(), "ratio_mean": masked_sum(ratio, mask) / mask.sum().clamp(min=1),
                      "approxkl": 0.5 * masked_sum(log_ratio.square(), mask) / mask.sum().clamp(min=1),
                      "clipfrac": torch.zeros((), device=ratio.device)})
    return per_token, stats


def sampling_importance_ratio(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                              mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> torch.Tensor:
    """Importance ratio trainer / sampler, π_old / π_sampler, truncated or masked (TRL's
    `vllm_importance_sampling_*`; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"; trl#4159, #4493).

    token_*: exp(Δ_t) per token; sequence_*: exp(Σ_t Δ_t) per sequence (broadcast over its row), Δ = (old −
    sampling) on the mask, a NaN sampling log-prob counting 0. *_truncate clamps the ratio to [clip_min, clip_max];
    *_mask sets it to 0 outside that range (a None bound is open).

    Args:
        old_logprobs: (B, T) the trainer's log-probs of the sampled tokens at rollout time.
        sampling_logprobs: (B, T) the sampler's log-probs of the same tokens.
        mask: (B, T).
        mode: one of `SAMPLING_CORRECTION_MODES`.
        clip_min, clip_max: the bounds.

    Returns:
        (B, T) ratio (detached).
    """
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {SAMPLING_CORRECTION_MODES}, got {mode!r}")
    diff = torch.nan_to_num((old_logprobs - sampling_logprobs).detach() * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(diff)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_mismatch_sums(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                           ratio: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """This process's share of TRL's `sampling/*` metrics, before the reduction over processes.

    TRL logs `sampling/sampling_logp_difference/mean|max` (|old − sampling| over the mask, NaN tokens left out) and
    `sampling/importance_sampling_ratio/min|mean|max` (over the mask's tokens, or one value per sequence in the
    sequence modes), each a per-process mean / extreme, then the mean / extreme over processes.

    Args:
        old_logprobs, sampling_logprobs, mask, ratio: (B, T) as `sampling_importance_ratio`'s.
        mode: the correction's mode.

    Returns:
        {TRL's name: 0-dim tensor} (0 where there is no token, as TRL).
    """
    keep = mask.bool()
    delta = (old_logprobs - sampling_logprobs).abs()
    delta = delta[keep & ~torch.isnan(delta)]
    flat = ratio[:, 0] if mode.startswith("sequence") else ratio[keep]
    zero = torch.zeros((), device=ratio.device)
    pick = {"mean": torch.mean, "max": torch.max, "min": torch.min}
    out = {f"sampling/sampling_logp_difference/{k}": pick[k](delta) if delta.numel() else zero
           for k in ("mean", "max")}
    out.update({f"sampling/importance_sampling_ratio/{k}": pick[k](flat) if flat.numel() else zero
                for k in ("min", "mean", "max")})
    return out


def adaptive_entropy_coef(coef: float, entropy: float, target: float, step: float, low: float, high: float) -> float:
    """The next entropy coefficient of TRL's `use_adaptive_entropy`: + `step` (at most `high`) when the step's mean
    token entropy is at or below `target`, else − `step` (at least `low`)."""
    return min(coef + step, high) if entropy <= target else max(coef - step, low)


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) each row's advantage: the mean over its tokens (the row's one value for the critic-free estimators)."""
    return masked_sum(advantages, mask, dim=-1) / mask.sum(-1).clamp(min=1).to(advantages.dtype)


def policy_terms(args, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, sampling_logprobs: torch.Tensor | None = None,
                 sampling_ratio: torch.Tensor | None = None,
                 entropy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy loss of a config's options, in the order of TRL's `_compute_loss`: the loss type
    (`grpo_policy_loss_per_token`), × the off-policy sequence mask, × the entropy mask, × the sampler correction's
    ratio (folded into φ for vespo instead); the KL term and the reduction come after.

    Args:
        args: a `PPOConfig` (loss_type, cliprange, epsilon_high, importance_sampling_level and
            `PolicyLossOptions`).
        logprobs, old_logprobs, advantages, mask: (B, T).
        sampling_logprobs: (B, T) the sampler's log-probs (the off-policy mask reads them; None: `old_logprobs`).
        sampling_ratio: (B, T) `sampling_importance_ratio`, or None.
        entropy_mask: (B, T) bool `high_entropy_mask`, or None.

    Returns:
        (per_token_loss (B, T), stats of `grpo_policy_loss_per_token`).
    """
    per_token, stats = grpo_policy_loss_per_token(
        args.loss_type, logprobs, old_logprobs, advantages, mask, args.cliprange, args.epsilon_high,
        args.importance_sampling_level, args.delta, (args.sapo_temperature_pos, args.sapo_temperature_neg),
        (args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg), sampling_ratio)
    if args.off_policy_mask_threshold is not None:
        sampled = old_logprobs if sampling_logprobs is None else sampling_logprobs
        keep = off_policy_mask(sequence_advantages(advantages, mask), logprobs, sampled, mask,
                               args.off_policy_mask_threshold)
        per_token = per_token * keep[:, None].to(per_token.dtype)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)
    if sampling_ratio is not None and args.loss_type != "vespo":
        per_token = per_token * sampling_ratio
    return per_token, stats
