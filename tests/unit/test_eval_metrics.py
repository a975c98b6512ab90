"""The evaluation's math: pass@k (hand-computed, and the Codex paper's numpy estimator), the loss of fresh completions
at ratio 1 (TRL's GRPO loss on the same tensors), the per-process batches, and the isolated RNG stream."""

import random

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.rollout.evaluation import eval_batches, isolated_rng
from hf_rlhf.trainers.eval_metrics import on_policy_loss, pass_at_k, pass_at_k_values


def codex_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021, figure 3, as published."""
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def test_pass_at_k_by_hand():
    correct = torch.tensor([[True, False, False, False], [True, True, False, False], [False] * 4])
    # prompt 0: 1 - C(3,2)/C(4,2) = 1 - 3/6; prompt 1: 1 - C(2,2)/C(4,2) = 1 - 1/6; prompt 2: 0
    assert pass_at_k(correct, 2) == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert pass_at_k(correct, 1) == pytest.approx((1 / 4 + 2 / 4) / 3)  # the mean accuracy
    assert pass_at_k(correct, 4) == pytest.approx(2 / 3)  # any correct of all 4
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(correct, 5)


def test_pass_at_k_equals_the_codex_estimator():
    generator = torch.Generator().manual_seed(0)
    correct = torch.rand(50, 16, generator=generator) < torch.rand(50, 1, generator=generator)
    for k in (1, 2, 3, 8, 16):
        expected = np.mean([codex_pass_at_k(16, int(c), k) for c in correct.sum(1)])
        assert pass_at_k(correct, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_values():
    assert pass_at_k_values(1) == []
    assert pass_at_k_values(4) == [1, 2, 4]
    assert pass_at_k_values(6) == [1, 2, 4, 6]


def trl_grpo_loss_at_ratio_one(rewards, mask, num_generations, scale, loss_type):
    """trl 1.16 GRPOTrainer: advantages (`_generate_and_score_completions`, sum_then_normalize), then `_compute_loss`
    with old = new log-probs (coef 1, no clipping) and beta = 0, before the gradient-accumulation division."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    std = grouped.std(1).repeat_interleave(num_generations) if num_generations > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    per_token_loss = -torch.ones_like(mask, dtype=torch.float32) * advantages.unsqueeze(1)
    mask = mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # bnpo / dapo over one batch


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("scale", ["group", "none"])
def test_on_policy_loss_equals_trls_loss_at_ratio_one(loss_type, scale):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0, -1.0])
    lengths = torch.tensor([3, 1, 4, 2, 4, 4, 1, 2])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).long()
    ours = on_policy_loss(rewards, mask, "grpo", 4, scale, loss_type=loss_type)
    assert_close(ours, trl_grpo_loss_at_ratio_one(rewards, mask, 4, scale, loss_type))
    # dapo by hand: group 0 advantages (r - 0.5) / std; a longer completion weighs more
    if loss_type == "dapo" and scale == "none":
        advantages = torch.tensor([0.5, -0.5, -0.5, 0.5, -0.0, -0.0, 1.5, -1.5])
        assert_close(ours, -(advantages * lengths).sum() / lengths.sum())


def test_on_policy_loss_of_one_completion_per_prompt_is_zero():
    mask = torch.ones(3, 2, dtype=torch.long)
    assert on_policy_loss(torch.tensor([1.0, 0.0, 3.0]), mask, "grpo", 1).item() == 0.0
    assert on_policy_loss(torch.tensor([1.0, 0.0]), mask[:2], "gae", 2).item() == 0.0
    # rloo: r_i - mean of the others
    expected = -torch.tensor([1.0, -1.0]).mean()
    assert_close(on_policy_loss(torch.tensor([1.0, 0.0]), mask[:2], "rloo", 2, loss_type="grpo"), expected)


def test_eval_batches_give_every_process_as_many_batches():
    per_process = [eval_batches(7, 2, rank, 3) for rank in range(3)]
    assert per_process == [[[0, 3], [6]], [[1, 4], [-1]], [[2, 5], [-1]]]
    rows = sorted(i for batches in per_process for batch in batches for i in batch if i >= 0)
    assert rows == list(range(7))
    assert eval_batches(4, 8, 0, 1) == [[0, 1, 2, 3]]


def test_isolated_rng_leaves_every_global_stream_as_it_was():
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    with isolated_rng(123, torch.device("cpu")):
        inside = torch.rand(3)
        random.random()
        np.random.rand()
    with isolated_rng(123, torch.device("cpu")):
        assert torch.equal(torch.rand(3), inside)  # its own seeded stream, the same each time
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
