"""Critic-free advantages and loss aggregation (`hf_rlhf.rl.critic_free`): by hand, and against TRL 1.16 / OpenRLHF.

The reference expressions are transcribed from TRL 1.16.0 (installed; its `nanstd` is called as is) and from
OpenRLHF at commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7 (not installed: it pins deepspeed / vllm), each with
the file, function and lines it comes from. Run with `-s` to see the max |difference| of every comparison.
"""

import math
import threading

import pytest
import torch
from torch.testing import assert_close
from trl.trainer.utils import nanstd

from hf_rlhf.rl.critic_free import (
    aggregate_loss,
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten_advantages,
)
from hf_rlhf.rl.kl import kl_penalty

SCORES = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0], dtype=torch.float64)  # two prompts, G = 3


def compare(name, ours, reference, mask=None):
    """assert_close, printing the max |difference| (on the mask's positions when given) for the report."""
    if mask is not None:
        ours, reference = ours[mask.bool()], reference[mask.bool()]
    print(f"\n[max|diff|] {name}: {(ours - reference).abs().max().item():.3e}")
    assert_close(ours, reference)


# ---- GRPO -------------------------------------------------------------------------------------------------------


def test_grpo_by_hand():
    # group 1: mean 2, unbiased std 1;  group 2: mean 4/3, deviations (-4/3, -4/3, 8/3), unbiased var 16/3
    s3 = math.sqrt(3)
    expected_group = torch.tensor([-1.0, 0.0, 1.0, -1 / s3, -1 / s3, 2 / s3], dtype=torch.float64)
    assert_close(grpo_advantages(SCORES, 3, "group", eps=0.0), expected_group)
    assert_close(grpo_advantages(SCORES, 3, True, eps=0.0), expected_group)  # TRL's True = "group"
    centred = torch.tensor([-1.0, 0.0, 1.0, -4 / 3, -4 / 3, 8 / 3], dtype=torch.float64)
    assert_close(grpo_advantages(SCORES, 3, "none"), centred)  # Dr. GRPO: no std, eps unused
    assert_close(grpo_advantages(SCORES, 3, False), centred)
    # batch: mean 5/3, Σ squared deviations 40/3 over 5 → std sqrt(8/3)
    assert_close(grpo_advantages(SCORES, 3, "batch", eps=0.0), centred / math.sqrt(8 / 3))
    # eps is added to the std, not the variance
    assert_close(grpo_advantages(SCORES[:3], 3, "group", eps=1.0), torch.tensor([-0.5, 0.0, 0.5], dtype=torch.float64))


def test_grpo_equal_scores_give_zero_not_nan():
    assert_close(grpo_advantages(torch.full((4,), 0.7), 2), torch.zeros(4))


@pytest.mark.parametrize("bad, match", [
    (dict(num_generations=4), "multiple of num_generations=4"),
    (dict(num_generations=1), "num_generations must be >= 2"),
    (dict(num_generations=3, scale_rewards="std"), "scale_rewards must be one of group, batch, none"),
])
def test_grpo_errors_name_what_was_expected(bad, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(SCORES, **bad)


def trl_grpo_advantages(rewards, num_generations, scale_rewards):
    # trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions, lines 2765-2787
    # (the "sum_then_normalize" branch; num_generations > 1 and rewards.numel() > 1)
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    elif scale_rewards == "batch":
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_equals_trl(scale_rewards):
    torch.manual_seed(0)
    scores = torch.randn(64) * 3 + 1  # 8 prompts × 8 generations, float32
    scores[8:16] = 0.5  # a group of equal scores: std 0
    compare(f"grpo scale_rewards={scale_rewards} vs TRL 1.16",
            grpo_advantages(scores, 8, scale_rewards), trl_grpo_advantages(scores, 8, scale_rewards))


# ---- RLOO -------------------------------------------------------------------------------------------------------


def test_rloo_by_hand():
    # group 1 baselines (5/2, 4/2, 3/2); group 2 baselines (4/2, 4/2, 0/2)
    expected = torch.tensor([-1.5, 0.0, 1.5, -2.0, -2.0, 4.0], dtype=torch.float64)
    assert_close(rloo_advantages(SCORES, 3), expected)
    # normalised over the batch: mean 0, unbiased std sqrt(Σ a² / 5) = sqrt(28.5 / 5)
    assert_close(rloo_advantages(SCORES, 3, normalize_advantages=True, eps=0.0), expected / math.sqrt(28.5 / 5))


def test_rloo_is_g_over_g_minus_1_times_the_centred_score():
    torch.manual_seed(1)
    scores = torch.randn(12, dtype=torch.float64)
    assert_close(rloo_advantages(scores, 4), grpo_advantages(scores, 4, "none") * 4 / 3)


def trl_rloo_advantages(rewards, num_generations, normalize_advantages):
    # trl 1.16.0, trl/trainer/rloo_trainer.py, RLOOTrainer._generate_and_score_completions, lines 1676-1699
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    baselines = baselines.view(-1)
    advantages = rewards - baselines
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("normalize_advantages", [False, True])
def test_rloo_equals_trl(normalize_advantages):
    torch.manual_seed(0)
    scores = torch.randn(64) * 3 + 1
    compare(f"rloo normalize_advantages={normalize_advantages} vs TRL 1.16",
            rloo_advantages(scores, 8, normalize_advantages), trl_rloo_advantages(scores, 8, normalize_advantages))


@pytest.mark.parametrize("normalize_advantages", [False, True])
def test_rloo_with_unscored_rows_equals_trl(normalize_advantages):
    # NaN: no reward function scored the row (TRL's None): out of its siblings' baselines, advantage 0; the second
    # group keeps one scored row (no baseline: 0), the third none
    nan = float("nan")
    scores = torch.tensor([1.0, nan, 3.0, 0.5, nan, nan, nan, nan, nan, 2.0, 4.0, -1.0])
    ours = rloo_advantages(scores, 3, normalize_advantages)
    assert_close(ours, trl_rloo_advantages(scores, 3, normalize_advantages))
    assert ours[[1, 3, 4, 5, 6, 7, 8]].eq(0).all()
    assert_close(rloo_advantages(torch.full((6,), nan), 3, normalize_advantages), torch.zeros(6))


# ---- REINFORCE++ ------------------------------------------------------------------------------------------------

KL = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, float("inf")]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def whiten_by_hand(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))  # biased, as OpenRLHF
    return [(v - mean) / std for v in values]


