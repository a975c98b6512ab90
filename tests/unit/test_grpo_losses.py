"""hf_rlhf.losses.grpo (TRL 1.16's GRPO loss types, delta, masks, the sampler correction) against TRL's own
functions (`GRPOTrainer.get_off_policy_mask`, `get_gamma_weights`, `get_high_entropy_mask`) and TRL's code path of
`_compute_loss` / `_generate_and_score_completions` transcribed on identical tensors, plus hand-computed cases."""

import math
import types

import pytest
import torch
from torch.testing import assert_close
from trl import GRPOTrainer as TRLGRPOTrainer

from hf_rlhf.losses.grpo import (
    LOSS_TYPES,
    adaptive_entropy_coef,
    entropy_threshold,
    gamma_weights,
    grpo_policy_loss_per_token,
    high_entropy_mask,
    off_policy_mask,
    sampling_importance_ratio,
    sampling_mismatch_sums,
)
from hf_rlhf.rl import critic_free


def _tensors(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + torch.randn(B, T, generator=g) * 0.4
    adv = torch.randn(B, 1, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    return logps, old, adv, mask


def trl_per_token_loss(loss_type, per_token_logps, old_per_token_logps, advantages, mask, epsilon_low,
                       epsilon_high, level, delta, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0), is_ratio=None):
    """Transcribed from `trl.GRPOTrainer._compute_loss` (TRL 1.16, trl/trainer/grpo_trainer.py:3075-3140), with
    `get_gamma_weights` imported from TRL; `advantages` (B, 1) as TRL keeps them."""
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo[0], sapo[1])
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    else:
        phi_seq = TRLGRPOTrainer.get_gamma_weights(advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
                                                   importance_sampling_ratio=is_ratio, k_pos=vespo[0],
                                                   lambda_pos=vespo[1], k_neg=vespo[2], lambda_neg=vespo[3])
        per_token_loss = -phi_seq * advantages * per_token_logps
    return per_token_loss.expand_as(per_token_logps)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("delta", [None, 1.1])
def test_per_token_loss_and_gradient_equal_trl(loss_type, level, delta):
    logps, old, adv, mask = _tensors(1)
    a, b = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    ours, stats = grpo_policy_loss_per_token(loss_type, a, old, adv.expand_as(logps), mask, 0.2, 0.28, level, delta)
    theirs = trl_per_token_loss(loss_type, b, old, adv, mask, 0.2, 0.28, level, delta)
    on = mask.bool()
    assert_close(ours[on], theirs[on], rtol=1e-6, atol=1e-6)
    (ours * mask).sum().backward()
    (theirs * mask).sum().backward()
    assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert stats["ratio"].shape == logps.shape


def test_vespo_with_the_sampler_ratio_equals_trl():
    logps, old, adv, mask = _tensors(2)
    sampling = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    ratio = sampling_importance_ratio(old, sampling, mask, "token_truncate", None, 3.0)
    ours, stats = grpo_policy_loss_per_token("vespo", logps, old, adv.expand_as(logps), mask, 0.2, 0.28,
                                             vespo=(1.5, 2.0, 2.5, 1.0), sampling_ratio=ratio)
    theirs = trl_per_token_loss("vespo", logps, old, adv, mask, 0.2, 0.28, "token", None,
                                vespo=(1.5, 2.0, 2.5, 1.0), is_ratio=ratio)
    assert_close(ours[mask.bool()], theirs[mask.bool()], rtol=1e-6, atol=1e-6)
    phi = TRLGRPOTrainer.get_gamma_weights(adv, logps - old, mask, ratio, 1.5, 2.0, 2.5, 1.0)
    assert_close(stats["phi"], phi[:, 0])
    assert_close(gamma_weights(adv[:, 0], torch.zeros_like(logps), mask), torch.ones(6))  # φ(1) = 1


