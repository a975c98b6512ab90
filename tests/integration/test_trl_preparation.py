"""What TRL 1.16's own test modules check of the prepared datasets and logs (issue 20), on the toy world.

Measured with `tests/compat/trl_tests/run_trl_tests.py` (TRL's `test_sft_trainer.py` / `test_reward_trainer.py`
run against hf_rlhf); each case here is one cause of a failure there, fixed:
- SFT: a `labels` column built from the completion / assistant masks (which it replaces), in packed rows too;
  pre-tokenized rows truncated to `max_length`, a row left with no trained label dropped;
- SFT on a Mixture-of-Experts model: the load-balancing loss logged as `aux_loss`;
- reward: per-row `chat_template_kwargs` passed to the chat template; TRL's legacy `chosen_input_ids` /
  `rejected_input_ids` columns renamed with its FutureWarning; TRL's wording for a model with `num_labels != 1`.
And the deliberate differences (docs/trl_compatibility.md), each with its test:
- `padding_free=True` without packing keeps `max_length` (the rows are cut when prepared); TRL refuses it;
- `skip_prepare_dataset=True` rows with masks and no `labels` train on the masked tokens only; TRL refuses them;
- DPO `evaluate(new_rows)` after training with `precompute_ref_log_probs`: the reference log-probs come from the
  reference hf_rlhf keeps; TRL (which does not keep it) refuses.
DPO (TRL's `test_dpo_trainer.py`): raw rows prepared by `evaluate`, `precompute_ref_log_probs` with a stream refused,
`train_dataset=None` refused, TRL's tags, an MoE policy's load-balancing loss added and logged, TR-DPO's
`sync_ref_model`.
"""

import copy

import pytest
import torch
from datasets import Dataset

from hf_rlhf import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, preference_dataset, sft_dataset

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def sft_args(tmp_path, **kw):
    return SFTConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "max_steps": 2,
                        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
                        "max_length": 64, **kw})


def reward_args(tmp_path, **kw):
    return RewardConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "max_steps": 2,
                           "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
                           **kw})


def sft(tmp_path, tokenizer, rows, **kw):
    return SFTTrainer(build_toy_model(tokenizer, "tiny"), args=sft_args(tmp_path, **kw), train_dataset=rows,
                      processing_class=tokenizer)


# -- SFT: TRL's labels column ---------------------------------------------------------------------------------
def test_completion_only_labels_replace_the_completion_mask(tmp_path, tokenizer):
    rows = sft_dataset(8, seed=1)
    trainer = sft(tmp_path, tokenizer, rows)
    assert trainer.train_dataset.column_names == ["input_ids", "labels"]
    for row, example in zip(rows, trainer.train_dataset):
        n_prompt = len(tokenizer(row["prompt"])["input_ids"])
        assert example["labels"][:n_prompt] == [-100] * n_prompt
        assert example["labels"][n_prompt:] == example["input_ids"][n_prompt:]
    # completion_only_loss=False: the mask is not used, every token is a label
    whole = sft(tmp_path, tokenizer, rows, completion_only_loss=False).train_dataset
    assert all(example["labels"] == example["input_ids"] for example in whole)