def test_reinforce_pp_by_hand():
    # rewards (β = 0.5): row 0 (-0.05, -0.10, -0.15 + 1), row 1 (-0.20, -0.25 + 0)
    # returns (γ = 1): row 0 (0.70, 0.75, 0.85), row 1 (-0.45, -0.25)
    advantages, returns = reinforce_pp_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), KL, MASK, 0.5)
    assert_close(returns, torch.tensor([[0.70, 0.75, 0.85], [-0.45, -0.25, 0.0]], dtype=torch.float64))
    w = whiten_by_hand([0.70, 0.75, 0.85, -0.45, -0.25])
    assert_close(advantages, torch.tensor([w[:3], w[3:] + [0.0]], dtype=torch.float64))
    # γ = 0.5: row 0 (-0.05 + 0.5·0.325, -0.10 + 0.5·0.85, 0.85), row 1 (-0.20 + 0.5·-0.25, -0.25)
    advantages, returns = reinforce_pp_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), KL, MASK, 0.5, 0.5)
    assert_close(returns, torch.tensor([[0.1125, 0.325, 0.85], [-0.325, -0.25, 0.0]], dtype=torch.float64))
    w = whiten_by_hand([0.1125, 0.325, 0.85, -0.325, -0.25])
    assert_close(advantages, torch.tensor([w[:3], w[3:] + [0.0]], dtype=torch.float64))


