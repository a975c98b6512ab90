"""Every option of trl 1.16's SFTConfig, RewardConfig, DPOConfig and KTOConfig is accepted here (or refused with a
reason); config values are type-checked per field; old option names are errors that name the new option."""

import dataclasses
import math
import typing

import pytest
import torch
import trl
from transformers import HfArgumentParser, TrainingArguments

from hf_rlhf import DPOConfig, KTOConfig, ModelConfig, RewardConfig, SFTConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.data.options import DataOptions, PreferenceDataOptions, SFTDataOptions
from hf_rlhf.losses.sft import dft_loss
from hf_rlhf.trainers.config_checks import RENAMED, check_field_types
from hf_rlhf.trainers.ppo_config import PPOConfig

CUDA = torch.cuda.is_available()
TRAINING_ARGS = {f.name for f in dataclasses.fields(TrainingArguments)}

# Each TRL 1.16 field (TrainingArguments' own excepted) with a value TRL documents other than its default, and what
# ours does with it: "ok" (accepted; what it does is tested in tests/integration/test_trl_signatures.py or the
# trainers' own tests) or the start of the error that says why it cannot apply. A field TRL adds later is missing here
# and fails `test_every_trl_field_is_classified`.
SFT_VALUES = {
    "model_init_kwargs": ({"dtype": "bfloat16"}, "ok"),
    "trust_remote_code": (True, "ok"),
    "router_aux_loss_coef": (0.01, "ok"),  # MoE models; a dense model is refused by the trainer
    "chat_template_path": ("template.jinja", "ok"),
    "dataset_text_field": ("content", "ok"),
    "dataset_kwargs": ({"skip_prepare_dataset": True}, "ok"),
    "dataset_num_proc": (2, "ok"),
    "eos_token": ("<|im_end|>", "ok"),
    "max_length": (512, "ok"),
    "truncation_mode": ("keep_end", "SFTConfig.truncation_mode='keep_end' is deprecated in TRL"),
    "shuffle_dataset": (True, "ok"),
    "packing": (True, "ok"),
    "packing_strategy": ("bfd_split", "ok"),
    "padding_free": (True, "ok"),
    "pad_to_multiple_of": (8, "ok"),
    "eval_packing": (False, "ok"),
    "completion_only_loss": (False, "ok"),
    "assistant_only_loss": (True, "ok"),
    "loss_type": ("dft", "ok"),
    "activation_offloading": (True, "ok" if CUDA else "SFTConfig.activation_offloading=True moves activations"),
    "pad_token": ("<pad>", "ok"),
}
REWARD_VALUES = {
    "model_init_kwargs": ({"dtype": "bfloat16"}, "ok"),
    "trust_remote_code": (True, "ok"),
    "chat_template_path": ("template.jinja", "ok"),
    "disable_dropout": (False, "ok"),
    "dataset_num_proc": (2, "ok"),
    "eos_token": ("<|im_end|>", "ok"),
    "max_length": (512, "ok"),
    "pad_to_multiple_of": (8, "ok"),
    "center_rewards_coefficient": (0.01, "ok"),
    "activation_offloading": (True, "ok" if CUDA else "RewardConfig.activation_offloading=True moves activations"),
    "pad_token": ("<pad>", "ok"),
}
DPO_VALUES = {
    "model_init_kwargs": ({"dtype": "bfloat16"}, "ok"),
    "trust_remote_code": (True, "ok"),
    "router_aux_loss_coef": (0.001, "ok"),  # MoE models: added to the loss, as TRL
    "disable_dropout": (False, "ok"),
    "dataset_num_proc": (2, "ok"),
    "max_length": (512, "ok"),
    "truncation_mode": ("keep_end", "ok"),
    "padding_free": (True, "ok"),  # TRL 1.16 has it switched off; here the (1, N) layout of collators.dpo
    "pad_to_multiple_of": (8, "ok"),
    "precompute_ref_log_probs": (True, "ok"),
    "precompute_ref_batch_size": (16, "ok"),
    "loss_type": (["sigmoid", "bco_pair", "sft"], "ok"),
    "loss_weights": ([1.0], "ok"),
    "ld_alpha": (0.5, "ok"),
    "f_divergence_type": ("alpha_divergence", "ok"),
    "f_alpha_divergence_coef": (0.3, "ok"),
    "label_smoothing": (0.1, "ok"),
    "beta": (0.5, "ok"),
    "use_weighting": (True, "ok"),
    "discopop_tau": (0.1, "ok"),
    "activation_offloading": (True, "ok" if CUDA else "DPOConfig.activation_offloading=True moves activations"),
    "sync_ref_model": (True, "ok"),  # TR-DPO: trl's SyncRefModelCallback
    "ref_model_mixup_alpha": (0.5, "ok"),
    "ref_model_sync_steps": (64, "ok"),
    "pad_token": ("<pad>", "ok"),
}
KTO_VALUES = {
    "model_init_kwargs": ({"dtype": "bfloat16"}, "ok"),
    "trust_remote_code": (True, "ok"),
    "router_aux_loss_coef": (0.001, "ok"),  # MoE models: added to the loss, as TRL
    "disable_dropout": (False, "ok"),
    "dataset_num_proc": (2, "ok"),
    "max_length": (512, "ok"),
    "pad_to_multiple_of": (8, "ok"),
    "precompute_ref_log_probs": (True, "ok"),
    "precompute_ref_batch_size": (16, "ok"),
    "loss_type": ("apo_zero_unpaired", "ok"),
    "beta": (0.5, "ok"),
    "desirable_weight": (1.33, "ok"),
    "undesirable_weight": (0.75, "ok"),
    "activation_offloading": (True, "ok" if CUDA else "KTOConfig.activation_offloading=True moves activations"),
    "sync_ref_model": (True, "ok"),  # TR-DPO: trl's SyncRefModelCallback
    "ref_model_mixup_alpha": (0.5, "ok"),
    "ref_model_sync_steps": (64, "ok"),
}
PAIRS = [(trl.SFTConfig, SFTConfig, SFT_VALUES), (trl.RewardConfig, RewardConfig, REWARD_VALUES),
         (trl.DPOConfig, DPOConfig, DPO_VALUES), (trl.KTOConfig, KTOConfig, KTO_VALUES)]


