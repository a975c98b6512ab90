"""Critic-free advantage estimators (GRPO, RLOO, REINFORCE++) and GRPO's loss aggregations (torch only).

Every estimator takes the N = P·G sequences of a rollout as P groups of G consecutive samples of the
same prompt (sample j of prompt p at row p·G + j), as TRL's `GRPOTrainer` / `RLOOTrainer` and
OpenRLHF lay them out. Statistics over the whole batch (not per group) accept `all_reduce_sum`, the
sum over processes (e.g. `lambda t: accelerator.reduce(t, "sum")`), so that W processes compute what
one process holding the whole batch computes; None uses this process's rows only. The KL term of
GRPO's loss is `hf_rlhf.rl.kl.kl_penalty(logprobs, ref_logprobs, "k3")`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_rlhf.rl.advantages import gae, per_token_rewards
from hf_rlhf.tensors import masked_sum

AllReduceSum = Callable[[torch.Tensor], torch.Tensor] | None
SCALE_REWARDS = ("group", "batch", "none")
TOKEN_SUM_LOSS_TYPES = ("dapo", "cispo", "vespo")  # Σ loss / the optimizer step's token count (TRL)
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")


def _groups(scores: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Scores (N,) as (N / G, G), one row per prompt; errors if N is not a multiple of G or G < 2."""
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 (a group of 1 has no baseline), got {num_generations}")
    if scores.dim() != 1 or scores.numel() % num_generations:
        raise ValueError(f"scores must be (N,) with N a multiple of num_generations={num_generations}, "
                         f"got shape {tuple(scores.shape)}")
    return scores.view(-1, num_generations)


def _mean_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool, all_reduce_sum: AllReduceSum):
    """Mean and variance of `x` over the nonzero positions of `mask` (over every process with `all_reduce_sum`)."""
    stats = torch.stack([mask.bool().sum().to(x.dtype), masked_sum(x, mask)])
    count, total = (stats if all_reduce_sum is None else all_reduce_sum(stats)).unbind()
    if count < (2 if unbiased else 1):  # one host sync per rollout
        raise ValueError(f"a batch statistic needs at least {2 if unbiased else 1} element(s), found {int(count)}")
    mean = total / count
    squares = masked_sum((x - mean).square(), mask)
    if all_reduce_sum is not None:
        squares = all_reduce_sum(squares)
    return mean, squares / (count - 1 if unbiased else count)


