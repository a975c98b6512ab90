"""TRL users' calls work unchanged: TRL 1.16's trainer signatures (positional order, names), a plain
`TrainingArguments` as args, every kind of peft config (train, save, reload), formatting_func, the SFT options
TRL documents (loss_type, eval_packing, shuffle_dataset, dataset_kwargs, model_init_kwargs), trl 1.12's PPO
keywords, and clear errors for what cannot apply."""

import inspect

import pytest
import torch
import trl
from peft import (
    AutoPeftModelForCausalLM,
    IA3Config,
    LoraConfig,
    PeftModel,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
)
from transformers import TrainingArguments

from hf_rlhf import DPOTrainer, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, preference_dataset, prompt_dataset, sft_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

COMMON = dict(per_device_train_batch_size=4, max_steps=2, logging_steps=1, save_strategy="no", report_to="none",
              seed=0, disable_tqdm=True, learning_rate=1e-2)


def sft_args(tmp_path, **kw):
    return SFTConfig(output_dir=str(tmp_path / "out"), **{"max_length": 64, **COMMON, **kw})


def reward_args(tmp_path, **kw):
    return RewardConfig(output_dir=str(tmp_path / "out"), **{"max_length": 64, **COMMON, **kw})


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def changed(before, model):
    after = dict(model.named_parameters())
    return [n for n, p in before.items() if not torch.equal(p, after[n].detach())]


# -- signatures ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ours, theirs", [(SFTTrainer, trl.SFTTrainer), (RewardTrainer, trl.RewardTrainer),
                                         (DPOTrainer, trl.DPOTrainer), (KTOTrainer, trl.KTOTrainer)])
def test_trl_parameters_in_trls_order(ours, theirs):
    trl_params = list(inspect.signature(theirs.__init__).parameters)
    our_params = list(inspect.signature(ours.__init__).parameters)
    assert our_params[: len(trl_params)] == trl_params  # a parameter TRL adds later fails here
    assert "model_config" in our_params[len(trl_params):]
    assert inspect.signature(ours.__init__).parameters["model_config"].kind is inspect.Parameter.KEYWORD_ONLY


def test_sft_positional_call_as_in_trl(tmp_path, tokenizer):
    # TRL's third positional argument is data_collator: SFTTrainer(model, args, None, train_dataset)
    rows = sft_dataset(16, seed=1)
    trainer = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), None, rows, None, tokenizer)
    assert trainer.train_dataset is not None and trainer.eval_dataset is None
    assert len(trainer.train_dataset) == 16
    trainer.train()
    assert trainer.state.global_step == 2


def test_reward_positional_call_as_in_trl(tmp_path, tokenizer):
    pairs = preference_dataset(16, seed=1)
    trainer = RewardTrainer(build_toy_reward_model(tokenizer), reward_args(tmp_path), None, pairs, pairs, tokenizer)
    trainer.train()
    assert trainer.state.global_step == 2 and "eval_accuracy" in trainer.evaluate()


@pytest.mark.parametrize("trainer_cls, config_cls", [(SFTTrainer, SFTConfig), (RewardTrainer, RewardConfig)])
def test_plain_training_arguments_are_converted(tmp_path, tokenizer, trainer_cls, config_cls):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), hub_token="secret", **COMMON)
    model = build_toy_model(tokenizer) if trainer_cls is SFTTrainer else build_toy_reward_model(tokenizer)
    data = sft_dataset(16, seed=1) if trainer_cls is SFTTrainer else preference_dataset(16, seed=1)
    trainer = trainer_cls(model, args, train_dataset=data, processing_class=tokenizer)
    assert type(trainer.args) is config_cls
    assert trainer.args.hub_token == "secret"  # to_dict hides it; TRL puts it back too
    assert (trainer.args.learning_rate, trainer.args.max_steps, trainer.args.seed) == (1e-2, 2, 0)
    assert trainer.args.max_length == 1024  # the config's own default, as TRL's conversion gives
    trainer.train()
    assert trainer.state.global_step == 2


def test_trl_config_is_converted_and_foreign_options_refused(tmp_path, tokenizer):
    trainer = SFTTrainer(build_toy_model(tokenizer), trl.SFTConfig(output_dir=str(tmp_path), max_length=32, bf16=False,
                                                                   packing=True, **COMMON),
                         train_dataset=sft_dataset(16, seed=1), processing_class=tokenizer)
    assert type(trainer.args) is SFTConfig and trainer.args.packing and trainer.args.max_length == 32
    with pytest.raises(TypeError, match=r"RewardConfig whose options \['center_rewards_coefficient'\]"):
        SFTTrainer(build_toy_model(tokenizer), RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=0.1),
                   train_dataset=sft_dataset(4), processing_class=tokenizer)