def test_assistant_only_labels(tmp_path, tokenizer):
    rows = sft_dataset(4, seed=1, format="messages")
    trainer = sft(tmp_path, tokenizer, rows, assistant_only_loss=True)
    assert "assistant_masks" not in trainer.train_dataset.column_names
    for row, example in zip(rows, trainer.train_dataset):
        answer = tokenizer(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        trained = [label for label in example["labels"] if label != -100]
        assert trained == answer + [tokenizer.eos_token_id]  # the assistant turn and its eos, nothing else
    trainer.train()  # the collator takes the labels without the assistant masks


def test_pretokenized_masks_become_labels_and_are_truncated(tmp_path, tokenizer):
    rows = Dataset.from_list([{"input_ids": [11, 12, 13, 14], "assistant_masks": [0, 0, 1, 1]},
                              {"input_ids": [15, 16, 17], "assistant_masks": [0, 1, 0]}])
    assert sft(tmp_path, tokenizer, rows).train_dataset[:]["labels"] == [[-100, -100, 13, 14], [-100, 16, -100]]
    # max_length=2: the first row keeps no trained label and is dropped, as TRL's keep_start truncation does
    cut = sft(tmp_path, tokenizer, rows, max_length=2).train_dataset
    assert cut[:] == {"input_ids": [[15, 16]], "labels": [[-100, 16]]}


def test_packed_rows_carry_labels(tmp_path, tokenizer):
    trainer = sft(tmp_path, tokenizer, sft_dataset(16, seed=1), packing=True)
    assert "labels" in trainer.train_dataset.column_names
    assert "completion_mask" not in trainer.train_dataset.column_names
    for example in trainer.train_dataset:
        assert len(example["labels"]) == len(example["input_ids"])
        assert -100 in example["labels"] and any(label != -100 for label in example["labels"])


def test_moe_model_logs_aux_loss(tmp_path, tokenizer):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
        num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    trainer = SFTTrainer(model, args=sft_args(tmp_path), train_dataset=sft_dataset(8, seed=1),
                         processing_class=tokenizer)
    assert trainer.aux_loss_enabled
    trainer.train()
    logged = [h["aux_loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(value > 0 for value in logged), trainer.state.log_history


# -- reward ----------------------------------------------------------------------------------------------------
def test_reward_rows_chat_template_kwargs(tmp_path, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% if mark %}{{ eos_token }}{% endif %}" + tok.chat_template
    rows = preference_dataset(4, seed=1, conversational=True)
    rows = rows.add_column("chat_template_kwargs", [{"mark": bool(i % 2)} for i in range(len(rows))])
    trainer = RewardTrainer(build_toy_reward_model(tok), args=reward_args(tmp_path), train_dataset=rows,
                            processing_class=tok)
    for i, (row, example) in enumerate(zip(rows, trainer.train_dataset)):
        expected = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True, return_dict=True,
                                           mark=bool(i % 2))["input_ids"]
        assert example["chosen_ids"] == list(expected)
        assert (example["chosen_ids"][0] == tok.eos_token_id) == bool(i % 2)


def test_reward_legacy_tokenized_columns(tmp_path, tokenizer):
    pairs = preference_dataset(8, seed=1)
    rows = Dataset.from_dict({
        "chosen_input_ids": [tokenizer(p + c)["input_ids"] for p, c in zip(pairs["prompt"], pairs["chosen"])],
        "rejected_input_ids": [tokenizer(p + r)["input_ids"] for p, r in zip(pairs["prompt"], pairs["rejected"])]})
    with pytest.warns(FutureWarning, match="will not be supported in v1"):
        trainer = RewardTrainer(build_toy_reward_model(tokenizer), args=reward_args(tmp_path), train_dataset=rows,
                                processing_class=tokenizer)
    assert trainer.train_dataset.column_names == ["chosen_ids", "rejected_ids"]
    assert trainer.train_dataset["chosen_ids"] == rows["chosen_input_ids"]
    trainer.train()


def test_reward_model_with_two_labels_refused_in_trl_words(tmp_path, tokenizer):
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(build_toy_reward_model(tokenizer).config)
    config.num_labels = 2
    two = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match="reward models require `num_labels=1`"):
        RewardTrainer(two, args=reward_args(tmp_path), train_dataset=preference_dataset(4, seed=1),
                      processing_class=tokenizer)


# -- DPO -------------------------------------------------------------------------------------------------------
def dpo(tmp_path, tokenizer, model=None, **kw):
    args = DPOConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "max_steps": 2,
                        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
                        "learning_rate": 1e-2, **kw})
    return DPOTrainer(model if model is not None else build_toy_model(tokenizer, "tiny"), args=args,
                      train_dataset=preference_dataset(8, seed=1), processing_class=tokenizer)


def test_dpo_evaluate_prepares_raw_rows_and_tags(tmp_path, tokenizer):
    trainer = dpo(tmp_path, tokenizer)
    assert {"trl", "dpo"} <= set(trainer.model.model_tags)
    rows = preference_dataset(4, seed=2)
    metrics = trainer.evaluate(eval_dataset={"a": rows, "b": rows})
    assert metrics["eval_a_loss"] == pytest.approx(metrics["eval_b_loss"])
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        DPOTrainer(build_toy_model(tokenizer, "tiny"), args=DPOConfig(output_dir=str(tmp_path / "x")),
                   processing_class=tokenizer)