def grpo_advantages(
    scores: torch.Tensor,
    num_generations: int,
    scale_rewards: str | bool = "group",
    eps: float = 1e-4,
    all_reduce_sum: AllReduceSum = None,
) -> torch.Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024, arXiv:2402.03300, §4.1.2): (r - mean_group) / (std + eps).

    As `trl.GRPOTrainer._generate_and_score_completions` (TRL 1.16, trl/trainer/grpo_trainer.py, the
    `sum_then_normalize` branch): the mean is the prompt's group mean; the std is the unbiased
    (Bessel-corrected) std of the group (`"group"`, `True`), of the whole batch (`"batch"`, PPO Lite,
    arXiv:2508.08221) or none at all (`"none"`, `False`: Dr. GRPO, arXiv:2503.20783). A NaN score (a completion
    no reward function could score: TRL's `None`) is left out of every mean and std, and its advantage is 0, as
    TRL's `nanmean` / `nanstd` and `nan_to_num` do; on finite scores those equal the plain ones used here.

    Args:
        scores: (N,) sequence scores, N = P·G, G consecutive samples per prompt.
        num_generations: G, >= 2.
        scale_rewards: TRL's `scale_rewards`: "group" / True, "batch", "none" / False.
        eps: added to the std (TRL: 1e-4).
        all_reduce_sum: for "batch", the sum over processes (see the module docstring).

    Returns:
        (N,) advantages in the dtype of `scores`.
    """
    scale = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # as GRPOConfig.__post_init__
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, True or False, "
                         f"got {scale_rewards!r}")
    grouped = _groups(scores, num_generations)
    if torch.isnan(scores).any():
        return _nan_grpo_advantages(grouped, scale, eps, all_reduce_sum)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)  # unbiased, as TRL's nanstd
    elif scale == "batch":
        _, var = _mean_var(scores, torch.ones_like(scores, dtype=torch.bool), True, all_reduce_sum)
        advantages = advantages / (var.sqrt() + eps)
    return advantages.view(-1)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased std over the non-NaN values, as `trl.trainer.utils.nanstd` (NaN for fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else torch.nanmean(
        (x - mean) ** 2)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(x)).sum()
    return torch.sqrt(variance * count / (count - 1))


def _nan_grpo_advantages(grouped, scale, eps, all_reduce_sum):
    """`grpo_advantages` of (P, G) scores holding NaN: NaN left out of the statistics, advantage 0 (as TRL)."""
    advantages = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (nanstd(grouped, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        flat = grouped.reshape(-1)
        valid = ~torch.isnan(flat)
        _, var = _mean_var(torch.nan_to_num(flat), valid, True, all_reduce_sum)
        advantages = advantages / (var.sqrt() + eps)
    return torch.nan_to_num(advantages.reshape(-1), nan=0.0)


def normalize_then_sum(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """GDPO's reward of several objectives (TRL's `multi_objective_aggregation="normalize_then_sum"`, trl#4841):
    each function's scores normalised in their group, then weighted and summed.

    As the `normalize_then_sum` branch of `trl.GRPOTrainer._generate_and_score_completions` up to the weighted
    sum (NaN: the function did not apply, left out of its group statistics and of the sum; a row no function scored
    stays NaN). TRL then normalises the sum over the batch: the trainer hands it to `grpo_advantages` with
    `scale_rewards="batch"` (each group's mean of the sum is 0, so the group and batch means agree).

    Args:
        per_func: (N, K) scores of K functions, N = P·G.
        weights: (K,) `reward_weights`.
        num_generations: G.
        eps: added to each group's std (TRL: 1e-4).

    Returns:
        (N,) summed rewards.
    """
    n, k = per_func.shape
    grouped = per_func.view(-1, num_generations, k)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + eps)).view(n, k)
    summed = (normalized * weights.to(per_func.dtype)[None]).nansum(dim=1)
    return summed.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))


def rloo_advantages(
    scores: torch.Tensor,
    num_generations: int,
    normalize_advantages: bool = False,
    eps: float = 1e-4,
    all_reduce_sum: AllReduceSum = None,
) -> torch.Tensor:
    """RLOO's leave-one-out advantage (Ahmadian et al. 2024, arXiv:2402.14740): r_i - mean_{j≠i} r_j in the group.

    As `trl.RLOOTrainer._generate_and_score_completions` (TRL 1.16, trl/trainer/rloo_trainer.py):
    baseline = (Σ_group r - r_i) / (G - 1); then, with TRL's `normalize_advantages`, the advantages
    are whitened over the whole batch, (A - mean) / (std + eps), with the unbiased std. TRL puts its
    KL penalty into the score first: r = score - β·Σ_t k1_t (sequence-level, from the rollout logprobs). A NaN score
    (a completion no reward function could score: TRL's `None`) is left out of its siblings' baselines and of the
    normalisation, and its advantage is 0; a completion whose siblings are all unscored has no baseline, advantage 0
    (TRL's `nansum` over the scorable siblings, divided by their count - 1, then `nan_to_num`).

    Args:
        scores: (N,) sequence scores, N = P·G, G consecutive samples per prompt.
        num_generations: G, >= 2.
        normalize_advantages: TRL's option of that name.
        eps: added to the std (TRL: 1e-4).
        all_reduce_sum: for the normalisation, the sum over processes (see the module docstring).

    Returns:
        (N,) advantages in the dtype of `scores`.
    """
    grouped = _groups(scores, num_generations)
    if torch.isnan(scores).any():
        return _nan_rloo_advantages(grouped, normalize_advantages, eps, all_reduce_sum)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    advantages = (grouped - baseline).view(-1)
    if normalize_advantages:
        mean, var = _mean_var(advantages, torch.ones_like(advantages, dtype=torch.bool), True, all_reduce_sum)
        advantages = (advantages - mean) / (var.sqrt() + eps)
    return advantages


def _nan_rloo_advantages(grouped, normalize_advantages, eps, all_reduce_sum):
    """`rloo_advantages` of (P, G) scores holding NaN: the baseline over the scorable siblings, advantage 0 where
    there is no score or no baseline (as TRL)."""
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = (grouped - baseline).view(-1)  # NaN: unscored, or the group's only scored row (0 / 0)
    if normalize_advantages:
        valid = ~torch.isnan(advantages)
        stats = torch.stack([valid.sum().to(advantages.dtype), torch.nansum(advantages)])
        count, total = (stats if all_reduce_sum is None else all_reduce_sum(stats)).unbind()
        mean = total / count
        squares = torch.nansum((advantages - mean).square())
        if all_reduce_sum is not None:
            squares = all_reduce_sum(squares)
        advantages = (advantages - mean) / ((squares / (count - 1)).sqrt() + eps)  # NaN with < 2 scored: then 0
    return torch.nan_to_num(advantages, nan=0.0)


def whiten_advantages(
    advantages: torch.Tensor, response_mask: torch.Tensor, all_reduce_sum: AllReduceSum = None
) -> torch.Tensor:
    """Global whitening of per-token advantages over every response token of the batch, as OpenRLHF does it.

    (A - mean) · rsqrt(max(var, 1e-8)) with the *biased* variance over the masked tokens, as the end
    of `compute_advantages_and_returns` in OpenRLHF's openrlhf/trainer/ppo_utils/experience_maker.py
    (commit 3c3be62). `hf_rlhf.tensors.masked_whiten` (TRL's) differs: unbiased variance, eps added.

    Args:
        advantages: (N, T).
        response_mask: (N, T) 1 on response tokens.
        all_reduce_sum: the sum over processes (see the module docstring).

    Returns:
        (N, T), 0 outside the mask.
    """
    mean, var = _mean_var(advantages, response_mask, False, all_reduce_sum)
    whitened = (advantages - mean) * var.clamp(min=1e-8).rsqrt()
    return torch.where(response_mask.bool(), whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))


def reinforce_pp_advantages(
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
    num_generations: int | None = None,
    all_reduce_sum: AllReduceSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): KL-penalised per-token returns, whitened over the whole batch.

    As OpenRLHF (openrlhf/trainer/ppo_utils/experience_maker.py at commit 3c3be62,
    `compute_advantages_and_returns` with `compute_reward` and `get_cumulative_returns`):

        r_t = -β·KL_t (+ score on the last response token);   G_t = Σ_{k≥t} γ^(k-t)·r_k;   A = whiten(G)

    With `num_generations` (OpenRLHF's `reinforce_baseline`, "REINFORCE++-baseline"), each score
    first has its prompt's group mean subtracted; OpenRLHF then forces γ = 1, here γ ≠ 1 is an error.
    The returns skip padding as `gae` does; OpenRLHF's equal ours on contiguous (left- or
    right-padded) response masks.

    Args:
        scores: (N,) sequence scores (N = P·G with `num_generations`).
        kl: (N, T) per-token KL estimate (`kl_penalty`); values outside the mask are ignored.
        response_mask: (N, T) 1 on response tokens; every row needs >= 1 token.
        kl_coef: β, the current value of the KL controller (0 when KL is a loss term instead).
        gamma: discount γ.
        num_generations: G for the group-baseline variant; None for plain REINFORCE++.
        all_reduce_sum: the sum over processes for the whitening (see the module docstring).

    Returns:
        (advantages, returns): each (N, T), 0 outside the mask; the returns before whitening.
    """
    if num_generations is not None:
        if gamma != 1.0:
            raise ValueError(f"the group-baseline variant needs gamma = 1 (as OpenRLHF forces it), got gamma={gamma}")
        grouped = _groups(scores, num_generations)
        scores = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    rewards = per_token_rewards(scores, kl, response_mask, kl_coef)
    # with V = 0 and λ = 1, GAE's advantage is the discounted return-to-go
    returns, _ = gae(rewards, torch.zeros_like(rewards), response_mask, gamma, lam=1.0)
    return whiten_advantages(returns, response_mask, all_reduce_sum), returns


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A sequence-level advantage on every response token of its sequence.

    Args:
        advantages: (N,).
        response_mask: (N, T) 1 on response tokens.

    Returns:
        (N, T) in the dtype of `advantages`, 0 outside the mask.
    """
    if advantages.shape != response_mask.shape[:1]:
        raise ValueError(f"advantages must be (N,) with N = {response_mask.size(0)} rows of the mask, "
                         f"got shape {tuple(advantages.shape)}")
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(response_mask.bool(), advantages.unsqueeze(-1), zero)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar as TRL's GRPO `loss_type` does.

    As `trl.GRPOTrainer._compute_loss` (TRL 1.16, trl/trainer/grpo_trainer.py), before TRL's division
    by the gradient-accumulation steps (the Trainer's business here):

    - "grpo", "sapo": mean over sequences of each sequence's token mean (length clamped to >= 1).
    - "bnpo": token mean over the batch given, Σ loss / max(Σ mask, 1).
    - "dapo", "cispo", "vespo": Σ loss / `normalizer`: the token count of the whole accumulated batch
      over every process (TRL's `num_items_in_batch` rescaled); None = this batch's count, as "bnpo".
    - "dr_grpo": Σ loss / (N · max_completion_length), a constant (Liu et al. 2025, arXiv:2503.20783).
    - "luspo": mean over sequences of each sequence's token sum (length-unbiased, TRL 1.16).

    Padding never reaches the sum (NaN at a pad cannot leak in, unlike TRL's `loss * mask`).

    Args:
        per_token_loss: (N, T).
        response_mask: (N, T) 1 on response tokens.
        loss_type: one of `LOSS_TYPES`.
        max_completion_length: required for "dr_grpo".
        normalizer: for "dapo" only, > 0.

    Returns:
        0-dim tensor.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if normalizer is not None and loss_type not in TOKEN_SUM_LOSS_TYPES:
        raise ValueError(f"normalizer is for loss_type {TOKEN_SUM_LOSS_TYPES} only, got it with "
                         f"loss_type={loss_type!r}")
    tokens = response_mask.bool().sum(dim=-1).to(per_token_loss.dtype)
    if loss_type in ("grpo", "sapo"):
        return (masked_sum(per_token_loss, response_mask, dim=-1) / tokens.clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return masked_sum(per_token_loss, response_mask, dim=-1).mean()
    total = masked_sum(per_token_loss, response_mask)
    if loss_type == "dr_grpo":
        if max_completion_length is None or not max_completion_length > 0:
            raise ValueError(f"loss_type='dr_grpo' needs max_completion_length > 0, got {max_completion_length}")
        return total / (per_token_loss.size(0) * max_completion_length)
    if normalizer is None:
        return total / tokens.sum().clamp(min=1.0)
    if not isinstance(normalizer, torch.Tensor) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return total / normalizer


def truncated_loss_mask(response_mask: torch.Tensor, stopped: torch.Tensor) -> torch.Tensor:
    """The loss mask of `mask_truncated_completions`: the rows of responses that never stopped zeroed (DAPO §3.4).

    As `trl.GRPOTrainer._generate_and_score_completions` (TRL 1.16, trl/trainer/grpo_trainer.py:2487-2492):
    `completion_mask * (~is_truncated).unsqueeze(1)`.

    Args:
        response_mask: (N, T) 1 on response tokens.
        stopped: (N,) bool, True where the response ended with the stop token.

    Returns:
        (N, T) in the dtype of `response_mask`.
    """
    return response_mask * stopped.unsqueeze(1).to(response_mask.dtype)


def informative_groups(scores: torch.Tensor, num_generations: int, stopped: torch.Tensor | None = None) -> torch.Tensor:
    """Which prompt groups DAPO's dynamic sampling keeps: those whose scores are not all equal (arXiv:2503.14476 §3.2).

    A group of equal rewards has zero advantage under every group baseline, so it gives no gradient (as veRL's
    `algorithm.filter_groups`, which keeps groups with a nonzero std of the metric). With `stopped`, a group also
    counts as informative when its responses differ in whether they stopped (the missing-stop penalty then differs).

    Args:
        scores: (N,) rewards, N = P·G, G consecutive samples per prompt.
        num_generations: G, >= 2.
        stopped: (N,) bool or None.

    Returns:
        (P,) bool, True for a group to keep.
    """
    grouped = _groups(scores, num_generations)
    keep = (grouped != grouped[:, :1]).any(dim=1)
    if stopped is not None:
        flags = stopped.view(-1, num_generations)
        keep = keep | (flags != flags[:, :1]).any(dim=1)
    return keep
