"""`WeightedRewards` as trl 1.16's `GRPOTrainer._calculate_rewards`: None scores (NaN, out of the sum), async reward
functions run concurrently, TRL's warning for a row no function scored; `check_scores` still refuses them
elsewhere."""

import asyncio
import math

import pytest
import torch

from hf_rlhf.rewards.base import FunctionReward, RewardError, check_scores
from hf_rlhf.rewards.weighted import WeightedRewards


def lengths(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def only_even(prompts, completions, **kwargs):
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def never(prompts, completions, **kwargs):
    return [None] * len(completions)


def test_none_rows_leave_the_sum_as_trl_nansum(caplog):
    rewards = WeightedRewards([lengths, only_even], [1.0, 2.0]).build()
    total = rewards(["p"] * 4, ["a", "bb", "ccc", "dddd"])
    # TRL: (rewards_per_func * weights).nansum(dim=1)
    assert total.tolist() == [1.0 + 2.0, 2.0, 3.0 + 2.0, 4.0]
    assert torch.isnan(rewards.last[1, 1]) and rewards.last[1, 0] == 1.0
    rewards = WeightedRewards([never]).build()
    with caplog.at_level("WARNING"):
        total = rewards(["p"] * 2, ["a", "b"])
    assert torch.isnan(total).all()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


def test_async_functions_run_concurrently():
    """Each function waits for the other's event: run one after the other they would wait forever (timeout)."""
    events = {}

    async def first(prompts, completions, **kwargs):
        events.setdefault("a", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("b", asyncio.Event()).wait(), timeout=5)
        return [1.0] * len(completions)

    async def second(prompts, completions, **kwargs):
        events.setdefault("b", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("a", asyncio.Event()).wait(), timeout=5)
        return [2.0] * len(completions)

    rewards = WeightedRewards([first, lengths, second]).build()
    assert rewards(["p"], ["abc"]).tolist() == [1.0 + 3.0 + 2.0]
    assert rewards.last[:, 0].tolist() == [1.0, 3.0, 2.0]  # each function's scores in its place


def test_async_function_alone_and_none_is_refused_outside_grpo():
    async def scores(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    assert FunctionReward(scores)(["p"], ["c"]).tolist() == [0.5]
    with pytest.raises(RewardError, match="returned None for row 0, expected a number"):
        FunctionReward(never)(["p"], ["c"])
    with pytest.raises(RewardError, match="scores must be finite"):
        check_scores([math.inf], 1, "f", allow_none=True)
