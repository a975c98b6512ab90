"""Clipped policy and value losses of PPO (`hf_rlhf.losses.ppo`), against hand-computed tensors."""

import math

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.losses.ppo import policy_loss, value_loss
from hf_rlhf.tensors import masked_mean

MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_policy_loss_at_ratio_1_is_minus_the_mean_advantage():
    torch.manual_seed(0)
    logprobs, advantages = torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    loss, stats = policy_loss(logprobs, logprobs.clone(), advantages, mask, cliprange=0.2)
    assert_close(loss, -masked_mean(advantages, mask))
    assert_close(stats["clipfrac"], torch.tensor(0.0))
    assert_close(stats["approxkl"], torch.tensor(0.0))
    assert_close(stats["ratio"], torch.tensor(1.0))


def clipping_case():
    ratios = [1.5, 0.5, 0.5, 1.1, 7.0]  # the last token is masked out
    advantages = torch.tensor([[1.0, -1.0, 1.0, 2.0, 100.0]])
    logprobs = torch.log(torch.tensor([ratios])).requires_grad_()
    return logprobs, torch.zeros(1, 5), advantages, ratios


def test_policy_loss_when_clipping_binds_by_hand():
    # ε = 0.2; per token max(-A·r, -A·clip(r, 0.8, 1.2)):
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2  (clipped binds)
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8  (clipped binds)
    #   A=+1, r=0.5: max(-0.5, -0.8) = -0.5  (unclipped: the pessimistic bound)
    #   A=+2, r=1.1: max(-2.2, -2.2) = -2.2  (inside the range)
    logprobs, old, advantages, ratios = clipping_case()
    loss, stats = policy_loss(logprobs, old, advantages, MASK, cliprange=0.2)
    assert_close(loss, torch.tensor((-1.2 + 0.8 - 0.5 - 2.2) / 4))
    assert_close(stats["clipfrac"], torch.tensor(0.5))
    assert_close(stats["ratio"], torch.tensor((1.5 + 0.5 + 0.5 + 1.1) / 4))
    assert_close(stats["approxkl"], torch.tensor(0.5 * sum(math.log(r) ** 2 for r in ratios[:4]) / 4))
    assert all(not value.requires_grad for value in stats.values())
    loss.backward()
    # no gradient where the clip binds or the token is masked; d(-A·r)/d(logp) / 4 = -A·r / 4 elsewhere
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -0.5 / 4, -2.2 / 4, 0.0]]))


def test_normalizer_equals_mean_and_splits_exactly_over_micro_batches():
    torch.manual_seed(0)
    logprobs, old, advantages = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    full, _ = policy_loss(logprobs, old, advantages, mask, 0.2)
    assert_close(policy_loss(logprobs, old, advantages, mask, 0.2, normalizer=mask.sum())[0], full)
    assert_close(policy_loss(logprobs, old, advantages, mask, 0.2, normalizer=float(mask.sum()))[0], full)
    # micro-batches of different token counts: per-batch means would not add up to `full`
    tokens = mask.sum()
    micro = sum(policy_loss(logprobs[i:i + 2], old[i:i + 2], advantages[i:i + 2], mask[i:i + 2], 0.2,
                            normalizer=tokens)[0] for i in (0, 2))
    assert_close(micro, full)
    values, old_values, returns = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    full, _ = value_loss(values, old_values, returns, mask, 0.2)
    micro = sum(value_loss(values[i:i + 2], old_values[i:i + 2], returns[i:i + 2], mask[i:i + 2], 0.2,
                           normalizer=tokens)[0] for i in (0, 2))
    assert_close(micro, full)


def test_value_loss_without_change_is_half_the_squared_error():
    old, returns = torch.tensor([[0.0, 1.0, 2.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_loss(old.clone(), old, returns, mask, cliprange_value=0.2)
    assert_close(loss, torch.tensor(0.5 * (1.0 + 0.0 + 4.0) / 3))
    assert_close(stats["clipfrac"], torch.tensor(0.0))


def test_value_loss_when_clipping_binds_by_hand():
    # ε_v = 0.2, V_old = 0:
    #   R=1, V=0.5:  V_clip=0.2   -> max(0.25, 0.64) = 0.64  (clipped binds)
    #   R=1, V=-0.5: V_clip=-0.2  -> max(2.25, 1.44) = 2.25
    #   R=0, V=0.1:  V_clip=0.1   -> 0.01 both
    values = torch.tensor([[0.5, -0.5, 0.1, 5.0]], requires_grad=True)
    old, returns = torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, stats = value_loss(values, old, returns, torch.tensor([[1, 1, 1, 0]]), 0.2)
    assert_close(loss, torch.tensor(0.5 * (0.64 + 2.25 + 0.01) / 3))
    assert_close(stats["clipfrac"], torch.tensor(1 / 3))
    assert not stats["clipfrac"].requires_grad
    loss.backward()
    # ½·(V - R)²/3 -> (V - R)/3 where unclipped; 0 where the clip binds or masked
    assert_close(values.grad, torch.tensor([[0.0, -1.5 / 3, 0.1 / 3, 0.0]]))


@pytest.mark.parametrize("kwargs", [{"cliprange": 0.0}, {"cliprange": 0.2, "normalizer": 0}])
def test_policy_loss_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)
    with pytest.raises(ValueError):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                   kwargs["cliprange"], kwargs.get("normalizer"))