def test_old_and_unknown_trainer_kwargs_are_clear_errors(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="'tokenizer' is no longer an option: use 'processing_class'"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=sft_dataset(4), tokenizer=tokenizer)
    with pytest.raises(TypeError, match=r"unexpected arguments \['dataset_text_fild'\]; it takes \['model', 'args'"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=sft_dataset(4),
                   processing_class=tokenizer, dataset_text_fild="text")
    with pytest.raises(TypeError, match="'tokenizer' is no longer an option"):
        RewardTrainer(build_toy_reward_model(tokenizer), reward_args(tmp_path), train_dataset=preference_dataset(4),
                      tokenizer=tokenizer)
    with pytest.raises(TypeError, match="compute_loss_func"):  # TRL's RewardTrainer takes none either
        RewardTrainer(build_toy_reward_model(tokenizer), reward_args(tmp_path), train_dataset=preference_dataset(4),
                      processing_class=tokenizer, compute_loss_func=lambda *a, **k: 0)


def test_missing_model_path_is_a_clear_error(tmp_path, tokenizer):
    for path in (str(tmp_path / "no-such-dir"), "not a hub id"):
        with pytest.raises(FileNotFoundError, match=f"model '{path}' not found: no such local directory"):
            SFTTrainer(path, sft_args(tmp_path), train_dataset=sft_dataset(4), processing_class=tokenizer)
    with pytest.raises(FileNotFoundError, match="not in the local hub cache"):
        RewardTrainer("some-org/some-model", reward_args(tmp_path), train_dataset=preference_dataset(4),
                      processing_class=tokenizer)


# -- peft config kinds ---------------------------------------------------------------------------------

SFT_PEFT = {
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    "dora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True, task_type="CAUSAL_LM"),
    "ia3": lambda: IA3Config(task_type="CAUSAL_LM"),
    "prompt_tuning": lambda: PromptTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"),
    "p_tuning": lambda: PromptEncoderConfig(num_virtual_tokens=4, encoder_hidden_size=16, task_type="CAUSAL_LM"),
    "prefix_tuning": lambda: PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"),
}


@pytest.mark.parametrize("kind", list(SFT_PEFT))
def test_sft_peft_config_kinds_train_save_and_reload(tmp_path, tokenizer, kind):
    base_dir = tmp_path / "base"
    build_toy_model(tokenizer).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    trainer = SFTTrainer(str(base_dir), sft_args(tmp_path), train_dataset=sft_dataset(16, seed=1),
                         processing_class=tokenizer, peft_config=SFT_PEFT[kind]())
    assert isinstance(trainer.model, PeftModel)
    before = trainable(trainer.model)
    trainer.train()
    assert changed(before, trainer.model), f"{kind}: no adapter parameter moved"
    trainer.save_model(str(tmp_path / "adapter"))

    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    trainer.model.eval()
    batch = tokenizer(["Q: add 12 30\nA:"], return_tensors="pt")
    with torch.no_grad():
        expected = trainer.model(**batch).logits
        got = reloaded(**batch).logits
    torch.testing.assert_close(got, expected)


REWARD_PEFT = {
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS"),
    "dora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True, task_type="SEQ_CLS"),
    "ia3": lambda: IA3Config(task_type="SEQ_CLS", target_modules=["k_proj", "v_proj", "down_proj"],
                             feedforward_modules=["down_proj"]),
}


