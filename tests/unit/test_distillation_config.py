"""The distillation recipe's YAMLs load into its dataclasses (and the student's into the SFT recipe's), and the toy
config is self-consistent; TRL's DistillationConfig fields are all known here."""

import os
from dataclasses import fields

import trl

from hf_rlhf import DistillationConfig, ModelConfig, SFTConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.toy.chain import ToyChainArguments
from hf_rlhf.trainers.distillation_config import IGNORED_AS_IN_TRL, REFUSED
from recipes import distill, sft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "recipes", "configs")


def test_toy_config_loads_and_fits_the_toy_task():
    assert distill.TOY_CONFIG == os.path.join(CONFIGS, "distill_toy.yaml")
    script_args, toy_args, model_config, args = parse_recipe_args(
        (distill.ScriptArguments, ToyChainArguments, ModelConfig, DistillationConfig),
        ["--config", distill.TOY_CONFIG], "unused")
    assert script_args.dataset_name is None and model_config.model_name_or_path is None  # the toy task
    assert 6 <= args.max_completion_length == args.response_length <= 12  # answers are <= 5 characters + eos
    assert 0 <= args.beta <= 1 and 0 < args.lmbda <= 1 and script_args.compare_sft
    assert toy_args.toy_train_size >= args.max_steps * args.per_device_train_batch_size  # no prompt seen twice
    assert toy_args.sft_model_path == "outputs/sft" and script_args.student_model_path == "outputs/sft_student"


def test_student_config_is_a_smaller_sft_run():
    script_args, _, args = parse_recipe_args((sft.ScriptArguments, ModelConfig, SFTConfig),
                                             ["--config", os.path.join(CONFIGS, "sft_student_toy.yaml")], "unused")
    teacher, _, _ = parse_recipe_args((sft.ScriptArguments, ModelConfig, SFTConfig),
                                      ["--config", os.path.join(CONFIGS, "sft_toy.yaml")], "unused")
    assert script_args.toy_model_size == "tiny" and teacher.toy_model_size == "small"
    assert args.output_dir == "outputs/sft_student" and script_args.toy_slip_rate == teacher.toy_slip_rate


def test_every_trl_field_is_known():
    ours = {f.name for f in fields(DistillationConfig)}
    theirs = {f.name for f in fields(trl.DistillationConfig)}
    assert theirs <= ours, sorted(theirs - ours)
    assert set(REFUSED) <= theirs and IGNORED_AS_IN_TRL <= theirs
    assert DistillationConfig(output_dir="x").beta == trl.DistillationConfig(output_dir="x", bf16=False).beta == 1.0
