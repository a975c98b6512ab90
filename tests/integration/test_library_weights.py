"""Weights and dropout through peft/trl helpers: the same tensors as the hand-written code gave."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_rlhf.models.loading import disable_dropout, load_weights
from hf_rlhf.toy import build_toy_model

pytestmark = pytest.mark.integration


def _lora(model, seed, **kwargs):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0, **kwargs)
    return get_peft_model(model, config)


def test_load_weights_puts_the_saved_adapter_into_a_peft_model(tmp_path, tokenizer):
    from peft import get_peft_model_state_dict

    saved = _lora(build_toy_model(tokenizer, "tiny", seed=0), seed=1)
    saved.add_adapter("value", saved.peft_config["default"])
    saved.save_pretrained(str(tmp_path))  # default in tmp_path, "value" in tmp_path/value
    target = _lora(build_toy_model(tokenizer, "tiny", seed=0), seed=2)
    target.add_adapter("value", target.peft_config["default"])
    for name in ("default", "value"):
        before = get_peft_model_state_dict(target, adapter_name=name)
        expected = get_peft_model_state_dict(saved, adapter_name=name)
        assert any(not torch.equal(before[k], expected[k]) for k in expected)
    load_weights(target, str(tmp_path))
    load_weights(target, os.path.join(str(tmp_path), "value"), adapter_name="value")
    for name in ("default", "value"):
        state, expected = (get_peft_model_state_dict(m, adapter_name=name) for m in (target, saved))
        assert state.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (name, key)
    ids = torch.tensor([tokenizer("12+7=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(target.eval()(ids).logits, saved.eval()(ids).logits, atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="no adapter"):
        load_weights(target, str(tmp_path / "nothing_here"))


def _lora_with_dropout(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.5))


def _train_forward_is_deterministic(model, ids) -> bool:
    model.train()
    torch.manual_seed(0)
    first = model(ids).logits
    torch.manual_seed(1)
    return torch.equal(first, model(ids).logits)


def test_disable_dropout_also_zeroes_attention_dropout_that_trls_misses(tokenizer):
    from trl.trainer.utils import disable_dropout_in_model

    ids = torch.tensor([tokenizer("12+7=19")["input_ids"]])
    models = []
    for _ in range(2):
        config = build_toy_model(tokenizer, "tiny").config
        config.attention_dropout = 0.5  # read by the attention layers at construction
        base = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        models.append(_lora_with_dropout(base))
    theirs, ours = models
    disable_dropout_in_model(theirs)
    disable_dropout(ours)
    dropouts = [m for m in ours.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0 for m in dropouts)  # nn.Dropout: the same as trl's
    assert all(m.p == 0 for m in theirs.modules() if isinstance(m, torch.nn.Dropout))
    with torch.no_grad():
        assert not _train_forward_is_deterministic(theirs, ids)  # attention_dropout still 0.5
        assert _train_forward_is_deterministic(ours, ids)
        train_logits = ours(ids).logits
        torch.testing.assert_close(train_logits, ours.eval()(ids).logits, atol=0, rtol=0)

