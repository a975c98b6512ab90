"""RewardConfig: device defaults, TRL option names, validation, and every reward recipe YAML loads."""

import glob
import os

import pytest
import yaml

from hf_rlhf import ModelConfig, RewardConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from recipes import reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD_YAMLS = sorted(glob.glob(os.path.join(ROOT, "recipes", "configs", "reward_*.yaml")))


def test_cpu_defaults_turn_off_bf16_and_checkpointing(tmp_path):
    args = RewardConfig(output_dir=str(tmp_path))
    assert args.bf16 is False and args.activation_checkpointing is False
    assert RewardConfig(output_dir=str(tmp_path), activation_checkpointing=True).activation_checkpointing is True


def test_trl_option_names_and_defaults(tmp_path):
    args = RewardConfig(output_dir=str(tmp_path))
    for name in ("max_length", "center_rewards_coefficient", "disable_dropout", "dataset_num_proc", "padding_free",
                 "pad_to_multiple_of", "eos_token", "pad_token", "chat_template_path"):
        assert hasattr(args, name), name
    assert args.learning_rate == 1e-4 and args.max_length == 1024 and args.disable_dropout is True
    assert args.center_rewards_coefficient is None and args.overlong_policy == "drop"


def test_validation(tmp_path):
    with pytest.raises(TypeError, match="center_reward_coefficient"):
        RewardConfig(output_dir=str(tmp_path), center_reward_coefficient=0.01)
    with pytest.raises(ValueError, match="choose one"):
        RewardConfig(output_dir=str(tmp_path), padding_free=True, prefix_sharing=True)
    with pytest.raises(ValueError, match="max_length"):
        RewardConfig(output_dir=str(tmp_path), max_length=1)
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=-1.0)
    with pytest.raises(ValueError, match="reward_stats_num_samples"):
        RewardConfig(output_dir=str(tmp_path), reward_stats_num_samples=0)


def test_unknown_option_on_the_command_line_is_an_error():
    with pytest.raises(ValueError, match="prefix_shareing"):
        parse_recipe_args((ModelConfig, RewardConfig),
                          ["--model_name_or_path", "m", "--output_dir", "x", "--prefix_shareing", "true"], "unused")


def test_there_are_toy_lora_qlora_and_real_model_configs():
    names = {os.path.basename(p) for p in REWARD_YAMLS}
    assert {"reward_toy.yaml", "reward_toy_lora.yaml", "reward_toy_qlora.yaml"} <= names
    assert reward.TOY_CONFIG.endswith("reward_toy.yaml")


@pytest.mark.parametrize("path", REWARD_YAMLS, ids=os.path.basename)
def test_every_reward_recipe_yaml_loads(path):
    with open(path) as f:
        assert isinstance(yaml.safe_load(f), dict)
    script_args, model_config, args = parse_recipe_args(
        (reward.ScriptArguments, ModelConfig, RewardConfig), ["--config", path], "unused")
    assert args.output_dir and isinstance(args, RewardConfig) and isinstance(model_config, ModelConfig)
    if model_config.load_in_4bit:
        assert model_config.use_peft


def test_parsing_seeds_the_rngs_so_a_head_added_at_load_time_is_reproducible(tmp_path):
    """The reward recipe adds a fresh score head to the SFT policy before the Trainer seeds anything."""
    import torch

    argv = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--seed", "3"]
    heads = []
    for _ in range(2):
        parse_recipe_args((ModelConfig, RewardConfig), argv, "unused")
        torch.rand(100)  # whatever ran in between does not matter once parsing re-seeds
        parse_recipe_args((ModelConfig, RewardConfig), argv, "unused")
        heads.append(torch.nn.Linear(16, 1).weight.detach().clone())
    assert torch.equal(heads[0], heads[1])
    parse_recipe_args((ModelConfig, RewardConfig), [*argv[:-1], "4"], "unused")
    assert not torch.equal(torch.nn.Linear(16, 1).weight, heads[0])


def test_reward_config_is_the_data_options_prepare_preference_dataset_reads(tmp_path):
    import dataclasses

    from transformers import HfArgumentParser

    from hf_rlhf.data.options import DataOptions, PreferenceDataOptions

    (args,) = HfArgumentParser((RewardConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--max_length", "64", "--use_margin", "true"])
    assert isinstance(args, PreferenceDataOptions) and isinstance(args, DataOptions)
    assert (args.max_length, args.overlong_policy, args.use_margin) == (64, "drop", True)
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(RewardConfig)}
    assert help_of["max_length"] == "Longest tokenized chosen or rejected sequence."
    assert help_of["eos_token"] == "End-of-sequence token. None: the tokenizer's."
    with pytest.raises(ValueError, match=r"RewardConfig.overlong_policy='cut'; expected one of"):
        RewardConfig(output_dir=str(tmp_path), overlong_policy="cut")
