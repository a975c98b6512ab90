"""`RLOOConfig` has every field of trl 1.16's RLOOConfig with TRL's default, refuses GRPO's loss options by name, and
its fixed math (the summed sequence ratio, the mean over sequences) is TRL RLOOTrainer's loss on the same tensors."""

import dataclasses

import pytest
import torch
import trl
from torch.testing import assert_close
from transformers import TrainingArguments

from hf_rlhf import RLOOConfig
from hf_rlhf.losses.ppo import importance_log_weights, policy_loss_per_token
from hf_rlhf.rl.critic_free import aggregate_loss
from hf_rlhf.trainers.rloo_config import GRPO_ONLY

TRAINING_ARGS = {f.name for f in dataclasses.fields(TrainingArguments)}


def trl_default(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_trl_field_with_trls_default(tmp_path):
    ours = RLOOConfig(output_dir=str(tmp_path))
    for f in dataclasses.fields(trl.RLOOConfig):
        if f.name in TRAINING_ARGS and f.name not in ("learning_rate", "logging_steps"):
            continue
        if f.name in ("steps_per_generation", "generation_batch_size"):
            continue  # resolved from the batch sizes, as TRL does
        if f.name == "disable_dropout":
            assert ours.disable_dropout is True  # as GRPOConfig: the old log-probs are exact only without dropout
            continue
        expected = None if f.name == "pad_to_multiple_of" else trl_default(f)  # "auto", resolved as GRPOConfig
        assert getattr(ours, name := f.name) == expected, name
    assert (ours.num_generations, ours.beta, ours.kl_coef) == (2, 0.05, 0.05)  # RLOO's, not GRPO's 8 and 0
    assert (ours.advantage_estimator, ours.kl_in_loss, ours.kl_estimator) == ("rloo", False, "k1")


def test_a_trl_config_converts(tmp_path):
    from hf_rlhf import RLOOTrainer

    theirs = trl.RLOOConfig(output_dir=str(tmp_path), beta=0.1, num_generations=4, per_device_train_batch_size=4,
                            normalize_advantages=True, reward_clip_range=(-1.0, 2.0), report_to="none",
                            bf16=False)
    ours = RLOOTrainer.resolve_args(theirs)
    assert isinstance(ours, RLOOConfig)
    assert (ours.kl_coef, ours.num_generations, ours.normalize_advantages) == (0.1, 4, True)
    assert ours.reward_clip_range == (-1.0, 2.0)


@pytest.mark.parametrize("name, value", [("loss_type", "dapo"), ("scale_rewards", "none"), ("entropy_coef", 0.01),
                                         ("importance_sampling_level", "token"), ("use_bias_correction_kl", False)])
def test_grpo_only_options_are_refused_by_name(tmp_path, name, value):
    assert name in GRPO_ONLY
    with pytest.raises(ValueError, match=f"RLOOConfig.{name}=.*trl's RLOOConfig has no option"):
        RLOOConfig(output_dir=str(tmp_path), **{name: value})


def test_reward_clip_range(tmp_path):
    assert RLOOConfig(output_dir=str(tmp_path), reward_clip_range="-1,3").reward_clip_range == (-1.0, 3.0)
    with pytest.raises(ValueError, match="min <= max"):
        RLOOConfig(output_dir=str(tmp_path), reward_clip_range=(2.0, 1.0))


def test_rloo_loss_equals_trls_on_the_same_tensors():
    """trl 1.16 RLOOTrainer._compute_loss: coef_1 = exp(Σ logp - Σ old_logp) per sequence, clamped at 1 ± ε,
    -min(coef_1·A, coef_2·A) per sequence, mean over sequences."""
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 5, generator=generator)
    old = logprobs + 0.05 * torch.randn(4, 5, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    advantages = torch.tensor([0.5, -1.0, 2.0, -0.3])
    coef_1 = torch.exp((logprobs * mask).sum(1) - (old * mask).sum(1))
    coef_2 = coef_1.clamp(1 - 0.2, 1 + 0.28)
    trl_loss = -torch.min(coef_1 * advantages, coef_2 * advantages).mean()
    per_token, _ = policy_loss_per_token(logprobs, old, advantages[:, None].expand(4, 5), mask, 0.2, 0.28,
                                         "sequence_sum")
    assert_close(aggregate_loss(per_token, mask, "grpo"), trl_loss)
    by_hand = (logprobs - old)[1].sum()  # a full row: the summed log-ratio on every token
    assert_close(importance_log_weights(logprobs - old, mask, "sequence_sum")[1], by_hand.expand(5))
