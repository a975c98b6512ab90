"""hf_rlhf.models.merge on peft's AutoPeftModel: the same merged weights as base + PeftModel + merge_and_unload."""

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hf_rlhf.models.merge import load_merged, main, merge_adapter
from hf_rlhf.toy import build_toy_model

pytestmark = pytest.mark.integration


def _adapter(tmp_path, tokenizer, task="causal_lm"):
    """(base_dir, adapter_dir) of a tiny base and a random (non-zero) LoRA adapter on it."""
    from peft import LoraConfig, get_peft_model

    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(base_dir)
    if task == "causal_lm":
        model, task_type = AutoModelForCausalLM.from_pretrained(base_dir), "CAUSAL_LM"
    else:
        model, task_type = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1), "SEQ_CLS"
        model.config.pad_token_id = tokenizer.pad_token_id
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, task_type=task_type)
    get_peft_model(model, config).save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    return base_dir, adapter_dir


def _merged_by_hand(base_dir, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).merge_and_unload()


def test_auto_peft_merge_gives_the_same_weights_as_peft_model_merge(tmp_path, tokenizer):
    base_dir, adapter_dir = _adapter(tmp_path, tokenizer)
    expected = _merged_by_hand(base_dir, adapter_dir).state_dict()
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    assert any(not torch.equal(expected[k], base[k]) for k in base)  # the adapter changes the weights
    for merged in (load_merged(adapter_dir), load_merged(adapter_dir, base_model=base_dir)):
        state = merged.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name


def test_merged_reward_model_scores_like_the_adapter(tmp_path, tokenizer):
    # a SEQ_CLS adapter trained on a causal base: the merged model needs the one-label score head
    from peft import PeftModel

    base_dir, adapter_dir = _adapter(tmp_path, tokenizer, task="seq_cls")
    ids = torch.tensor([tokenizer("12+7=19")["input_ids"]])
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, adapter_dir).eval()(ids).logits
        out = str(tmp_path / "merged")
        merge_adapter(adapter_dir, out, task="seq_cls")
        merged = AutoModelForSequenceClassification.from_pretrained(out).eval()
        merged.config.pad_token_id = tokenizer.pad_token_id
        assert merged.config.num_labels == 1
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_missing_recorded_base_says_to_pass_the_base(tmp_path, tokenizer):
    base_dir, adapter_dir = _adapter(tmp_path, tokenizer)
    expected = _merged_by_hand(base_dir, adapter_dir).state_dict()
    moved = str(tmp_path / "moved_base")
    shutil.move(base_dir, moved)
    out = str(tmp_path / "merged")
    with pytest.raises(FileNotFoundError, match="recorded in adapter_config.json not found: pass "
                                                "--base_model_name_or_path"):
        main(["--adapter", adapter_dir, "--output", out])
    assert not os.path.exists(out)
    main(["--adapter", adapter_dir, "--output", out, "--base_model_name_or_path", moved])
    state = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)
