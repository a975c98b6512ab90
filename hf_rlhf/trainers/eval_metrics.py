"""What an online trainer's evaluation reports beyond TRL's reward metrics (torch only): pass@k over each prompt's
`num_generations_eval` completions, and the policy loss of the evaluation's completions at ratio 1.

TRL 1.16's GRPOTrainer evaluates by sampling `num_generations_eval` completions per prompt and logging its training
metrics with the `eval_` prefix (`reward`, `reward_std`, `rewards/{name}/mean|std`, `completions/*`, `loss`; those are
`hf_rlhf.trainers.grpo_metrics`). pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
Models Trained on Code", section 2.1, the numerically stable product form of its figure 3).
"""

from __future__ import annotations

import torch

from ..rl.critic_free import LOSS_TYPES, aggregate_loss, broadcast_to_tokens, grpo_advantages, rloo_advantages


def pass_at_k(correct: torch.Tensor, k: int) -> float:
    """The unbiased pass@k: the mean over prompts of 1 - C(n - c, k) / C(n, k), c of n completions correct.

    Args:
        correct: (P, n) bool, completion j of prompt p is correct; n >= k.
        k: completions drawn per prompt.

    Returns:
        The estimate in [0, 1]: the chance that at least one of k completions drawn without replacement is correct.

    >>> pass_at_k(torch.tensor([[True, False, False, False], [False, False, False, False]]), 2)
    0.25
    """
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} completions per prompt")
    c = correct.sum(1).double()
    # C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i); 0 when n - c < k (some draw must be correct)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    factors = torch.where(i[None, :] > n - c[:, None], 1.0 - k / i[None, :], torch.ones((), dtype=torch.float64))
    all_wrong = torch.where(n - c < k, torch.zeros_like(c), factors.prod(1))
    return (1.0 - all_wrong).mean().item()


def pass_at_k_values(n: int) -> list[int]:
    """The k reported for n completions per prompt: 1, 2, 4, ... up to n, and n itself (none for n = 1)."""
    if n < 2:
        return []
    ks = [2**j for j in range(n.bit_length()) if 2**j <= n]
    return ks if ks[-1] == n else ks + [n]


def on_policy_loss(scores: torch.Tensor, response_mask: torch.Tensor, estimator: str, num_generations: int,
                   scale_rewards: str = "group", normalize_advantages: bool = False, loss_type: str = "dapo",
                   max_completion_length: int | None = None) -> torch.Tensor:
    """The clipped-surrogate loss of freshly sampled completions: at ratio 1 it is -A per token, reduced as the
    training loss is (TRL's GRPO `eval_loss` with `beta=0`).

    Args:
        scores: (N,) rewards; rows p·G .. p·G + G - 1 are prompt p's G = `num_generations` completions.
        response_mask: (N, T) 1 on completion tokens.
        estimator: "grpo" or "rloo" (their group baselines); any other estimator is reported as 0 advantages.
        num_generations: G. With G = 1 every advantage is 0 (TRL: "could occur in eval when num_generations_eval=1").
        scale_rewards, normalize_advantages: the estimator's options (`grpo_advantages`, `rloo_advantages`).
        loss_type, max_completion_length: `aggregate_loss`'s reduction.

    Returns:
        A 0-dim tensor.
    """
    if estimator == "grpo" and num_generations > 1:
        advantages = grpo_advantages(scores.float(), num_generations, scale_rewards)
    elif estimator == "rloo" and num_generations > 1:
        advantages = rloo_advantages(scores.float(), num_generations, normalize_advantages)
    else:
        advantages = torch.zeros_like(scores, dtype=torch.float32)
    per_token = -broadcast_to_tokens(advantages, response_mask)
    if loss_type not in LOSS_TYPES:  # a loss type with its own shape of the ratio: at ratio 1, a token mean
        loss_type = "dapo"
    return aggregate_loss(per_token, response_mask, loss_type, max_completion_length)
