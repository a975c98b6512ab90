"""The GRPO options (epsilon_high, importance_sampling_level, mask_truncated_completions, filter_groups) against the
formulas of TRL 1.16 / veRL on identical tensors, and hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from hf_rlhf.losses.ppo import importance_log_weights, policy_loss_per_token
from hf_rlhf.rl.critic_free import informative_groups, truncated_loss_mask
from hf_rlhf.trainers.ppo_config import PPOConfig


def trl_per_token_loss(per_token_logps, old_per_token_logps, advantages, mask, epsilon_low, epsilon_high, level):
    """Transcribed from `trl.GRPOTrainer._compute_loss`, TRL 1.16, trl/trainer/grpo_trainer.py:3083-3120
    (loss_type grpo/bnpo/dr_grpo/dapo, delta None). `advantages` is (B, 1) there, as TRL keeps it."""
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    elif level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    return -torch.min(per_token_loss1, per_token_loss2)


def _tensors(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + torch.randn(B, T, generator=g) * 0.4  # ratios well outside [0.8, 1.28] on some tokens
    adv = torch.randn(B, 1, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    return logps, old, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps_high", [None, 0.28, 0.1])
def test_policy_loss_matches_trl_grpo(level, eps_high):
    logps, old, adv, mask = _tensors()
    ours, _ = policy_loss_per_token(logps, old, adv.expand_as(logps), mask, 0.2, eps_high, level)
    theirs = trl_per_token_loss(logps, old, adv, mask, 0.2, 0.2 if eps_high is None else eps_high, level)
    theirs = theirs.expand_as(logps)  # (B, 1) at the sequence level
    on = mask.bool()
    torch.testing.assert_close(ours[on], theirs[on], rtol=0, atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradients_match_trl_grpo(level):
    logps, old, adv, mask = _tensors(1)
    a = logps.clone().requires_grad_()
    b = logps.clone().requires_grad_()
    ours, _ = policy_loss_per_token(a, old, adv.expand_as(logps), mask, 0.2, 0.28, level)
    theirs = trl_per_token_loss(b, old, adv, mask, 0.2, 0.28, level).expand_as(logps)
    (ours * mask).sum().backward()
    (theirs * mask).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


def test_clip_higher_by_hand():
    # ratio 1.25 with A = +1: clipped at 1.2 with the symmetric clip, not with epsilon_high = 0.28
    logp = torch.tensor([[math.log(1.25)]])
    zero, one, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    sym, stats = policy_loss_per_token(logp, zero, one, mask, 0.2)
    assert sym.item() == pytest.approx(-1.2) and stats["clipfrac"].item() == 1.0
    high, stats = policy_loss_per_token(logp, zero, one, mask, 0.2, 0.28)
    assert high.item() == pytest.approx(-1.25) and stats["clipfrac"].item() == 0.0
    # the lower clip is still cliprange's: ratio 0.7 with A = -1 -> -(-1)·0.8 = 0.8
    low, _ = policy_loss_per_token(torch.tensor([[math.log(0.7)]]), zero, -one, mask, 0.2, 0.28)
    assert low.item() == pytest.approx(0.8)


def test_sequence_importance_weight_by_hand():
    # log-ratios 0.1, 0.3 on the two real tokens (the third is padding, holding a huge value): weight exp(0.2)
    log_ratio = torch.tensor([[0.1, 0.3, 50.0]])
    mask = torch.tensor([[1, 1, 0]])
    w = importance_log_weights(log_ratio, mask, "sequence")
    torch.testing.assert_close(w, torch.full((1, 3), 0.2))
    assert importance_log_weights(log_ratio, mask, "token") is log_ratio
    assert importance_log_weights(torch.zeros(1, 2), torch.zeros(1, 2), "sequence").eq(0).all()  # no token: 0
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_log_weights(log_ratio, mask, "group")


def test_truncated_loss_mask_matches_trl():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    stopped = torch.tensor([False, True, True])
    # TRL 1.16, trl/trainer/grpo_trainer.py:2492: completion_mask * (~is_truncated).unsqueeze(1).int()
    trl = mask * (~(~stopped)).unsqueeze(1).int()
    assert torch.equal(truncated_loss_mask(mask, stopped), trl)
    assert truncated_loss_mask(mask, stopped)[0].sum() == 0


def verl_kept_groups(scores, G):
    """veRL's filter_groups (recipe/dapo/dapo_ray_trainer.py): keep a prompt whose metric has np.std > 0 (or one
    sample)."""
    groups = np.asarray(scores).reshape(-1, G)
    return [bool(np.std(g) > 0 or len(g) == 1) for g in groups]


def test_informative_groups_match_verl():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0])
    keep = informative_groups(scores, 4)
    assert keep.tolist() == verl_kept_groups(scores.numpy(), 4) == [False, True, True, False]
    # a group of equal scores whose responses differ in stopping gets different missing-stop penalties: kept
    stopped = torch.tensor([True] * 4 + [True] * 8 + [True, False, True, True])
    assert informative_groups(scores, 4, stopped).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="multiple of num_generations"):
        informative_groups(scores[:6], 4)


def test_config_checks_name_the_option():
    base = dict(output_dir="/tmp/x", report_to="none", advantage_estimator="grpo", num_generations=2,
                per_device_train_batch_size=2)
    assert PPOConfig(**base).epsilon_high is None
    with pytest.raises(ValueError, match="epsilon_high must be > 0"):
        PPOConfig(**base, epsilon_high=0.0)
    with pytest.raises(ValueError, match="importance_sampling_level.*token.*sequence"):
        PPOConfig(**base, importance_sampling_level="group")
    with pytest.raises(ValueError, match="filter_groups .* needs a group estimator"):
        PPOConfig(output_dir="/tmp/x", report_to="none", filter_groups=True)
    with pytest.raises(ValueError, match="max_num_gen_batches must be >= 1"):
        PPOConfig(**base, filter_groups=True, max_num_gen_batches=0)
