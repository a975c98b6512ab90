"""DPOTrainer on the tiny toy model: bad rows fail before any model loads, the three kinds of reference (frozen copy,
adapters off, a given model) and none for reference-free losses, precomputed reference log-probs stored and reused on
resume, the padding-free and prefix-shared layouts training as the padded one, exact resume, and the recipe's
documented command."""

import json
import os

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from hf_rlhf import DPOConfig, DPOTrainer
from hf_rlhf.data import DataValidationError
from hf_rlhf.toy import build_toy_model, preference_dataset

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=3, logging_steps=1,
              save_strategy="no", report_to="none", seed=0, disable_tqdm=True, learning_rate=1e-3, max_length=64)


def args(tmp_path, **kw):
    return DPOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **kw})


def test_bad_row_named_before_any_model_loads(tmp_path, tokenizer):
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "", "rejected": "5"}]
    with pytest.raises(DataValidationError, match=r"row 1.*chosen"):
        DPOTrainer("/nonexistent/model/path", args=args(tmp_path), train_dataset=rows, processing_class=tokenizer)


def test_unknown_argument_is_an_error(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="unexpected arguments \\['beta'\\]"):
        DPOTrainer(build_toy_model(tokenizer, "tiny"), args=args(tmp_path), beta=0.1)


@pytest.mark.parametrize("kind", ["copy", "lora", "given", "simpo"])
def test_reference(tmp_path, tokenizer, kind):
    model = build_toy_model(tokenizer, "tiny", seed=0)
    extra, ref = {}, None
    if kind == "lora":
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if kind == "given":
        ref = build_toy_model(tokenizer, "tiny", seed=3)
    config = args(tmp_path, loss_type="simpo" if kind == "simpo" else "sigmoid")
    trainer = DPOTrainer(model, ref, config, None, preference_dataset(16, seed=1), None, tokenizer, **extra)
    if kind in ("lora", "simpo"):
        assert trainer.ref_model is None  # adapters off / reference-free: no second model
    else:
        assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
        frozen = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    first = [h for h in trainer.state.log_history if "loss" in h][0]
    if kind in ("copy", "lora"):  # policy == reference at step 0: every reward is 0, the loss log 2
        assert first["rewards/chosen"] == 0 and first["rewards/margins"] == 0
        assert first["loss"] == pytest.approx(0.693147, abs=1e-5)
    if kind in ("copy", "given"):
        assert all(torch.equal(p, frozen[n]) for n, p in trainer.ref_model.named_parameters())
        assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_precomputed_reference_is_stored_and_reused(tmp_path, tokenizer):
    pairs = preference_dataset(16, seed=1)

    def make():
        return DPOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None,
                          args(tmp_path, precompute_ref_log_probs=True), None, pairs, pairs, tokenizer)

    first = make()
    stored = os.listdir(tmp_path / "out" / "ref_logps")
    assert sorted(n.split("-")[0] for n in stored) == ["eval", "train"]
    ref = first.train_dataset["ref_chosen_logps"]
    # a second trainer on the same output_dir (a resumed run) reads them back: poison the file to prove it
    path = tmp_path / "out" / "ref_logps" / [n for n in stored if n.startswith("train")][0]
    data = torch.load(path)
    torch.save({k: v + 1.0 for k, v in data.items()}, path)
    second = make()
    assert second.train_dataset["ref_chosen_logps"] == pytest.approx([x + 1.0 for x in ref])


def test_layouts_train_as_padded(tmp_path, tokenizer):
    """padding_free (TRL 1.16 has it switched off) and prefix_sharing train as TRL's padded layout: the same losses,
    metrics and num_tokens over 3 steps and an evaluation (logs within 1e-5), with precomputed reference log-probs
    too; both refuse keep_end truncation and each other."""
    pairs, held_out = preference_dataset(16, seed=1), preference_dataset(8, seed=2)
    logs = {}
    for layout in ("padded", "padding_free", "prefix_sharing"):
        extra = {} if layout == "padded" else {layout: True}
        config = args(tmp_path / layout, eval_strategy="steps", eval_steps=3, precompute_ref_log_probs=True, **extra)
        trainer = DPOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, config, None, pairs, held_out, tokenizer)
        trainer.train()
        logs[layout] = [{k: v for k, v in h.items() if not any(t in k for t in ("runtime", "per_second", "flos"))}
                        for h in trainer.state.log_history]  # flos count the positions computed: they differ
    for layout in ("padding_free", "prefix_sharing"):
        assert len(logs[layout]) == len(logs["padded"]) == 5
        for ours, padded in zip(logs[layout], logs["padded"]):
            assert ours.keys() == padded.keys()
            for key, value in padded.items():
                assert ours[key] == pytest.approx(value, abs=1e-5), (layout, key)
    for bad in ({"padding_free": True, "truncation_mode": "keep_end"}, {"padding_free": True, "prefix_sharing": True}):
        with pytest.raises(ValueError, match="padding_free"):
            args(tmp_path, **bad)


def test_resume_is_exact(tmp_path, tokenizer):
    pairs = preference_dataset(32, seed=1)

    class StopAfterTwo(TrainerCallback):  # the run is interrupted after its step-2 checkpoint
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    def run(out, stop=False, resume=None):
        config = DPOConfig(output_dir=str(out), **{**COMMON, "max_steps": 4, "save_strategy": "steps", "save_steps": 2})
        trainer = DPOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, config, None, pairs, None, tokenizer,
                             callbacks=[StopAfterTwo()] if stop else None)
        trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    full = run(tmp_path / "a")
    run(tmp_path / "b", stop=True)
    resumed = run(tmp_path / "b", resume=True)
    print(f"resume: full {full}, resumed {resumed}")
    assert resumed[3] == full[3] and resumed[4] == full[4], (full, resumed)


def test_recipe_documented_command(tmp_path, tiny_model_dir):
    from recipes import dpo as recipe

    out = str(tmp_path / "dpo")
    results = recipe.main(["--config", os.path.join(ROOT, "recipes", "configs", "dpo_toy.yaml"), "--max_steps", "3",
                           "--sft_model_path", str(tiny_model_dir), "--output_dir", out, "--toy_train_size", "64",
                           "--toy_test_size", "16", "--per_device_train_batch_size", "8", "--disable_tqdm", "true"])
    with open(os.path.join(out, "results.json")) as f:
        saved = json.load(f)
    for when in ("before", "after"):
        assert 0.0 <= saved[when]["exact_match"] <= 1.0 and "rewards/accuracies" in saved[when]
    assert saved["after"] == results["after"]
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_qlora_policy_reference_is_the_4bit_base_with_adapters_off(tmp_path, tiny_model_dir, tokenizer):
    bnb = pytest.importorskip("bitsandbytes")
    from hf_rlhf import ModelConfig

    config = ModelConfig(model_name_or_path=str(tiny_model_dir), use_peft=True, load_in_4bit=True, lora_r=4,
                         lora_target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(str(tiny_model_dir), args=args(tmp_path), train_dataset=preference_dataset(16, seed=1),
                         processing_class=tokenizer, model_config=config)
    assert trainer.ref_model is None and any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.693147, abs=1e-4)  # adapters start at identity: policy == reference
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)
