"""recipes/reward.py end to end at a tiny size: from a fresh toy model, on top of an SFT model, and with LoRA."""

import json
import os

import pytest
from transformers import AutoModelForSequenceClassification

from hf_rlhf.models.value_head import load_reward_stats
from recipes import reward as recipe

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--toy_train_size", "64", "--toy_test_size", "32", "--toy_model_size", "tiny", "--max_steps", "3",
        "--per_device_train_batch_size", "16", "--logging_steps", "1", "--disable_tqdm", "true"]


def run(tmp_path, *extra, config="reward_toy.yaml"):
    out = str(tmp_path / "out")
    argv = ["--config", os.path.join(ROOT, "recipes", "configs", config), "--output_dir", out, *TINY, *extra]
    results = recipe.main(argv)
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f)["after"]["accuracy"] == results["after"]["accuracy"]
    return results, out


def test_from_a_fresh_toy_model(tmp_path):
    results, out = run(tmp_path, "--sft_model_path", str(tmp_path / "no-sft-here"))
    assert results["start"].startswith("new toy model")
    for when in ("before", "after"):
        assert 0.0 <= results[when]["accuracy"] <= 1.0
    stats = load_reward_stats(out)
    assert stats == {"reward_mean": results["after"]["reward_mean"], "reward_std": results["after"]["reward_std"]}
    AutoModelForSequenceClassification.from_pretrained(out)


def test_on_top_of_an_sft_model(tmp_path, tiny_model_dir, tokenizer):
    sft_dir = str(tiny_model_dir)
    results, out = run(tmp_path, "--sft_model_path", sft_dir)
    assert results["start"] == f"SFT model {sft_dir}"
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id


def test_lora_config(tmp_path):
    results, out = run(tmp_path, "--sft_model_path", str(tmp_path / "none"), config="reward_toy_lora.yaml")
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
    assert load_reward_stats(out) is not None