def test_reinforce_pp_baseline_by_hand():
    # scores (1, 3) in one group of 2: minus the mean 2 → (-1, 1); β = 0: returns are the centred scores
    advantages, returns = reinforce_pp_advantages(
        torch.tensor([1.0, 3.0], dtype=torch.float64), KL, MASK, 0.0, num_generations=2)
    assert_close(returns, torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]], dtype=torch.float64))
    w = whiten_by_hand([-1.0, -1.0, -1.0, 1.0, 1.0])
    assert_close(advantages, torch.tensor([w[:3], w[3:] + [0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="gamma = 1"):
        reinforce_pp_advantages(torch.ones(2), KL, MASK, 0.0, gamma=0.9, num_generations=2)


# OpenRLHF at 3c3be6234e0cb353e76bb8019947db9dfe99fca7, transcribed with the arguments it reads from `args`:


def openrlhf_compute_reward(r, kl_coef, kl, action_mask):
    # openrlhf/models/utils.py, compute_reward, lines 98-126 (no reward_clip_range)
    if kl_coef <= 0.0:
        kl_coef = 0.0
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def openrlhf_get_cumulative_returns(rewards, action_mask, gamma):
    # openrlhf/trainer/ppo_utils/experience_maker.py, get_cumulative_returns, lines 380-411
    response_length = rewards.size(1)
    returns = torch.zeros_like(rewards)
    cumulative_return = torch.zeros(rewards.size(0), device=rewards.device)
    if action_mask is not None:
        rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        cumulative_return = rewards[:, t] + gamma * cumulative_return
        returns[:, t] = cumulative_return
    return returns


def openrlhf_reinforce(raw_rewards, kl, action_mask, kl_coef, gamma, estimator, n_samples_per_prompt):
    # openrlhf/trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns, lines 238-331, for one
    # experience holding the whole batch in prompt order (indices = arange), estimator "reinforce",
    # "reinforce_baseline", "rloo" or "group_norm", no length penalty, no_std_norm False
    rewards = raw_rewards.reshape(-1, n_samples_per_prompt)
    if estimator == "rloo":
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (n_samples_per_prompt - 1)
        rewards = rewards - baseline
    elif estimator in ["reinforce_baseline", "dr_grpo"]:
        rewards = rewards - rewards.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    reward = openrlhf_compute_reward(rewards.reshape(-1), kl_coef, kl, action_mask=action_mask)
    if estimator in ["rloo", "reinforce_baseline", "group_norm", "dr_grpo"]:
        gamma = 1.0
    returns = openrlhf_get_cumulative_returns(reward, action_mask, gamma)
    advantages = returns.clone()
    if estimator in ["gae", "reinforce", "reinforce_baseline"]:
        all_advantages = advantages.flatten().float()
        all_action_masks = action_mask.flatten()
        num_actions = all_action_masks.sum()
        mean = (all_advantages * all_action_masks).sum() / num_actions
        var = ((all_advantages - mean).pow(2) * all_action_masks).sum() / num_actions
        rstd = var.clamp(min=1e-8).rsqrt()
        advantages = (advantages - mean) * rstd
    return advantages, returns


def random_rollout(seed, n=32, t=24, left_padded=False):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=generator) * 2
    kl = torch.randn(n, t, generator=generator).abs() * 0.1
    lengths = torch.randint(1, t + 1, (n,), generator=generator)
    positions = torch.arange(t)
    mask = (positions >= t - lengths[:, None]) if left_padded else (positions < lengths[:, None])
    return scores, kl, mask.float()  # OpenRLHF's action_mask multiplies, so float


@pytest.mark.parametrize("left_padded", [False, True], ids=["right_padded", "left_padded"])
@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_reinforce_pp_equals_openrlhf(gamma, left_padded):
    scores, kl, mask = random_rollout(0, left_padded=left_padded)
    advantages, returns = reinforce_pp_advantages(scores, kl, mask, kl_coef=0.05, gamma=gamma)
    reference_advantages, reference_returns = openrlhf_reinforce(scores, kl, mask, 0.05, gamma, "reinforce", 4)
    pad = "left" if left_padded else "right"
    compare(f"reinforce_pp gamma={gamma} {pad}-padded returns vs OpenRLHF", returns, reference_returns, mask)
    compare(f"reinforce_pp gamma={gamma} {pad}-padded advantages vs OpenRLHF", advantages, reference_advantages, mask)
    assert (advantages[mask == 0] == 0).all()


def test_reinforce_pp_baseline_equals_openrlhf():
    scores, kl, mask = random_rollout(1)
    advantages, _ = reinforce_pp_advantages(scores, kl, mask, kl_coef=0.05, num_generations=4)
    reference, _ = openrlhf_reinforce(scores, kl, mask, 0.05, 1.0, "reinforce_baseline", 4)
    compare("reinforce_pp baseline (G=4) advantages vs OpenRLHF reinforce_baseline", advantages, reference, mask)


@pytest.mark.parametrize("estimator", ["rloo", "group_norm"])
def test_rloo_and_grpo_equal_openrlhf_at_beta_0(estimator):
    # OpenRLHF's rloo / group_norm with β = 0 put the sequence advantage on every token (γ = 1, no whitening)
    scores, kl, mask = random_rollout(2)
    reference, _ = openrlhf_reinforce(scores, kl, mask, 0.0, 1.0, estimator, 4)
    ours = rloo_advantages(scores, 4) if estimator == "rloo" else grpo_advantages(scores, 4, "group", eps=1e-9)
    compare(f"{estimator} broadcast to tokens vs OpenRLHF {estimator}",
            broadcast_to_tokens(ours, mask), reference, mask)


# ---- over several processes -------------------------------------------------------------------------------------


def run_on_shards(function, shards):
    """Run `function(*shard, all_reduce_sum=...)` in one thread per shard, the threads summing like processes."""
    barrier, slots, results = threading.Barrier(len(shards)), [None] * len(shards), [None] * len(shards)

    def run(rank):
        def all_reduce_sum(tensor):
            slots[rank] = tensor
            barrier.wait()
            total = sum(slots)
            barrier.wait()  # nobody writes the next value before everybody has read this one
            return total

        results[rank] = function(*shards[rank], all_reduce_sum=all_reduce_sum)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_batch_statistics_over_two_processes_equal_one_process():
    scores, kl, mask = random_rollout(3, n=16)
    halves = [slice(0, 8), slice(8, 16)]
    for function, args in [
        (lambda s, all_reduce_sum: grpo_advantages(s, 4, "batch", all_reduce_sum=all_reduce_sum), (scores,)),
        (lambda s, all_reduce_sum: rloo_advantages(s, 4, True, all_reduce_sum=all_reduce_sum), (scores,)),
        (lambda s, k, m, all_reduce_sum: reinforce_pp_advantages(s, k, m, 0.05, all_reduce_sum=all_reduce_sum)[0],
         (scores, kl, mask)),
    ]:
        whole = function(*args, all_reduce_sum=None)
        parts = run_on_shards(function, [tuple(a[half] for a in args) for half in halves])
        assert_close(torch.cat(parts), whole)
        alone = function(*(a[halves[0]] for a in args), all_reduce_sum=None)
        assert not torch.allclose(alone, whole[halves[0]])  # the statistic really spans both shards


# ---- tokens, whitening, loss aggregation, KL --------------------------------------------------------------------


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    expected = torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]])
    assert_close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask), expected)
    with pytest.raises(ValueError, match="N = 2 rows"):
        broadcast_to_tokens(torch.ones(3), mask)