def trl_fields(trl_cls):
    return {f.name: f for f in dataclasses.fields(trl_cls) if f.name not in TRAINING_ARGS}


@pytest.mark.parametrize("trl_cls, ours, values", PAIRS)
def test_every_trl_field_is_classified(trl_cls, ours, values):
    assert set(trl_fields(trl_cls)) == set(values), "a TRL field is new or gone: classify it in this table"
    our_fields = {f.name for f in dataclasses.fields(ours)}
    assert set(trl_fields(trl_cls)) <= our_fields  # every one is an option here, accepted or refused with a reason


@pytest.mark.parametrize("trl_cls, ours, values", PAIRS)
def test_trl_defaults_are_accepted(tmp_path, trl_cls, ours, values):
    for name, f in trl_fields(trl_cls).items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        ours(output_dir=str(tmp_path), **{name: default})  # TRL's own default never fails here


@pytest.mark.parametrize("trl_cls, ours, values", PAIRS)
def test_documented_values_are_accepted_or_refused_with_a_reason(tmp_path, trl_cls, ours, values):
    refused = []
    for name, (value, outcome) in values.items():
        if outcome == "ok":
            config = ours(output_dir=str(tmp_path), **{name: value})
            assert getattr(config, name) == value, name
        else:
            with pytest.raises(ValueError, match=outcome.replace("(", r"\(")):
                ours(output_dir=str(tmp_path), **{name: value})
            refused.append(name)
    accepted = len(values) - len(refused)
    print(f"{trl_cls.__name__}: {accepted} of {len(values)} TRL fields accepted; refused: {refused}")


def test_dpo_loss_options(tmp_path):
    assert DPOConfig(output_dir=str(tmp_path), loss_type="ipo").loss_type == ["ipo"]  # a name, as TRL
    assert DPOConfig(output_dir=str(tmp_path), loss_type="sigmoid,sft").loss_type == ["sigmoid", "sft"]  # CLI
    for bad, message in (({"loss_type": "dpo"}, "DPOConfig.loss_type=\\['dpo'\\]; expected one or more of"),
                         ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "has 1 weights for 2 loss types"),
                         ({"loss_type": "exo_pair"}, "takes log\\(label_smoothing\\)"),
                         ({"beta": 0.0}, "beta must be > 0"), ({"label_smoothing": 0.5}, "label_smoothing must be in")):
        with pytest.raises(ValueError, match=message):
            DPOConfig(output_dir=str(tmp_path), **bad)


