"""hf_rlhf.GRPOConfig / GRPOTrainer against trl 1.16: every GRPOConfig option is classified (mapped, same name,
passed to generate, read by the trainer, ignored where TRL ignores it, or refused with a reason), TRL's defaults are
ours, and GRPOTrainer takes every keyword of trl.GRPOTrainer."""

import dataclasses
import inspect

import pytest
import trl
from transformers import TrainingArguments

from hf_rlhf import GRPOConfig, GRPOTrainer, PPOConfig
from hf_rlhf.trainers.grpo_config import GENERATION_OPTIONS, IGNORED_AS_IN_TRL, IMPLEMENTED, REFUSED, TRL_NAMES

TRAINING_ARGS = {f.name for f in dataclasses.fields(TrainingArguments)}
SAME_NAME = {"num_generations", "temperature", "top_p", "top_k", "epsilon_high", "loss_type", "scale_rewards",
             "importance_sampling_level", "mask_truncated_completions", "entropy_coef", "max_tool_calling_iterations",
             "ds3_gather_for_generation", "generation_kwargs", "disable_dropout", "num_generations_eval"}
READ_BY_TRAINER = {"reward_weights", "use_bias_correction_kl", "steps_per_generation", "generation_batch_size"}
# TRL's documented non-default values of the refused options, each refused with its reason
REFUSED_VALUES = {"use_vllm": True, "use_transformers_continuous_batching": True, "use_transformers_paged": True,
                  "log_completions_hub_repo": "user/completions"}


def trl_fields():
    return {f.name: f for f in dataclasses.fields(trl.GRPOConfig) if f.name not in TRAINING_ARGS}


def trl_default(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_trl_field_is_classified():
    classes = [set(TRL_NAMES), SAME_NAME, set(GENERATION_OPTIONS), READ_BY_TRAINER, IGNORED_AS_IN_TRL, set(REFUSED),
               IMPLEMENTED]
    assert sum(len(c) for c in classes) == len(set().union(*classes)), "a field is in two classes"
    assert set(trl_fields()) == set().union(*classes), "a TRL field is new or gone: classify it"
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(trl_fields()) <= ours
    assert set(REFUSED_VALUES) == set(REFUSED)


def test_trl_defaults_are_ours(tmp_path):
    ours = GRPOConfig(output_dir=str(tmp_path))
    for name, f in trl_fields().items():
        expected = trl_default(f)
        if name == "pad_to_multiple_of":
            expected = None  # "auto": no padding off Neuron, as TRL resolves it
        if name in ("steps_per_generation", "generation_batch_size"):
            continue  # resolved from the batch sizes, as TRL does (below)
        if name == "vllm_importance_sampling_correction":
            assert ours.vllm_importance_sampling_correction is None  # TRL's True acts with vLLM only: off here
            assert not ours.sampling_correction
            continue
        if name == "disable_dropout":
            assert ours.disable_dropout is True  # ours: the rollout's old log-probs are exact only without dropout
            continue
        assert getattr(ours, name) == expected, name
    for name in ("learning_rate", "logging_steps"):  # TrainingArguments' fields TRL sets its own defaults for
        assert getattr(ours, name) == trl_default(next(f for f in dataclasses.fields(trl.GRPOConfig) if f.name == name))
    assert (ours.advantage_estimator, ours.kl_coef, ours.kl_in_loss, ours.kl_estimator, ours.kl_clamp) == (
        "grpo", 0.0, True, "k3", None)
    assert (ours.num_ppo_epochs, ours.response_length, ours.cliprange) == (1, 512, 0.2)


def test_trl_defaults_of_each_field_are_accepted(tmp_path):
    for name, f in trl_fields().items():
        GRPOConfig(output_dir=str(tmp_path), **{name: trl_default(f)})


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_options_say_why(tmp_path, name):
    with pytest.raises(ValueError, match=f"GRPOConfig.{name}=.* is not supported: "):
        GRPOConfig(output_dir=str(tmp_path), **{name: REFUSED_VALUES[name]})


def test_trl_names_and_ours_are_one_option(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), beta=0.04, epsilon=0.3, num_iterations=2, max_completion_length=64)
    assert (config.kl_coef, config.cliprange, config.num_ppo_epochs, config.response_length) == (0.04, 0.3, 2, 64)
    config = GRPOConfig(output_dir=str(tmp_path), kl_coef=0.04)
    assert config.beta == 0.04
    with pytest.raises(ValueError, match="beta=0.1 and kl_coef=0.2 are one option"):
        GRPOConfig(output_dir=str(tmp_path), beta=0.1, kl_coef=0.2)
    with pytest.raises(TypeError, match="'epsilon' is no longer an option: use 'cliprange'"):
        PPOConfig(output_dir=str(tmp_path), epsilon=0.2)  # PPOConfig keeps one name per option


def test_generation_batch_as_in_trl(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        num_generations=4)
    assert (config.steps_per_generation, config.generation_batch_size, config.rollout_batch_size) == (2, 8, 8)
    assert config.steps_per_rollout == 1  # one optimizer step per generation, as TRL's default
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, steps_per_generation=4,
                        num_generations=4, num_iterations=2)
    assert (config.rollout_batch_size, config.num_mini_batches, config.steps_per_rollout) == (16, 4, 8)
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, generation_batch_size=8,
                        num_generations=4)
    assert config.steps_per_generation == 2 and config.rollout_batch_size == 8
    with pytest.raises(ValueError, match="can not be both configured"):
        GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, generation_batch_size=8,
                   steps_per_generation=4, num_generations=4)
    with pytest.raises(ValueError, match="auto_find_batch_size is not supported"):
        GRPOConfig(output_dir=str(tmp_path), auto_find_batch_size=True)


def test_trl_spellings(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), scale_rewards=False, min_p=0.1, repetition_penalty=1.1)
    assert config.scale_rewards == "none"
    assert config.generation_kwargs == {"min_p": 0.1, "repetition_penalty": 1.1}


def test_a_trl_config_converts_field_for_field(tmp_path):
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, beta=0.02,
                            max_completion_length=48, epsilon_high=0.28, use_cpu=True, report_to="none")
    ours = GRPOTrainer.resolve_args(theirs)
    assert isinstance(ours, GRPOConfig)
    assert (ours.kl_coef, ours.response_length, ours.epsilon_high, ours.rollout_batch_size) == (0.02, 48, 0.28, 4)


def test_trainer_takes_every_trl_keyword():
    theirs = [n for n in inspect.signature(trl.GRPOTrainer.__init__).parameters if n != "self"]
    ours = [n for n in inspect.signature(GRPOTrainer.__init__).parameters if n not in ("self", "kwargs")]
    assert ours == theirs  # the same names in the same order: positional calls work too