def test_delta_caps_the_unclipped_ratio_by_hand():
    # ratio e^1 ≈ 2.72 with A = -1: PPO's loss is max(2.72, 0.8) = 2.72; capped at δ = 1.5 it is 1.5
    logps, old, adv, mask = torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1)
    loss, _ = grpo_policy_loss_per_token("grpo", logps, old, adv, mask, 0.2, 0.2, delta=1.5)
    assert_close(loss, torch.tensor([[1.5]]))
    loss, _ = grpo_policy_loss_per_token("grpo", logps, old, adv, mask, 0.2, 0.2)
    assert_close(loss, torch.tensor([[math.e]]))


def test_off_policy_mask_equals_trl():
    logps, old, adv, mask = _tensors(4)
    sampling = old.clone()
    sampling[2, 0] = float("nan")  # not scored: no KL evidence
    for threshold in (0.0, 0.1, 0.5):
        theirs = TRLGRPOTrainer.get_off_policy_mask(adv, logps, sampling, mask, threshold)
        assert_close(off_policy_mask(adv[:, 0], logps, sampling, mask, threshold), theirs[:, 0])
    # by hand: a negative advantage with mean KL 0.3 > 0.2 is dropped; the positive one is kept
    drop = off_policy_mask(torch.tensor([-1.0, 1.0]), torch.zeros(2, 2), torch.full((2, 2), 0.3), torch.ones(2, 2), .2)
    assert drop.tolist() == [0.0, 1.0]


def test_high_entropy_mask_equals_trl():
    g = torch.Generator().manual_seed(5)
    entropies = torch.rand(6, 7, generator=g) * 2
    mask = (torch.rand(6, 7, generator=g) > 0.3).float()
    one_process = types.SimpleNamespace(accelerator=types.SimpleNamespace(
        pad_across_processes=lambda t, dim, pad_index: t, gather=lambda t: t))
    for quantile in (0.0, 0.2, 0.8):
        theirs = TRLGRPOTrainer.get_high_entropy_mask(one_process, entropies, mask, quantile)
        ours = high_entropy_mask(entropies, mask, entropy_threshold(entropies[mask.bool()], quantile))
        assert torch.equal(ours, theirs)
    assert not high_entropy_mask(entropies, mask, None).any()


