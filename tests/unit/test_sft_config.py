"""SFTConfig (`hf_rlhf.trainers.sft_config`) and ModelConfig: device defaults, validation, unknown options, and every
SFT recipe YAML loads."""

import dataclasses
import glob
import os

import pytest
import yaml

from hf_rlhf import ModelConfig, SFTConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from recipes import sft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_defaults_turn_off_bf16_and_checkpointing(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path))
    assert args.bf16 is False
    assert args.activation_checkpointing is False


def test_explicit_values_win(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), activation_checkpointing=True)
    assert args.activation_checkpointing is True


def test_trl_option_names_and_defaults(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path))
    for name in ("max_length", "packing", "packing_strategy", "padding_free", "completion_only_loss",
                 "assistant_only_loss", "dataset_text_field", "chat_template_path", "eos_token", "pad_token"):
        assert hasattr(args, name), name
    assert args.learning_rate == 2e-5 and args.max_length == 1024


def test_unknown_option_in_constructor_is_an_error(tmp_path):
    with pytest.raises(TypeError, match="packign"):
        SFTConfig(output_dir=str(tmp_path), packign=True)


def test_unknown_option_on_command_line_is_an_error():
    with pytest.raises(ValueError, match="packign"):
        parse_recipe_args((ModelConfig, SFTConfig),
                          ["--model_name_or_path", "m", "--output_dir", "x", "--packign", "true"], "unused.yaml")


def test_unknown_option_in_yaml_is_an_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output_dir: x\nlearning_rat: 0.1\n")
    with pytest.raises(ValueError, match="learning_rat"):
        parse_recipe_args((ModelConfig, SFTConfig), ["--config", str(cfg)], "unused.yaml")


def test_command_line_overrides_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output_dir: x\nlearning_rate: 0.1\nmax_length: 64\n")
    _, args = parse_recipe_args((ModelConfig, SFTConfig), ["--config", str(cfg), "--max_length", "32"], "u")
    assert args.learning_rate == 0.1 and args.max_length == 32


def test_model_config_validation():
    with pytest.raises(ValueError, match="cannot both"):
        ModelConfig(use_peft=True, load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ValueError, match="use_peft"):
        ModelConfig(load_in_4bit=True)
    assert ModelConfig(use_bnb_nested_quant=True).bnb_4bit_use_double_quant is True
    assert ModelConfig().attn_implementation == "sdpa"  # no flash-attn / CUDA here
    with pytest.raises(ImportError, match="hf-rlhf\\[flash\\]"):
        ModelConfig(attn_implementation="flash_attention_2")


def test_packing_needs_max_length(tmp_path):
    with pytest.raises(ValueError, match="max_length"):
        SFTConfig(output_dir=str(tmp_path), packing=True, max_length=None)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "configs", "sft_*.yaml"))))
def test_every_sft_recipe_yaml_loads(path):
    with open(path) as f:
        assert isinstance(yaml.safe_load(f), dict)
    script_args, model_config, args = parse_recipe_args(
        (sft.ScriptArguments, ModelConfig, SFTConfig), ["--config", path], "unused")
    assert args.output_dir


def test_toy_yaml_supplies_defaults_unless_a_real_run_is_asked_for(tmp_path):
    toy = tmp_path / "toy.yaml"
    toy.write_text("output_dir: toy-out\nlearning_rate: 0.002\n")
    _, args = parse_recipe_args((ModelConfig, SFTConfig), ["--output_dir", "elsewhere"], str(toy))
    assert args.learning_rate == 0.002 and args.output_dir == "elsewhere"
    model_config, args = parse_recipe_args(
        (ModelConfig, SFTConfig), ["--model_name_or_path", "some/model", "--output_dir", "x"], str(toy))
    assert args.learning_rate == 2e-5 and model_config.model_name_or_path == "some/model"


def test_sft_config_is_the_data_options_prepare_sft_dataset_reads(tmp_path):
    from transformers import HfArgumentParser

    from hf_rlhf.data.options import DataOptions, SFTDataOptions

    (args,) = HfArgumentParser((SFTConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--max_length", "64", "--overlong_policy", "drop", "--dataset_num_proc", "2"])
    assert isinstance(args, SFTDataOptions) and isinstance(args, DataOptions)
    assert (args.max_length, args.overlong_policy, args.dataset_num_proc) == (64, "drop", 2)
    defaults = SFTConfig(output_dir=str(tmp_path))
    assert (defaults.overlong_policy, defaults.max_length, defaults.dataset_text_field) == ("truncate", 1024, "text")
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(SFTConfig)}
    assert help_of["max_length"] == "Longest tokenized example / packed row length."
    assert help_of["eos_token"] == "End-of-turn token. None: the tokenizer's."


def test_data_options_are_checked_when_built(tmp_path):
    from hf_rlhf.data.options import DataOptions

    with pytest.raises(ValueError, match=r"SFTConfig.overlong_policy='cut'; expected one of"):
        SFTConfig(output_dir=str(tmp_path), overlong_policy="cut")
    with pytest.raises(ValueError, match="SFTConfig.max_length must be >= 2, got 1"):
        SFTConfig(output_dir=str(tmp_path), max_length=1)
    with pytest.raises(ValueError, match="DataOptions.max_length must be >= 2, got 0"):
        DataOptions(max_length=0)
    with pytest.raises(TypeError, match="packing"):
        DataOptions(packing=True)  # SFT-only options are not data options
