"""Every PPO recipe YAML (recipes/configs/ppo_*.yaml and the estimators' grpo_ / rloo_ / reinforce_pp_*.yaml) loads
into the PPO recipe's dataclasses, and the toy configs are self-consistent."""

import glob
import os

import pytest
import yaml

from hf_rlhf import ModelConfig, PPOConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.toy.chain import ToyChainArguments
from recipes import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ESTIMATOR_TOYS = {"grpo": "grpo_toy.yaml", "rloo": "rloo_toy.yaml", "reinforce_pp": "reinforce_pp_toy.yaml"}
PPO_YAMLS = sorted(glob.glob(os.path.join(ROOT, "recipes", "configs", "ppo_*.yaml"))
                   + [os.path.join(ROOT, "recipes", "configs", name) for name in ESTIMATOR_TOYS.values()])


def parse(path, *extra):
    """(script options, toy chain options, ModelConfig, PPOConfig) as recipes/ppo.py parses them."""
    return parse_recipe_args((ppo.ScriptArguments, ToyChainArguments, ModelConfig, PPOConfig),
                             ["--config", path, *extra], "unused")


def test_there_is_a_toy_config_and_it_is_the_default():
    assert os.path.join(ROOT, "recipes", "configs", "ppo_toy.yaml") in PPO_YAMLS
    assert ppo.TOY_CONFIG.endswith("ppo_toy.yaml")


@pytest.mark.parametrize("path", PPO_YAMLS, ids=os.path.basename)
def test_every_ppo_recipe_yaml_loads(path):
    with open(path) as f:
        assert isinstance(yaml.safe_load(f), dict)
    script_args, _, model_config, args = parse(path)
    assert args.output_dir and isinstance(args, PPOConfig) and isinstance(model_config, ModelConfig)
    assert script_args.reward_source in ("model", "function")
    assert args.rollout_batch_size % (args.per_device_train_batch_size * args.gradient_accumulation_steps) == 0
    if args.kl_target is not None:
        assert args.kl_horizon > 0


def test_toy_config_fits_the_toy_task():
    script_args, toy_args, model_config, args = parse(os.path.join(ROOT, "recipes", "configs", "ppo_toy.yaml"))
    assert script_args.dataset_name is None and model_config.model_name_or_path is None  # the toy task
    assert 6 <= args.response_length <= 12  # answers are <= 5 characters + eos
    assert args.kl_target is not None  # the adaptive controller, as the KL acceptance criterion asks
    # one log per rollout: the logged KL is one rollout's KL, not an average over several
    assert args.logging_steps == args.steps_per_rollout
    assert toy_args.toy_train_size >= args.rollout_batch_size * args.max_steps // args.steps_per_rollout


def test_command_line_wins_and_unknown_options_fail():
    path = os.path.join(ROOT, "recipes", "configs", "ppo_toy.yaml")
    script_args, _, _, args = parse(path, "--reward_source", "function", "--kl_coef", "0.2")
    assert script_args.reward_source == "function" and args.kl_coef == 0.2
    with pytest.raises(ValueError, match="reward_sorce"):
        parse(path, "--reward_sorce", "function")
    with pytest.raises(SystemExit):
        parse(path, "--reward_source", "http")  # not one of the choices


def _toy(name):
    return parse(os.path.join(ROOT, "recipes", "configs", name))


@pytest.mark.parametrize("estimator", list(ESTIMATOR_TOYS))
def test_estimator_toy_configs_spend_ppos_sample_budget(estimator):
    *_, ppo = _toy("ppo_toy.yaml")
    script_args, toy_args, model_config, args = _toy(ESTIMATOR_TOYS[estimator])
    assert args.advantage_estimator == estimator and args.critic_free and ppo.advantage_estimator == "gae"
    assert script_args.dataset_name is None and model_config.model_name_or_path is None  # the toy task
    rollouts = args.max_steps // args.steps_per_rollout
    assert rollouts * args.rollout_batch_size == ppo.max_steps // ppo.steps_per_rollout * ppo.rollout_batch_size
    assert args.logging_steps == args.steps_per_rollout  # one log per rollout, as PPO's
    # enough prompts for every rollout without a second pass (each sampled num_generations times)
    assert toy_args.toy_train_size >= rollouts * args.prompts_per_rollout
    same = ("response_length", "temperature", "learning_rate", "kl_target", "per_device_train_batch_size",
            "gradient_accumulation_steps", "num_ppo_epochs", "reward_normalization", "missing_eos_penalty")
    if estimator == "grpo":  # GRPO samples at TRL's 1.0: groups of 8 at 0.7 were too often all equal (docs/grpo.md)
        assert (args.temperature, ppo.temperature) == (1.0, 0.7)
        same = tuple(k for k in same if k != "temperature")
    assert {k: getattr(args, k) for k in same} == {k: getattr(ppo, k) for k in same}


def test_the_recipe_takes_the_estimator_on_the_command_line():
    path = os.path.join(ROOT, "recipes", "configs", "ppo_toy.yaml")
    *_, args = parse(path, "--advantage_estimator", "grpo", "--num_generations", "8", "--kl_in_loss", "true",
                       "--loss_type", "dr_grpo", "--scale_rewards", "none")
    assert (args.advantage_estimator, args.num_generations, args.kl_in_loss, args.loss_type, args.scale_rewards) == (
        "grpo", 8, True, "dr_grpo", "none")
    assert args.prompts_per_rollout == 64
    with pytest.raises(SystemExit):
        parse(path, "--advantage_estimator", "ppo2")  # not one of the choices


@pytest.mark.parametrize("estimator,expected", [("gae", 1), ("grpo", 8), ("rloo", 8), ("reinforce_pp", 1),
                                                ("reinforce_pp_baseline", 8)])
def test_num_generations_defaults_to_trls_for_group_estimators(tmp_path, estimator, expected):
    """`--advantage_estimator grpo` alone runs: G = 8 (trl.GRPOConfig's default) for the estimators whose baseline
    is the prompt's group, 1 for the others; a given value is kept."""
    args = PPOConfig(output_dir=str(tmp_path), advantage_estimator=estimator, rollout_batch_size=16,
                     per_device_train_batch_size=8)
    assert args.num_generations == expected
    assert PPOConfig(output_dir=str(tmp_path), advantage_estimator=estimator, num_generations=4,
                     per_device_train_batch_size=8).num_generations == 4
