"""Per-token rewards and GAE (`hf_rlhf.rl.advantages`), against hand-computed tensors."""

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.rl.advantages import gae, per_token_rewards

INF = float("inf")


def test_score_on_the_last_real_token_and_kl_penalty_elsewhere():
    scores = torch.tensor([1.0, 2.0, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, INF, INF], [INF, 0.2, 0.4, INF]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]])
    rewards = per_token_rewards(scores, kl, mask, kl_coef=0.5)
    expected = torch.tensor([
        [-0.05, -0.10, -0.15, -0.20 + 1.0],
        [-0.25, -0.30 + 2.0, 0.0, 0.0],  # right padded: score on index 1, not on the pad at index 3
        [0.0, -0.10, -0.20 + 3.0, 0.0],  # padded on both sides
    ])
    assert_close(rewards, expected)


def test_zero_kl_coef_gives_the_score_alone():
    rewards = per_token_rewards(torch.tensor([0.7]), torch.ones(1, 3), torch.tensor([[1, 1, 0]]), kl_coef=0.0)
    assert_close(rewards, torch.tensor([[0.0, 0.7, 0.0]]))


def test_empty_response_is_an_error_naming_the_row():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        per_token_rewards(torch.ones(2), torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)


REWARDS = torch.tensor([[0.1, -0.2, 1.0]], dtype=torch.float64)
VALUES = torch.tensor([[0.5, 0.3, 0.6]], dtype=torch.float64)
FULL = torch.ones(1, 3)


def test_gae_by_hand_gamma_1():
    # γ = 1, λ = 0.95; V after the last token is 0
    # δ2 = 1.0 + 0 - 0.6 = 0.4;  δ1 = -0.2 + 0.6 - 0.3 = 0.1;  δ0 = 0.1 + 0.3 - 0.5 = -0.1
    # A2 = 0.4;  A1 = 0.1 + 0.95·0.4 = 0.48;  A0 = -0.1 + 0.95·0.48 = 0.356
    advantages, returns = gae(REWARDS, VALUES, FULL, gamma=1.0, lam=0.95)
    assert_close(advantages, torch.tensor([[0.356, 0.48, 0.4]], dtype=torch.float64))
    assert_close(returns, torch.tensor([[0.856, 0.78, 1.0]], dtype=torch.float64))


def test_gae_by_hand_gamma_below_1():
    # γ = 0.9, λ = 0.8, γλ = 0.72
    # δ2 = 1.0 - 0.6 = 0.4;  δ1 = -0.2 + 0.9·0.6 - 0.3 = 0.04;  δ0 = 0.1 + 0.9·0.3 - 0.5 = -0.13
    # A2 = 0.4;  A1 = 0.04 + 0.72·0.4 = 0.328;  A0 = -0.13 + 0.72·0.328 = 0.10616
    advantages, returns = gae(REWARDS, VALUES, FULL, gamma=0.9, lam=0.8)
    assert_close(advantages, torch.tensor([[0.10616, 0.328, 0.4]], dtype=torch.float64))
    assert_close(returns, advantages + VALUES)


def test_lambda_0_is_the_one_step_td_error():
    advantages, _ = gae(REWARDS, VALUES, FULL, gamma=0.9, lam=0.0)
    assert_close(advantages, torch.tensor([[-0.13, 0.04, 0.4]], dtype=torch.float64))


def test_gamma_lambda_1_gives_reward_to_go_minus_value():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    advantages, returns = gae(rewards, values, torch.ones(3, 6), gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    assert_close(returns, reward_to_go)
    assert_close(advantages, reward_to_go - values)


@pytest.mark.parametrize("mask", [[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 0, 1]], ids=["right", "left", "holes"])
def test_padded_row_equals_the_same_row_alone(mask):
    mask = torch.tensor([mask])
    keep = mask.bool()
    # garbage (even inf) at the pads must not reach the real tokens
    rewards = torch.full((1, 5), INF, dtype=torch.float64).masked_scatter(keep, REWARDS)
    values = torch.full((1, 5), -INF, dtype=torch.float64).masked_scatter(keep, VALUES)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    alone_advantages, alone_returns = gae(REWARDS, VALUES, FULL, gamma=0.9, lam=0.8)
    assert_close(advantages[keep], alone_advantages.flatten())
    assert_close(returns[keep], alone_returns.flatten())
    assert (advantages[~keep] == 0).all() and (returns[~keep] == 0).all()


def test_batch_of_rows_with_different_lengths_equals_each_row_alone():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    for row, length in enumerate((5, 2, 1)):
        alone = gae(rewards[row:row + 1, :length], values[row:row + 1, :length], torch.ones(1, length), 0.99, 0.95)
        assert_close(advantages[row, :length], alone[0][0])
        assert_close(returns[row, :length], alone[1][0])


def test_gae_outputs_are_targets_without_gradient():
    values = VALUES.clone().requires_grad_()
    advantages, returns = gae(REWARDS, values, FULL, gamma=1.0, lam=0.95)
    assert not advantages.requires_grad and not returns.requires_grad
