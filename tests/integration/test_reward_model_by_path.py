"""A reward model given by path is loaded as what it is (a sequence-classification model, a `ValueHeadModel`, full
or LoRA, or a LoRA sequence-classification adapter on its own base) and scores exactly as the model it was saved
from; a directory that holds no reward model is a clear error."""

import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hf_rlhf import ModelConfig, RewardConfig, RewardTrainer
from hf_rlhf.models.value_head import ValueHeadModel, load_reward_stats
from hf_rlhf.rewards.factory import build_reward_source
from hf_rlhf.rewards.model import (
    SEQUENCE_CLASSIFICATION,
    SEQUENCE_CLASSIFICATION_ADAPTER,
    VALUE_HEAD,
    ModelReward,
    reward_model_kind,
)
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, preference_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def texts(prompts):
    # right and wrong answers of several lengths, so that the scores differ and left padding is exercised
    rows = prompts.select(range(6))
    return list(rows["prompt"]), [a if i % 2 else a + "7" * i for i, a in enumerate(rows["answer"])]


def train_reward(model, tokenizer, output_dir, model_config=None):
    """A few RewardTrainer steps, then `save_model()`; the trained model as the Trainer holds it."""
    torch.set_num_threads(1)
    args = RewardConfig(output_dir=output_dir, per_device_train_batch_size=8, max_steps=3, learning_rate=2e-2,
                        report_to="none", save_strategy="no", max_length=64, disable_tqdm=True, seed=0,
                        store_reward_stats=True)
    trainer = RewardTrainer(model, args=args, train_dataset=preference_dataset(24, seed=1), processing_class=tokenizer,
                            model_config=model_config)
    trainer.train()
    trainer.save_model()
    return trainer.accelerator.unwrap_model(trainer.model).eval()


def test_value_head_model_by_path_scores_as_the_model_it_was_saved_from(tmp_path, tokenizer, texts, prompts):
    # the old loader read this directory as a sequence-classification model with a fresh random head
    model = train_reward(ValueHeadModel(build_toy_model(tokenizer, seed=2)), tokenizer, str(tmp_path / "vh"))
    assert reward_model_kind(str(tmp_path / "vh")) == VALUE_HEAD
    expected = ModelReward(model, tokenizer)(*texts)
    assert expected.std() > 0

    source = build_reward_source(str(tmp_path / "vh"))  # its tokenizer: the one saved next to it
    assert_close(source(*texts), expected, atol=0, rtol=0)
    assert isinstance(source.model, ValueHeadModel)
    assert source.reward_stats == load_reward_stats(model) is not None

    trainer = PPOTrainer(build_toy_model(tokenizer), str(tmp_path / "vh"), processing_class=tokenizer,
                         train_dataset=prompts, args=PPOConfig(output_dir=str(tmp_path / "ppo"), report_to="none",
                                                               per_device_train_batch_size=2, response_length=4))
    assert_close(trainer.reward_source(*texts), expected, atol=0, rtol=0)


def test_lora_value_head_model_by_path_scores_as_the_model_it_was_saved_from(tmp_path, base_dir, tokenizer, texts):
    lora = ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model = train_reward(ValueHeadModel(AutoModelForCausalLM.from_pretrained(base_dir)), tokenizer,
                         str(tmp_path / "vh-lora"), lora)
    assert os.path.isfile(tmp_path / "vh-lora" / "adapter_config.json")
    assert reward_model_kind(str(tmp_path / "vh-lora")) == VALUE_HEAD

    source = build_reward_source(str(tmp_path / "vh-lora"), tokenizer)
    assert_close(source(*texts), ModelReward(model, tokenizer)(*texts), atol=1e-6, rtol=0)
    assert source.reward_stats == load_reward_stats(str(tmp_path / "vh-lora")) is not None  # reward_stats.json


def test_sequence_classification_model_by_path_scores_as_in_memory(tmp_path, tokenizer, texts):
    model = build_toy_reward_model(tokenizer, seed=3).eval()
    model.save_pretrained(tmp_path / "seq")
    tokenizer.save_pretrained(tmp_path / "seq")
    assert reward_model_kind(str(tmp_path / "seq")) == SEQUENCE_CLASSIFICATION

    source = build_reward_source(str(tmp_path / "seq"))
    assert type(source.model) is type(model)
    assert_close(source(*texts), ModelReward(model, tokenizer)(*texts), atol=1e-6, rtol=0)


def test_lora_reward_adapter_by_path_runs_on_its_own_base(tmp_path, base_dir, tokenizer, texts):
    lora = ModelConfig(model_name_or_path=base_dir, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model = train_reward(base_dir, tokenizer, str(tmp_path / "rm-lora"), lora)
    assert reward_model_kind(str(tmp_path / "rm-lora")) == SEQUENCE_CLASSIFICATION_ADAPTER
    expected = ModelReward(model, tokenizer)(*texts)
    assert expected.std() > 0

    source = build_reward_source(str(tmp_path / "rm-lora"))
    assert type(source.model).__name__.startswith("PeftModel")
    assert_close(source(*texts), expected, atol=1e-6, rtol=0)
    assert source.reward_stats == load_reward_stats(str(tmp_path / "rm-lora")) is not None


def test_a_directory_without_a_reward_model_is_a_clear_error(tmp_path, base_dir, tokenizer):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is not a reward model: found no config.json and no adapter_config.json; "
                                         r"files: \[\]\. Expected a sequence-classification model"):
        build_reward_source(str(tmp_path / "empty"))
    # a causal LM (a policy, an SFT checkpoint): no reward head anywhere
    with pytest.raises(ValueError, match=r"found config.json of a LlamaForCausalLM with no value_head.safetensors; "
                                         r"files: \[.*'model.safetensors'.*\]\. Expected"):
        build_reward_source(base_dir)
    # a policy's LoRA adapter: no score head in it, no value head next to it
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                            LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    policy.save_pretrained(tmp_path / "policy-lora")
    with pytest.raises(ValueError, match=r"found a LoRA adapter \(task_type CAUSAL_LM\) with no reward head: no "
                                         r"`score` / `classifier` in adapter_model.safetensors"):
        build_reward_source(str(tmp_path / "policy-lora"))
    # a classifier with more than one label
    AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=3).save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match=r"a sequence-classification model with 3 labels"):
        build_reward_source(str(tmp_path / "three"))
