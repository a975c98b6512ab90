"""Pairwise reward loss, metrics and last-token gathering (`hf_rlhf.losses.reward`, `hf_rlhf.models.value_head`),
by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.losses.reward import pairwise_metric_sums, pairwise_reward_loss
from hf_rlhf.models.value_head import gather_last_token_scores, last_token_columns
from hf_rlhf.tensors import last_token_index_packed

CHOSEN = [1.0, 0.5, -0.2]
REJECTED = [0.0, 1.0, -0.5]
MARGIN = [0.5, 0.0, 1.0]


def softplus(x):  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


def by_hand(chosen, rejected, margin=None, coefficient=None):
    margin = margin or [0.0] * len(chosen)
    loss = sum(softplus(-(c - r - m)) for c, r, m in zip(chosen, rejected, margin)) / len(chosen)
    if coefficient:
        loss += coefficient * sum((c + r) ** 2 for c, r in zip(chosen, rejected)) / len(chosen)
    return loss


@pytest.mark.parametrize("margin", [None, MARGIN])
@pytest.mark.parametrize("coefficient", [None, 0.0, 0.01, 0.5])
def test_loss_equals_the_formula_by_hand(margin, coefficient):
    loss = pairwise_reward_loss(torch.tensor(CHOSEN, dtype=torch.float64), torch.tensor(REJECTED, dtype=torch.float64),
                                None if margin is None else torch.tensor(margin), coefficient)
    assert loss.ndim == 0
    assert abs(loss.item() - by_hand(CHOSEN, REJECTED, margin, coefficient)) < 1e-6


def test_loss_values_at_known_points():
    zero = torch.zeros(2)
    assert_close(pairwise_reward_loss(zero, zero), torch.tensor(math.log(2)))  # indifferent pair: log 2
    # a margin equal to the gap puts the pair back at indifference
    assert_close(pairwise_reward_loss(torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([2.0])),
                 torch.tensor(math.log(2)))
    # centering alone: rewards 1 and 1 -> (1 + 1)^2 = 4
    assert_close(pairwise_reward_loss(torch.ones(1), torch.ones(1), None, 0.25), torch.tensor(math.log(2) + 1.0))


def test_gradients_push_chosen_up_and_rejected_down():
    chosen = torch.tensor(CHOSEN, requires_grad=True)
    rejected = torch.tensor(REJECTED, requires_grad=True)
    pairwise_reward_loss(chosen, rejected).backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    assert_close(chosen.grad, -rejected.grad)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        pairwise_reward_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        pairwise_reward_loss(torch.zeros(3, 1), torch.zeros(3, 1))


def test_metric_sums_and_means_by_hand():
    sums = pairwise_metric_sums(torch.tensor(CHOSEN), torch.tensor(REJECTED))
    # correct: 1 > 0 and -0.2 > -0.5 -> 2; margins 1 - 0.5 + 0.3 = 0.8; sums 1.3 and 0.5; 3 pairs
    assert_close(sums, torch.tensor([2.0, 0.8, 1.3, 0.5, 3.0]))
    # a tie counts as wrong
    assert_close(pairwise_metric_sums(torch.tensor([2.0]), torch.tensor([2.0])),
                 torch.tensor([0.0, 0.0, 2.0, 2.0, 1.0]))


def test_last_token_columns_right_left_and_no_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0],   # right
                         [0, 0, 1, 1, 1],   # left
                         [1, 1, 1, 1, 1],   # none
                         [0, 1, 0, 0, 0]])  # a single token
    assert last_token_columns(mask).tolist() == [2, 4, 4, 1]
    with pytest.raises(ValueError, match="no real token"):
        last_token_columns(torch.tensor([[1, 1], [0, 0]]))


def test_gather_padded_and_packed_by_hand():
    scores = torch.tensor([[1.0, 2.0, 3.0, 9.0], [9.0, 5.0, 6.0, 7.0]])
    right = gather_last_token_scores(scores, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    left = gather_last_token_scores(scores, attention_mask=torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]]))
    assert right.tolist() == [3.0, 7.0] and left.tolist() == [9.0, 7.0]
    packed = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    index = last_token_index_packed([3, 2, 1])
    assert index.tolist() == [2, 4, 5]
    assert gather_last_token_scores(packed, last_token_index=index).tolist() == [3.0, 5.0, 6.0]
    with pytest.raises(ValueError, match=">= 1"):
        last_token_index_packed([2, 0])


def test_gather_keeps_gradients():
    scores = torch.randn(2, 3, requires_grad=True)
    gather_last_token_scores(scores, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])).sum().backward()
    assert scores.grad.tolist() == [[0, 1, 0], [0, 0, 1]]
