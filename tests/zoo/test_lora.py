"""LoRA on every architecture: an adapter saved, reloaded on its base and merged gives the logits it had in
memory; a LoRA reward model with its head (sequence-classification `score` in the adapter, or a `ValueHeadModel`'s
`value_head.safetensors`) reloads to the same rewards."""

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from zoo_models import MODEL_TYPES, PAD_ID, build, random_sequences

from hf_rlhf import ModelConfig
from hf_rlhf.collators import LeftPaddingCollator
from hf_rlhf.models.loading import apply_lora, lora_config
from hf_rlhf.models.merge import merge_adapter
from hf_rlhf.models.value_head import ValueHeadModel, get_rewards

LORA = ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


def batch():
    sequences = random_sequences([8, 3, 5], seed=9)
    return LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": s} for s in sequences])


def lora(model, task_type):
    """`model` with LoRA adapters whose B is random, so that the adapter changes the outputs."""
    model = apply_lora(model, lora_config(LORA, task_type=task_type))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_save_reload_merge_gives_the_same_logits(tmp_path, model_type):
    from peft import PeftModel

    base_dir, adapter_dir, merged_dir = (str(tmp_path / name) for name in ("base", "adapter", "merged"))
    build(model_type).save_pretrained(base_dir)
    model = lora(AutoModelForCausalLM.from_pretrained(base_dir), "CAUSAL_LM")
    inputs = batch()
    with torch.no_grad():
        expected = model(**inputs, use_cache=False).logits
        with model.disable_adapter():
            assert (model(**inputs, use_cache=False).logits - expected).abs().max() > 1e-3  # the adapter matters
    model.save_pretrained(adapter_dir)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    merge_adapter(adapter_dir, merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        assert_close(reloaded(**inputs, use_cache=False).logits, expected, atol=1e-5, rtol=1e-4)
        assert_close(merged(**inputs, use_cache=False).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["seq_cls", "value_head"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_reward_adapter_with_its_head_reloads_to_the_same_rewards(tmp_path, model_type, kind):
    from peft import PeftModel

    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    inputs = batch()
    if kind == "seq_cls":
        build(model_type, "seq_cls").save_pretrained(base_dir)
        model = lora(AutoModelForSequenceClassification.from_pretrained(base_dir), "SEQ_CLS")
        with torch.no_grad():  # a trained head, not the base's (peft saves `score` with the adapter)
            model.base_model.model.score.modules_to_save["default"].weight.normal_(0, 0.5)
    else:
        build(model_type).save_pretrained(base_dir)
        model = ValueHeadModel(lora(AutoModelForCausalLM.from_pretrained(base_dir), "CAUSAL_LM")).eval()
    expected = get_rewards(model, inputs["input_ids"], inputs["attention_mask"])
    model.save_pretrained(adapter_dir)
    if kind == "seq_cls":
        reloaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base_dir), adapter_dir)
        merged = merge_adapter(adapter_dir, str(tmp_path / "merged"), task="seq_cls")
        assert_close(get_rewards(merged.eval(), inputs["input_ids"], inputs["attention_mask"]), expected,
                     atol=1e-5, rtol=1e-4)
    else:
        reloaded = ValueHeadModel.from_pretrained(adapter_dir)
    assert_close(get_rewards(reloaded.eval(), inputs["input_ids"], inputs["attention_mask"]), expected,
                 atol=1e-5, rtol=1e-4)
