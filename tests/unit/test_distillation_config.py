"""The distillation recipe's YAML loads into its dataclasses and fits the toy task; the toy student (the teacher with
some of its layers) is a working model; TRL's DistillationConfig fields are all known here."""

import os
from dataclasses import fields

import pytest
import torch
import trl

from hf_rlhf import DistillationConfig, ModelConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.toy.chain import ToyChainArguments
from hf_rlhf.trainers.distillation_config import IGNORED_AS_IN_TRL, REFUSED
from recipes import distill

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "recipes", "configs")


def test_toy_config_loads_and_fits_the_toy_task():
    assert distill.TOY_CONFIG == os.path.join(CONFIGS, "distill_toy.yaml")
    script_args, toy_args, model_config, args = parse_recipe_args(
        (distill.ScriptArguments, ToyChainArguments, ModelConfig, DistillationConfig),
        ["--config", distill.TOY_CONFIG], "unused")
    assert script_args.dataset_name is None and model_config.model_name_or_path is None  # the toy task
    assert 6 <= args.max_completion_length == args.response_length <= 12  # answers are <= 5 characters + eos
    assert args.beta == 1.0 and args.lmbda == 1.0 and script_args.compare_sft  # TRL's defaults, against SFT
    # each prompt comes back several times: a fresh sample for distillation on each pass, the same answer for SFT
    assert 6 <= args.max_steps * args.per_device_train_batch_size / toy_args.toy_train_size <= 24
    assert script_args.toy_teacher == "ppo" and script_args.ppo_model_path == "outputs/ppo"  # built from outputs/sft
    assert toy_args.sft_model_path == "outputs/sft" and script_args.student_model_path is None  # the teacher's layers


def test_the_student_keeps_some_of_the_teachers_layers(tokenizer):
    from hf_rlhf.toy import build_toy_model
    from hf_rlhf.toy.models import keep_layers

    teacher = build_toy_model(tokenizer, "small", seed=0)
    student = keep_layers(teacher, [0, 1, 3])
    assert student.config.num_hidden_layers == 3 and teacher.config.num_hidden_layers == 4
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1, 2]
    copied, original = student.model.layers[2].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight
    assert copied.data_ptr() != original.data_ptr()
    torch.testing.assert_close(copied, original)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():  # its KV cache works: greedy decoding with the cache equals the forward's argmax
        out = student.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        assert out[0, -1] == student(ids).logits[0, -1].argmax()
    with pytest.raises(ValueError, match="increasing indices"):
        keep_layers(teacher, [2, 1])


def test_every_trl_field_is_known():
    ours = {f.name for f in fields(DistillationConfig)}
    theirs = {f.name for f in fields(trl.DistillationConfig)}
    assert theirs <= ours, sorted(theirs - ours)
    assert set(REFUSED) <= theirs and IGNORED_AS_IN_TRL <= theirs
    assert DistillationConfig(output_dir="x").beta == trl.DistillationConfig(output_dir="x", bf16=False).beta == 1.0