def test_dpo_precompute_ref_log_probs_refuses_a_stream(tmp_path, tokenizer):
    stream = preference_dataset(8, seed=2).to_iterable_dataset()
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
        DPOTrainer(build_toy_model(tokenizer, "tiny"), args=DPOConfig(output_dir=str(tmp_path / "x"),
                   precompute_ref_log_probs=True), train_dataset=preference_dataset(8, seed=1),
                   eval_dataset={"s": stream}, processing_class=tokenizer)
    trainer = dpo(tmp_path, tokenizer, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported with IterableDataset"):
        trainer.evaluate(eval_dataset=stream)


def test_dpo_evaluate_after_training_uses_the_kept_reference(tmp_path, tokenizer):
    """Deliberate: TRL refuses `evaluate(new_rows)` after training with `precompute_ref_log_probs` and no ref_model
    (it keeps no reference); hf_rlhf keeps a frozen reference, so the log-probs are the reference's."""
    trainer = dpo(tmp_path, tokenizer, precompute_ref_log_probs=True)
    rows = preference_dataset(4, seed=2)
    before = trainer.prepare_eval_dataset(rows, "before")["ref_chosen_logps"]
    trainer.train()
    after = trainer.prepare_eval_dataset(rows, "after")["ref_chosen_logps"]
    assert after == pytest.approx(before, abs=1e-5)
    policy = trainer.evaluate(eval_dataset=rows)["eval_logps/chosen"]
    assert abs(policy - sum(before) / len(before)) > 1e-3  # the policy moved; the reference did not


def test_dpo_moe_load_balancing_loss_added_and_logged(tmp_path, tokenizer):
    from transformers import MixtralConfig, MixtralForCausalLM

    def moe():
        torch.manual_seed(0)
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
            pad_token_id=tokenizer.pad_token_id, router_aux_loss_coef=0.5))

    on, off = dpo(tmp_path, tokenizer, moe()), dpo(tmp_path, tokenizer, moe(), router_aux_loss_coef=0.0)
    assert on.aux_loss_enabled and not off.aux_loss_enabled
    batch = on._prepare_inputs(on.data_collator([on.train_dataset[i] for i in range(4)]))
    with torch.no_grad():
        loss_on, outputs = on.compute_loss(on.model, batch, return_outputs=True)
        loss_off = off.compute_loss(off.model, batch)
    assert loss_on - loss_off == pytest.approx(0.5 * outputs.aux_loss.item(), abs=1e-5)
    on.train()
    assert all(h["aux_loss"] > 0 for h in on.state.log_history if "loss" in h)


def test_dpo_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, tokenizer):
    trainer = dpo(tmp_path, tokenizer, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                  max_steps=2)
    ref_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()  # one sync, after step 2: reference = 0.5 policy + 0.5 reference
    for before, ref, policy in zip(ref_before, trainer.ref_model.parameters(), trainer.model.parameters()):
        torch.testing.assert_close(ref.detach(), 0.5 * policy.detach() + 0.5 * before)
    assert any(not torch.equal(before, ref) for before, ref in zip(ref_before, trainer.ref_model.parameters()))
    with pytest.raises(ValueError, match="sync_ref_model=True cannot go with precompute_ref_log_probs"):
        DPOConfig(output_dir=str(tmp_path / "x"), sync_ref_model=True, precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="sync_ref_model=True needs a separate reference model"):
        dpo(tmp_path, tokenizer, sync_ref_model=True, loss_type="simpo")


# -- deliberate differences ------------------------------------------------------------------------------------
def test_padding_free_without_packing_keeps_max_length(tmp_path, tokenizer):
    """TRL refuses `padding_free=True, max_length=...` without packing ("`max_length` is not enforced"), which with
    its default `max_length=1024` means every plain `padding_free=True`; here the rows are cut when prepared."""
    rows = sft_dataset(8, seed=1, format="text")
    trainer = sft(tmp_path, tokenizer, rows, padding_free=True, max_length=6)
    lengths = [len(example["input_ids"]) for example in trainer.train_dataset]
    assert max(lengths) == 6 and len(lengths) == 8  # every row was longer and is cut, none dropped
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape == (1, 24)


def test_skip_prepare_rows_with_masks_train_on_the_masked_tokens(tmp_path, tokenizer):
    """TRL refuses `skip_prepare_dataset=True` rows with masks and no `labels` ("Add a 'labels' column"): its
    collator would ignore the masks; hf_rlhf's collator reads them."""
    rows = Dataset.from_list([{"input_ids": [11, 12, 13, 14], "completion_mask": [0, 0, 1, 1]}] * 4)
    trainer = sft(tmp_path, tokenizer, rows, dataset_kwargs={"skip_prepare_dataset": True})
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["labels"].tolist() == [[-100, -100, 13, 14]] * 2
    trainer.train()
