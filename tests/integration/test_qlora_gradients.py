"""QLoRA keeps its gradients after an inference forward (bitsandbytes >= 0.49 repacks 4-bit weights for a CPU
inference kernel without a backward at the first eval-mode, no-grad forward: a PPO rollout or an evaluation)."""

import pytest
import torch

from hf_rlhf import ModelConfig
from hf_rlhf.models.loading import apply_lora, load_model
from hf_rlhf.toy import build_toy_model

pytestmark = pytest.mark.integration


def lora_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model.train()
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}


def test_gradients_through_the_4bit_base_survive_an_inference_forward(tmp_path, tokenizer, one_thread):
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig

    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(tmp_path)
    model = load_model(ModelConfig(model_name_or_path=str(tmp_path), use_peft=True, load_in_4bit=True))
    # B initialised at random (not 0), so every adapter's gradient depends on what flows through the base
    model = apply_lora(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    ids = torch.tensor([tokenizer.encode("Q: 12+7=? A:")])
    before = lora_grads(model, ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)  # a rollout / evaluation forward
    after = lora_grads(model, ids)
    assert before and all(g.abs().sum() > 0 for g in before.values())
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, msg=lambda m, name=name: f"{name}: {m}")