def test_whitening_ignores_padding_garbage():
    values = torch.tensor([[1.0, 3.0, float("nan")]])
    assert_close(whiten_advantages(values, torch.tensor([[1, 1, 0]])), torch.tensor([[-1.0, 1.0, 0.0]]))


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_aggregate_loss_by_hand():
    assert_close(aggregate_loss(LOSS, LOSS_MASK, "grpo"), torch.tensor((2.0 + 4.0) / 2))  # mean of token means
    assert_close(aggregate_loss(LOSS, LOSS_MASK, "bnpo"), torch.tensor(10.0 / 4))
    assert_close(aggregate_loss(LOSS, LOSS_MASK, "dapo"), torch.tensor(10.0 / 4))
    assert_close(aggregate_loss(LOSS, LOSS_MASK, "dapo", normalizer=8), torch.tensor(10.0 / 8))
    assert_close(aggregate_loss(LOSS, LOSS_MASK, "dr_grpo", max_completion_length=5), torch.tensor(10.0 / (2 * 5)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="gspo"), "loss_type must be one of grpo, bnpo, dapo, dr_grpo, cispo, sapo, luspo, vespo"),
    (dict(loss_type="dr_grpo"), "needs max_completion_length"),
    (dict(loss_type="grpo", normalizer=4), "normalizer is for loss_type"),
    (dict(loss_type="dapo", normalizer=0), "normalizer must be > 0"),
])
def test_aggregate_loss_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aggregate_loss(LOSS, LOSS_MASK, **kwargs)


def trl_aggregate(per_token_loss, mask, loss_type, max_completion_length, num_items_in_batch):
    # trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, lines 3153-3174, before the division by
    # the gradient accumulation steps; "dapo" with one process and current_gradient_accumulation_steps ==
    # steps_per_generation, so its normalizer is num_items_in_batch
    if loss_type in ["grpo", "sapo"]:
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    return (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"])
def test_aggregate_loss_equals_trl(loss_type):
    _, _, mask = random_rollout(4, n=16, t=32)
    mask[3] = 0  # an empty row: TRL clamps its length to 1
    per_token_loss = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    num_items = mask.sum() * 3  # the whole accumulated batch holds more tokens than this micro-batch
    ours = aggregate_loss(per_token_loss, mask, loss_type, max_completion_length=32,
                          normalizer=num_items if loss_type in ("dapo", "cispo", "vespo") else None)
    reference = trl_aggregate(per_token_loss, mask, loss_type, 32, num_items)
    compare(f"aggregate_loss {loss_type} vs TRL 1.16", ours, reference)


def test_kl_penalty_k3_equals_trl_grpo_per_token_kl():
    generator = torch.Generator().manual_seed(6)
    per_token_logps = -torch.rand(16, 32, generator=generator) * 5
    ref_per_token_logps = -torch.rand(16, 32, generator=generator) * 5
    # trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, lines 3100-3102
    trl_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    ours = kl_penalty(per_token_logps, ref_per_token_logps, "k3", clamp=None)  # TRL's GRPO does not clamp
    compare("kl_penalty k3 vs TRL 1.16 GRPO per_token_kl", ours, trl_kl)