def test_trl_spellings_are_converted_as_trl_does(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), pad_to_multiple_of="auto", loss_type="chunked_nll",
                     packing_strategy="bfd-requeue", model_init_kwargs='{"dtype": "bfloat16"}',
                     dataset_kwargs='{"skip_prepare_dataset": true}')
    assert args.pad_to_multiple_of is None  # "auto" pads on Neuron only
    assert (args.loss_type, args.packing_strategy) == ("nll", "bfd_split")
    assert args.model_init_kwargs == {"dtype": "bfloat16"} and args.skip_prepare_dataset is True
    assert RewardConfig(output_dir=str(tmp_path), pad_to_multiple_of="16").pad_to_multiple_of == 16
    with pytest.raises(ValueError, match="only key is 'skip_prepare_dataset'"):
        SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"skip_prepare": True})
    with pytest.raises(ValueError, match="model_init_kwargs must be a dict"):
        RewardConfig(output_dir=str(tmp_path), model_init_kwargs="dtype=bfloat16")


# -- types ---------------------------------------------------------------------------------------------

CONFIGS = [(SFTConfig, True), (RewardConfig, True), (DPOConfig, True), (KTOConfig, True), (PPOConfig, True),
           (ModelConfig, False),
           (DataOptions, False), (SFTDataOptions, False), (PreferenceDataOptions, False)]


def _fields_of_kind(cls, kind):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        members = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        if kind in members and members <= {kind, type(None)}:
            yield f.name


@pytest.mark.parametrize("cls, training_args", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
def test_a_string_for_a_bool_or_number_names_the_field(tmp_path, cls, training_args):
    base = {"output_dir": str(tmp_path)} if training_args else {}
    checked = 0
    for kind, bad in ((bool, "false"), (int, "long"), (float, "0.1")):
        for name in _fields_of_kind(cls, kind):
            with pytest.raises(TypeError, match=rf"{cls.__name__}\.{name} must be {kind.__name__}"):
                cls(**{**base, name: bad})
            checked += 1
    assert checked >= 2


def test_issue_examples(tmp_path):
    with pytest.raises(TypeError, match=r"SFTConfig.packing must be bool, got 'false' \(str\)"):
        SFTConfig(output_dir=str(tmp_path), packing="false")  # trl 1.16 turns packing on here
    with pytest.raises(TypeError, match=r"SFTConfig.max_length must be int or None, got 'long'"):
        SFTConfig(output_dir=str(tmp_path), max_length="long")
    with pytest.raises(TypeError, match="SFTConfig.max_length must be int or None, got True"):
        SFTConfig(output_dir=str(tmp_path), max_length=True)  # a bool is no int here
    with pytest.raises(ValueError, match=r"SFTConfig.loss_type='focal'; expected one of \['nll', 'dft'"):
        SFTConfig(output_dir=str(tmp_path), loss_type="focal")
    with pytest.raises(TypeError, match="PPOConfig.kl_coef must be float"):
        PPOConfig(output_dir=str(tmp_path), kl_coef="0.05")
    with pytest.raises(TypeError, match=r"ModelConfig.lora_target_modules must be list\[str\] or None"):
        ModelConfig(lora_target_modules=[1, 2])


def test_valid_values_and_conversions_still_work(tmp_path):
    args = SFTConfig(output_dir=tmp_path, learning_rate=1, logging_steps=5, report_to="none",
                     lr_scheduler_type="cosine", num_train_epochs=2)  # a Path, an int for a float, str enums
    assert args.report_to == [] or args.report_to == ["none"] or args.report_to == "none"
    assert args.lr_scheduler_type == "cosine" and args.learning_rate == 1
    assert ModelConfig(lora_target_modules=["q_proj"]).lora_target_modules == "q_proj"  # TRL's conversion
    config = PPOConfig(output_dir=str(tmp_path))
    assert dataclasses.replace(config).kl_coef == config.kl_coef  # converted values pass a second check
    check_field_types(SFTConfig(output_dir=str(tmp_path), pad_to_multiple_of="auto"))


def test_command_line_values_are_parsed_then_checked(tmp_path):
    (args,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--packing", "false", "--max_length", "12", "--model_init_kwargs",
         '{"dtype": "bfloat16"}', "--loss_type", "dft"])
    assert args.packing is False and args.max_length == 12 and args.model_init_kwargs == {"dtype": "bfloat16"}
    with pytest.raises(SystemExit):  # argparse's own "invalid int value: 'long'"
        HfArgumentParser(SFTConfig).parse_args_into_dataclasses(["--output_dir", "x", "--max_length", "long"])


# -- renamed options -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cls, old, new", [(SFTConfig, "max_seq_length", "max_length"),
                                           (RewardConfig, "max_seq_length", "max_length"),
                                           (DataOptions, "max_seq_length", "max_length"),
                                           (PPOConfig, "init_kl_coef", "kl_coef"),
                                           (PPOConfig, "adap_kl_ctrl", "kl_target"),
                                           (PPOConfig, "target", "kl_target"),
                                           (PPOConfig, "horizon", "kl_horizon"),
                                           (PPOConfig, "epsilon", "cliprange")])  # TRL GRPOConfig's name
