"""`estimate_advantages`: one rollout's rewards, advantages and returns for `PPOConfig.advantage_estimator`
(torch only).

The rollout hands over scores and per-token KL; this picks the estimator's math (`hf_rlhf.rl.advantages` for GAE,
`hf_rlhf.rl.critic_free` for GRPO / RLOO / REINFORCE++) and says where the KL penalty goes: into the per-token
rewards (gae, reinforce_pp), into each sequence's score before the group baseline (grpo, rloo, as TRL's
`RLOOTrainer`), or nowhere when `kl_in_loss` puts it into the loss instead.
"""

from __future__ import annotations

import torch

from ..tensors import masked_sum, masked_whiten
from .advantages import gae, per_token_rewards
from .critic_free import AllReduceSum, broadcast_to_tokens, grpo_advantages, reinforce_pp_advantages, rloo_advantages


def estimate_advantages(
    args,
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    kl_coef: float,
    all_reduce_sum: AllReduceSum = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, advantages and returns of one rollout.

    Args:
        args: a `PPOConfig` (advantage_estimator, num_generations, scale_rewards, normalize_advantages, kl_in_loss,
            gamma, lam, whiten_rewards, whiten_advantages).
        scores: (N,) shaped sequence scores; with G = num_generations, rows p·G .. p·G + G - 1 share a prompt.
        kl: (N, T) per-token KL estimate of the rollout.
        response_mask: (N, T) 1 on response tokens.
        values: (N, T) the value function's predictions (gae; zeros for the critic-free estimators).
        kl_coef: β of the rollout (the KL controller's value).
        all_reduce_sum: sum over processes for batch statistics (None: one process).

    Returns:
        (rewards, advantages, returns), each (N, T), 0 outside the mask: the per-token rewards (the score on the
        last token, -β·KL on each unless `kl_in_loss`), the advantages the policy loss uses, and the value targets
        (gae), the unwhitened returns (reinforce_pp) or the penalised sequence score on every token (grpo, rloo).
    """
    estimator = args.advantage_estimator
    penalty = 0.0 if args.kl_in_loss else kl_coef
    rewards = per_token_rewards(scores, kl, response_mask, penalty)
    if estimator == "gae":
        return _gae(args, rewards, values, response_mask, all_reduce_sum)
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        groups = args.num_generations if estimator == "reinforce_pp_baseline" else None
        advantages, returns = reinforce_pp_advantages(scores, kl, response_mask, penalty, args.gamma, groups,
                                                      all_reduce_sum)
        return rewards, advantages, returns
    penalised = scores - penalty * masked_sum(kl, response_mask, dim=1)  # sequence-level, before the baseline
    if estimator == "grpo":
        advantages = grpo_advantages(penalised, args.num_generations, args.scale_rewards,
                                     all_reduce_sum=all_reduce_sum)
    elif estimator == "rloo":
        advantages = rloo_advantages(penalised, args.num_generations, args.normalize_advantages,
                                     all_reduce_sum=all_reduce_sum)
    else:
        raise ValueError(f"unknown advantage_estimator {estimator!r}")
    return rewards, broadcast_to_tokens(advantages, response_mask), broadcast_to_tokens(penalised, response_mask)


def _gae(args, rewards, values, response_mask, all_reduce_sum):
    """(rewards, advantages, returns) of GAE with the optional reward scaling and advantage whitening.

    The whitening statistics are over every process's tokens: W processes whiten as one with the global batch would.
    """
    tokens = response_mask.sum() if all_reduce_sum is None else all_reduce_sum(response_mask.sum().float())
    enough = tokens > 1  # whitening needs two tokens for a variance
    if args.whiten_rewards and enough:
        rewards = masked_whiten(rewards, response_mask, shift_mean=False, all_reduce_sum=all_reduce_sum)
    advantages, returns = gae(rewards, values, response_mask, args.gamma, args.lam)
    if args.whiten_advantages and enough:
        advantages = masked_whiten(advantages, response_mask, all_reduce_sum=all_reduce_sum)
    return rewards, advantages, returns