def trl_sampling_correction(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, clip_min, clip_max):
    """Transcribed from `trl.GRPOTrainer._generate_and_score_completions` (TRL 1.16, grpo_trainer.py:2627-2670 and
    the metrics of 2860-2895, one process)."""
    per_token_logps_diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * completion_mask, nan=0.)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
    m = completion_mask.bool()
    delta = delta[m & ~torch.isnan(delta)]
    flat = ratio.flatten() if sequence_level_is else ratio[m]
    metrics = {"sampling/sampling_logp_difference/mean": delta.mean(),
               "sampling/sampling_logp_difference/max": delta.max(),
               "sampling/importance_sampling_ratio/min": flat.min(),
               "sampling/importance_sampling_ratio/mean": flat.mean(),
               "sampling/importance_sampling_ratio/max": flat.max()}
    return ratio, metrics


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 1.2)])
def test_injected_offset_mismatch_and_corrected_loss_equal_trl(mode, bounds):
    """A known offset injected into the sampler's log-probs: the logged mismatch is that offset, and the corrected
    loss (ratio × per-token loss, then the KL, then the reduction) equals TRL's on the same tensors."""
    logps, old, adv, mask = _tensors(6)
    offset = torch.full_like(old, 0.03)
    offset[::2] = -0.05  # rows 0, 2, 4 sampled 0.05 below the trainer, rows 1, 3, 5 0.03 above
    sampling = old + offset
    ratio = sampling_importance_ratio(old, sampling, mask, mode, *bounds)
    theirs_ratio, theirs_metrics = trl_sampling_correction(old, sampling, mask, mode, *bounds)
    assert_close(ratio, theirs_ratio.expand_as(ratio))
    ours_metrics = sampling_mismatch_sums(old, sampling, mask, ratio, mode)
    assert ours_metrics.keys() == theirs_metrics.keys()
    for name, value in theirs_metrics.items():
        assert_close(ours_metrics[name], value, msg=name)
    assert_close(ours_metrics["sampling/sampling_logp_difference/max"], torch.tensor(0.05))
    assert_close(ours_metrics["sampling/sampling_logp_difference/mean"], (offset.abs() * mask).sum() / mask.sum())
    if mode == "token_truncate" and bounds[0] is None:  # by hand: exp(+0.05) per token on rows 0, 2, 4
        assert_close(ratio[0, 0], torch.tensor(math.exp(0.05)))
    # the corrected loss, dapo and grpo reductions with β = 0.04 and the k3 KL
    ref = logps - 0.1
    for loss_type in ("grpo", "dapo"):
        per_token, _ = grpo_policy_loss_per_token(loss_type, logps, old, adv.expand_as(logps), mask, 0.2, 0.28)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        ours = critic_free.aggregate_loss(per_token * ratio + 0.04 * kl, mask, loss_type,
                                          normalizer=mask.sum() if loss_type == "dapo" else None)
        trl_token = trl_per_token_loss(loss_type, logps, old, adv, mask, 0.2, 0.28, "token", None)
        trl_token = trl_token * theirs_ratio + 0.04 * kl
        if loss_type == "grpo":
            expected = ((trl_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        else:
            expected = (trl_token * mask).sum() / mask.sum().clamp(min=1.0)
        assert_close(ours, expected)


def test_sampling_correction_masks_outside_the_bounds_by_hand():
    old = torch.zeros(2, 2)
    sampling = torch.tensor([[-2.0, 0.0], [0.0, 0.0]])  # row 0: sequence ratio e^2 ≈ 7.4 > 3
    ratio = sampling_importance_ratio(old, sampling, torch.ones(2, 2), "sequence_mask", None, 3.0)
    assert ratio.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    ratio = sampling_importance_ratio(old, sampling, torch.ones(2, 2), "sequence_truncate", None, 3.0)
    assert ratio.tolist() == [[3.0, 3.0], [1.0, 1.0]]


def test_adaptive_entropy_coef_as_trl():
    # TRL 1.16 grpo_trainer.py:3218-3225: + delta (capped) at or below the target, else - delta (floored)
    assert adaptive_entropy_coef(0.1, 0.1, 0.2, 0.05, 0.0, 0.12) == 0.12
    assert adaptive_entropy_coef(0.1, 0.2, 0.2, 0.05, 0.0, 1.0) == pytest.approx(0.15)
    assert adaptive_entropy_coef(0.02, 0.3, 0.2, 0.05, 0.0, 1.0) == 0.0


def trl_normalize_then_sum_advantages(rewards_per_func, weights, num_generations):
    """Transcribed from the `normalize_then_sum` branch of TRL 1.16's `_generate_and_score_completions`."""
    from trl.trainer.utils import nanstd

    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards)
    return torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4), nan=0.0)


def test_normalize_then_sum_equals_trl():
    g = torch.Generator().manual_seed(7)
    per_func = torch.randn(12, 3, generator=g) * torch.tensor([1.0, 10.0, 0.1])
    weights = torch.tensor([1.0, 0.5, 2.0])
    summed = critic_free.normalize_then_sum(per_func, weights, 4)
    ours = critic_free.grpo_advantages(summed, 4, "batch")
    assert_close(ours, trl_normalize_then_sum_advantages(per_func, weights, 4), rtol=1e-5, atol=1e-5)


def test_none_rewards_left_out_of_the_group_as_trl():
    """NaN (a reward function's None) is out of the group's mean and std; an unscorable row's advantage is 0."""
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(8)
    per_func = torch.randn(8, 2, generator=g)
    per_func[1, 1] = float("nan")
    per_func[5] = float("nan")  # no function scored row 5
    weights = torch.tensor([1.0, 2.0])
    rewards = (per_func * weights).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    # TRL 1.16, sum_then_normalize, scale_rewards="group"
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    theirs = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    ours = critic_free.grpo_advantages(rewards, 4, "group")
    assert_close(ours, theirs)
    assert ours[5] == 0
