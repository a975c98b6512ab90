"""`RunningMoments` (torch only): the merged batch-by-batch moments equal those of all scores at once."""

import subprocess
import sys

import torch
from torch.testing import assert_close

from hf_rlhf.rl.running_moments import RunningMoments


def test_running_moments_equal_the_moments_of_every_score_seen():
    torch.manual_seed(0)
    batches = [torch.randn(5) * 3 + 2, torch.randn(2, 4) - 1, torch.empty(0), torch.randn(1) * 10]
    moments = RunningMoments()
    for batch in batches:
        moments.update(batch)
    seen = torch.cat([b.reshape(-1) for b in batches]).double()
    assert moments.count == seen.numel() == 14
    assert_close(moments.mean, seen.mean().item(), rtol=1e-12, atol=1e-12)
    assert_close(moments.var, seen.var(unbiased=False).item(), rtol=1e-12, atol=1e-12)
    assert_close(moments.normalize(seen), (seen - seen.mean()) / (seen.std(unbiased=False) + 1e-8))


def test_running_moments_state_round_trips():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 6.0]))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.state_dict() == moments.state_dict() == {"mean": 3.0, "var": 14 / 3, "count": 3}
    restored.update(torch.tensor([7.0]))
    assert restored.mean == 4.0 and restored.count == 4


def test_rl_math_losses_and_the_rewards_package_import_without_transformers():
    code = ("import sys, hf_rlhf.rl.kl, hf_rlhf.rl.advantages, hf_rlhf.rl.critic_free, hf_rlhf.rl.estimators, "
            "hf_rlhf.rl.running_moments, hf_rlhf.losses.ppo, hf_rlhf.losses.dpo, hf_rlhf.losses.reward, "
            "hf_rlhf.losses.sft, hf_rlhf.rewards\n"
            "heavy = [m for m in ('transformers', 'peft', 'trl', 'datasets') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)