@pytest.mark.parametrize("kind", list(REWARD_PEFT))
def test_reward_peft_config_kinds_train_save_and_reload(tmp_path, tokenizer, kind):
    pairs = preference_dataset(16, seed=1)
    trainer = RewardTrainer(build_toy_reward_model(tokenizer), reward_args(tmp_path), train_dataset=pairs,
                            processing_class=tokenizer, peft_config=REWARD_PEFT[kind]())
    before = trainable(trainer.model)
    trainer.train()
    assert changed(before, trainer.model)
    trainer.save_model(str(tmp_path / "adapter"))
    base = build_toy_reward_model(tokenizer)
    base.config.pad_token_id = tokenizer.pad_token_id
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    trainer.model.eval()
    batch = tokenizer(["Q: add 1 2\nA: 3"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, trainer.model(**batch).logits)


@pytest.mark.parametrize("config", [PromptTuningConfig(num_virtual_tokens=4, task_type="SEQ_CLS"),
                                    PrefixTuningConfig(num_virtual_tokens=4, task_type="SEQ_CLS")])
def test_reward_prompt_learning_is_a_clear_error(tmp_path, tokenizer, config):
    with pytest.raises(ValueError, match=f"peft_config is a {type(config).__name__}: prompt learning"):
        RewardTrainer(build_toy_reward_model(tokenizer), reward_args(tmp_path), train_dataset=preference_dataset(4),
                      processing_class=tokenizer, peft_config=config)


def ppo_args(tmp_path, **kw):
    return PPOConfig(output_dir=str(tmp_path / "ppo"), per_device_train_batch_size=4, max_steps=2, num_ppo_epochs=1,
                     num_mini_batches=2, response_length=6, local_rollout_forward_batch_size=8, report_to="none",
                     save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1, **kw)


def constant_reward(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("kind", ["lora", "dora", "ia3"])
def test_ppo_peft_config_kinds_and_trl_112_keywords(tmp_path, tokenizer, kind):
    # trl 1.12's keyword names, as its scripts call trl.experimental.ppo.PPOTrainer
    trainer = PPOTrainer(args=ppo_args(tmp_path), processing_class=tokenizer, model=build_toy_model(tokenizer),
                         ref_model=None, reward_model=constant_reward, train_dataset=prompt_dataset(16, seed=0),
                         value_model=None, data_collator=None, eval_dataset=None, optimizers=(None, None),
                         callbacks=None, peft_config=SFT_PEFT[kind]())
    before = trainable(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2
    assert [n for n in changed(before, trainer.model) if "value" not in n], f"{kind}: the policy adapter did not move"
    trainer.save_model(str(tmp_path / "policy"))
    policy = trainer.model.policy.eval()
    reloaded = PeftModel.from_pretrained(build_toy_model(tokenizer), str(tmp_path / "policy")).eval()
    batch = tokenizer(["Q: add 12 30\nA:"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, policy(**batch).logits)


def test_ppo_refuses_what_cannot_apply(tmp_path, tokenizer):
    model = build_toy_model(tokenizer)
    kw = dict(args=ppo_args(tmp_path), processing_class=tokenizer, train_dataset=prompt_dataset(8))
    with pytest.raises(ValueError, match="PromptTuningConfig: prompt learning"):
        PPOTrainer(model, constant_reward, peft_config=SFT_PEFT["prompt_tuning"](), **kw)
    with pytest.raises(ValueError, match="same object"):
        PPOTrainer(model, constant_reward, ref_model=model, **kw)
    with pytest.raises(ValueError, match="left-pads the prompts itself"):
        PPOTrainer(model, constant_reward, data_collator=lambda rows: rows, **kw)
    with pytest.raises(TypeError, match="'tokenizer' is no longer an option: use 'processing_class'"):
        PPOTrainer(model, constant_reward, args=ppo_args(tmp_path), train_dataset=prompt_dataset(8),
                   tokenizer=tokenizer)


# -- SFT options TRL documents --------------------------------------------------------------------------

def test_formatting_func_per_row_as_trl(tmp_path, tokenizer):
    rows = sft_dataset(16, seed=1)
    seen = []

    def formatting_func(row):
        seen.append(row)
        return f"{row['prompt']}{row['completion']}"

    qa = rows.rename_columns({"prompt": "question", "completion": "answer"})
    trainer = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=qa, processing_class=tokenizer,
                         formatting_func=lambda row: f"{row['question']}{row['answer']}")
    plain = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path),
                       train_dataset=rows.map(lambda r: {"text": r["prompt"] + r["completion"]},
                                              remove_columns=["prompt", "completion"]),
                       processing_class=tokenizer)
    assert trainer.train_dataset["input_ids"] == plain.train_dataset["input_ids"]  # the same text, tokenized alike

    # a dataset no format fits: the error says formatting_func would do
    with pytest.raises(ValueError, match="formatting_func"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=qa, processing_class=tokenizer)
    with pytest.raises(ValueError, match="row 0, field 'formatting_func\\(row\\)': expected a str"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=qa, processing_class=tokenizer,
                   formatting_func=lambda row: [row["question"]])
    with pytest.raises(ValueError, match="'prompt' and 'completion' columns"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=rows, processing_class=tokenizer,
                   formatting_func=formatting_func)


def test_dft_loss_type_trains_with_a_different_loss(tmp_path, tokenizer):
    rows = sft_dataset(16, seed=1)
    runs = {}
    for loss_type in ("nll", "dft"):
        trainer = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, loss_type=loss_type), train_dataset=rows,
                             processing_class=tokenizer)
        trainer.train()
        runs[loss_type] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # DFT weights each token's NLL by p < 1: a smaller loss on the same first batch
    assert 0 < runs["dft"][0] < runs["nll"][0]
    with pytest.raises(ValueError, match="compute_loss_func cannot be given"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, loss_type="dft"), train_dataset=rows,
                   processing_class=tokenizer, compute_loss_func=lambda *a, **k: 0)