def test_old_option_names_name_the_new_one(tmp_path, cls, old, new):
    kwargs = {} if cls is DataOptions else {"output_dir": str(tmp_path)}
    with pytest.raises(TypeError, match=f"{cls.__name__}: '{old}' is no longer an option: use '{new}'"):
        cls(**kwargs, **{old: 1})
    assert RENAMED[old][0] == new and any(f.name == new for f in dataclasses.fields(cls))


def test_other_unknown_options_stay_plain_errors(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_sequence_length'"):
        SFTConfig(output_dir=str(tmp_path), max_sequence_length=3)


@pytest.mark.parametrize("types, argv, old", [
    ((ModelConfig, SFTConfig), ["--model_name_or_path", "m", "--max_seq_length", "512"], "max_seq_length"),
    ((ModelConfig, SFTConfig), ["--model_name_or_path=m", "--max-seq-length=512"], "max_seq_length"),
    ((ModelConfig, PPOConfig), ["--model_name_or_path", "m", "--init_kl_coef", "0.1"], "init_kl_coef"),
    ((ModelConfig, PPOConfig), ["--model_name_or_path", "m", "--adap_kl_ctrl", "true"], "adap_kl_ctrl"),
    ((ModelConfig, PPOConfig), ["--model_name_or_path", "m", "--epsilon", "0.2"], "epsilon"),
])
def test_old_option_names_on_the_command_line(types, argv, old):
    with pytest.raises(TypeError, match=f"'{old}' is no longer an option: use '{RENAMED[old][0]}'"):
        parse_recipe_args(types, argv, "unused.yaml")


def test_old_option_names_in_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output_dir: x\nmodel_name_or_path: m\nhorizon: 1000\n")
    with pytest.raises(TypeError, match="'horizon' is no longer an option: use 'kl_horizon'"):
        parse_recipe_args((ModelConfig, PPOConfig), ["--config", str(cfg)], "unused.yaml")


def test_trust_remote_code_is_one_option_for_model_and_trainer_config():
    model_config, args = parse_recipe_args((ModelConfig, SFTConfig), ["--model_name_or_path", "m", "--output_dir",
                                                                      "x", "--trust_remote_code"], "unused.yaml")
    assert model_config.trust_remote_code is True and args.trust_remote_code is True
    model_config, args = parse_recipe_args((ModelConfig, SFTConfig), ["--model_name_or_path", "m", "--output_dir",
                                                                      "x"], "unused.yaml")
    assert model_config.trust_remote_code is False and args.trust_remote_code is False


# -- DFT loss --------------------------------------------------------------------------------------------

def test_dft_loss_by_hand():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # (1, 3, 2)
    labels = torch.tensor([[-100, 1, 0]])  # predicts labels[1] from position 0 and labels[2] from position 1
    p1 = math.exp(0.0) / (math.exp(2.0) + math.exp(0.0))  # p(1 | position 0)
    p2 = math.exp(0.0) / (math.exp(0.0) + math.exp(1.0))  # p(0 | position 1)
    expected = (-math.log(p1) * p1 - math.log(p2) * p2) / 2
    torch.testing.assert_close(dft_loss(logits, labels), torch.tensor(expected))
    torch.testing.assert_close(dft_loss(logits, labels, num_items_in_batch=4), torch.tensor(expected * 2 / 4))
    # virtual tokens of prompt learning come first and are skipped
    torch.testing.assert_close(dft_loss(torch.cat([torch.zeros(1, 2, 2), logits], 1), labels), torch.tensor(expected))
    logits.requires_grad_(True)
    dft_loss(logits, labels).backward()
    assert logits.grad[0, 2].abs().sum() == 0  # the last position predicts nothing


def test_an_old_option_name_ends_a_recipe_with_one_line(capsys):
    """`recipes/ppo.py --epsilon 0.2` (TRL GRPO's name): `[hf_rlhf] error: ...` naming cliprange, exit 1, no
    traceback."""
    from hf_rlhf.cli.errors import run_recipe

    def main():
        parse_recipe_args((ModelConfig, PPOConfig), ["--model_name_or_path", "m", "--epsilon", "0.2"], "unused.yaml")

    with pytest.raises(SystemExit) as exit_:
        run_recipe(main)
    message = str(exit_.value.code)
    assert message.startswith("[hf_rlhf] error: ") and "use 'cliprange'" in message and "\n" not in message