def test_eval_packing_shuffle_and_skip_prepare(tmp_path, tokenizer):
    rows = sft_dataset(24, seed=1)
    trainer = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, packing=False, eval_packing=True),
                         train_dataset=rows, eval_dataset=rows, processing_class=tokenizer)
    assert len(trainer.train_dataset) == 24 and len(trainer.eval_dataset) < 24  # only eval is packed
    assert "eval_loss" in trainer.evaluate()

    plain = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path), train_dataset=rows, processing_class=tokenizer)
    shuffled = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, shuffle_dataset=True), train_dataset=rows,
                          processing_class=tokenizer)
    assert shuffled.train_dataset["input_ids"] != plain.train_dataset["input_ids"]
    assert (sorted(map(tuple, shuffled.train_dataset["input_ids"]))
            == sorted(map(tuple, plain.train_dataset["input_ids"])))

    tokenized = plain.train_dataset
    skipped = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                         train_dataset=tokenized, processing_class=tokenizer)
    assert skipped.train_dataset is tokenized
    skipped.train()
    with pytest.raises(ValueError, match="skip_prepare_dataset=True.*needs an input_ids column"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                   train_dataset=rows, processing_class=tokenizer)


@pytest.mark.parametrize("trainer_cls", [SFTTrainer, RewardTrainer])
def test_model_init_kwargs_reach_from_pretrained(tmp_path, tokenizer, trainer_cls):
    base_dir = tmp_path / "base"
    build_toy_model(tokenizer).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    make = sft_args if trainer_cls is SFTTrainer else reward_args
    data = sft_dataset(8) if trainer_cls is SFTTrainer else preference_dataset(8)
    trainer = trainer_cls(str(base_dir), make(tmp_path, model_init_kwargs={"dtype": "bfloat16",
                                                                           "attn_implementation": "eager"}),
                          train_dataset=data, processing_class=tokenizer)
    model = trainer.model
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert type(model).__name__.endswith("ForCausalLM" if trainer_cls is SFTTrainer else "ForSequenceClassification")


def test_router_aux_loss_coef_on_a_dense_model_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, router_aux_loss_coef=0.01),
                   train_dataset=sft_dataset(4), processing_class=tokenizer)


def test_bfd_split_packs_overflow_instead_of_cutting_it(tmp_path, tokenizer):
    rows = sft_dataset(24, seed=1)
    whole = SFTTrainer(build_toy_model(tokenizer), sft_args(tmp_path, max_length=None), train_dataset=rows,
                       processing_class=tokenizer).train_dataset
    total = sum(len(ids) for ids in whole["input_ids"])
    longest = max(len(ids) for ids in whole["input_ids"])
    row_length = longest - 4  # some examples overflow a row
    packed = {}
    for strategy in ("bfd", "bfd_split"):
        packed[strategy] = SFTTrainer(build_toy_model(tokenizer), sft_args(
            tmp_path, packing=True, packing_strategy=strategy, max_length=row_length), train_dataset=rows,
            processing_class=tokenizer).train_dataset
    kept = {k: sum(len(ids) for ids in d["input_ids"]) for k, d in packed.items()}
    assert kept["bfd_split"] == total  # every token kept
    assert kept["bfd"] < total  # overflow cut (keep_start)
    assert all(len(ids) <= row_length for ids in packed["bfd_split"]["input_ids"])


def tiny_moe(tokenizer):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                           router_aux_loss_coef=0.02, output_router_logits=False)
    return MixtralForCausalLM(config)


def test_router_aux_loss_coef_on_a_moe_model(tmp_path, tokenizer):
    rows = sft_dataset(8, seed=1)
    batch = tokenizer(["Q: add 1 2\nA: 3"], return_tensors="pt")
    batch["labels"] = batch["input_ids"]
    losses = {}
    for coef in (None, 0.0, 0.5):
        trainer = SFTTrainer(tiny_moe(tokenizer), sft_args(tmp_path, router_aux_loss_coef=coef), train_dataset=rows,
                             processing_class=tokenizer)
        model = trainer.model
        expected = 0.02 if coef is None else coef  # None: the model config's own (TRL)
        assert model.config.router_aux_loss_coef == model.router_aux_loss_coef == expected
        assert model.config.output_router_logits is (expected != 0)
        assert trainer.aux_loss_enabled is (expected != 0)  # TRL's attribute
        with torch.no_grad():
            out = model(**batch)
        losses[coef] = (out.loss, out.aux_loss)
    nll = losses[0.0][0]
    for coef, (loss, aux) in losses.items():
        if coef:  # the model's own loss carries the weighted load-balancing term
            torch.testing.assert_close(loss, nll + coef * aux)
    torch.testing.assert_close(losses[None][0], nll + 0.02 * losses[None][1])
    trainer.train()
