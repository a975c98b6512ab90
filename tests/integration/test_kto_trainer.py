"""KTOTrainer on the tiny toy model: bad rows (unpaired and paired) fail before any model loads, options TRL refuses
are refused, the three kinds of reference (frozen copy, adapters off, a given model), precomputed reference log-probs
stored and reused, the padding-free layout training as the padded one, the chunked LM head as the logits, exact
resume."""

import os

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from hf_rlhf import KTOConfig, KTOTrainer
from hf_rlhf.data import DataValidationError
from hf_rlhf.toy import build_toy_model, unpaired_dataset

pytestmark = pytest.mark.integration

COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=3, logging_steps=1,
              save_strategy="no", report_to="none", seed=0, disable_tqdm=True, learning_rate=1e-3, max_length=64)
SKIP = ("runtime", "per_second", "flos")  # flos count the positions computed: they differ between layouts


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def args(tmp_path, **kw):
    return KTOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **kw})


def logs_of(trainer):
    return [{k: v for k, v in h.items() if not any(t in k for t in SKIP)} for h in trainer.state.log_history]


@pytest.mark.parametrize("rows, field", [
    ([{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "2+2=", "completion": "5", "label": "no"}],
     "label"),
    ([{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "2+2=", "completion": "", "label": False}],
     "completion"),
    ([{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "2+2=", "label": False}], "completion"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": "4"}],
     "rejected"),
])
def test_bad_row_named_before_any_model_loads(tmp_path, tokenizer, rows, field):
    with pytest.raises(DataValidationError, match=rf"row 1.*{field}"):
        KTOTrainer("/nonexistent/model/path", args=args(tmp_path), train_dataset=rows, processing_class=tokenizer)


def test_options_refused_with_the_reason(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="unexpected arguments \\['beta'\\]"):
        KTOTrainer(build_toy_model(tokenizer, "tiny"), args=args(tmp_path), beta=0.1)
    for bad, message in (({"train_sampling_strategy": "random"}, "train_sampling_strategy='sequential'"),
                         ({"per_device_train_batch_size": 1}, "per_device_train_batch_size > 1"),
                         ({"prefix_sharing": True, "loss_type": "apo_zero_unpaired"}, "no mismatched completion"),
                         ({"prefix_sharing": True, "padding_free": True}, "different layouts"),
                         ({"loss_type": "sigmoid"}, "loss_type='sigmoid'; expected one of"),
                         ({"beta": 0.0}, "beta must be > 0"),
                         ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "stale")):
        with pytest.raises(ValueError, match=message):
            args(tmp_path, **bad)
    args(tmp_path, loss_type="apo_zero_unpaired", train_sampling_strategy="random", per_device_train_batch_size=1)


@pytest.mark.parametrize("kind", ["copy", "lora", "given"])
def test_reference(tmp_path, tokenizer, kind):
    model = build_toy_model(tokenizer, "tiny", seed=0)
    extra, ref = {}, None
    if kind == "lora":
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if kind == "given":
        ref = build_toy_model(tokenizer, "tiny", seed=3)
    trainer = KTOTrainer(model, ref, args(tmp_path), None, unpaired_dataset(8, seed=1), None, tokenizer, **extra)
    if kind == "lora":
        assert trainer.ref_model is None  # adapters off: no second model
    else:
        assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
        frozen = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if kind in ("copy", "lora"):  # policy == reference at step 0: rewards and z0 are 0, every loss 1 − σ(0)
        assert logs[0]["rewards/chosen"] == 0 and logs[0]["kl"] == 0 and logs[0]["loss"] == pytest.approx(0.5)
        assert logs[1]["rewards/chosen"] != 0 and logs[1]["loss"] != 0.5  # one step later the policy has moved
    if kind in ("copy", "given"):
        assert all(torch.equal(p, frozen[n]) for n, p in trainer.ref_model.named_parameters())
        assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_precomputed_reference_is_stored_and_reused(tmp_path, tokenizer):
    rows = unpaired_dataset(8, seed=1)

    def make(**kw):
        return KTOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None,
                          args(tmp_path, precompute_ref_log_probs=True, **kw), None, rows, rows, tokenizer)

    first = make()
    stored = os.listdir(tmp_path / "out" / "ref_logps")
    assert sorted(n.split("-")[0] for n in stored) == ["eval", "train"]
    ref = first.train_dataset["ref_logps"]
    assert len(first.train_dataset["ref_KL_logps"]) == len(ref) == 16
    # a second trainer on the same output_dir (a resumed run) reads them back: poison the file to prove it
    path = tmp_path / "out" / "ref_logps" / [n for n in stored if n.startswith("train")][0]
    torch.save({k: v + 1.0 for k, v in torch.load(path).items()}, path)
    assert make().train_dataset["ref_logps"] == pytest.approx([x + 1.0 for x in ref])


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_layouts_and_chunked_head_train_as_padded(tmp_path, tokenizer, loss_type):
    """padding_free, prefix_sharing (the kto loss) and the chunked LM head give the padded layout's losses and metrics
    over 3 steps and an evaluation (within 1e-5), with the reference computed live and precomputed."""
    rows, held_out = unpaired_dataset(8, seed=1), unpaired_dataset(4, seed=2)
    logs = {}
    for name, extra in (("padded", {}), ("padding_free", {"padding_free": True}),
                        ("chunked", {"chunked_lm_head": True}),
                        ("padding_free_precomputed", {"padding_free": True, "precompute_ref_log_probs": True}),
                        *((("prefix_sharing", {"prefix_sharing": True}),
                           ("prefix_sharing_precomputed", {"prefix_sharing": True, "precompute_ref_log_probs": True}),
                           ("prefix_sharing_chunked", {"prefix_sharing": True, "chunked_lm_head": True}))
                          if loss_type == "kto" else ())):
        config = args(tmp_path / name, eval_strategy="steps", eval_steps=3, loss_type=loss_type, **extra)
        trainer = KTOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, config, None, rows, held_out, tokenizer)
        if name == "chunked":
            assert trainer.lm_heads["policy"] is not None
        trainer.train()
        logs[name] = logs_of(trainer)
    for name in [n for n in logs if n != "padded"]:
        assert len(logs[name]) == len(logs["padded"]) == 5
        for ours, padded in zip(logs[name], logs["padded"]):
            assert ours.keys() == padded.keys()
            for key, value in padded.items():
                assert ours[key] == pytest.approx(value, abs=1e-5), (name, key)


def test_resume_is_exact(tmp_path, tokenizer):
    rows = unpaired_dataset(16, seed=1)

    class StopAfterTwo(TrainerCallback):  # the run is interrupted after its step-2 checkpoint
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    def run(out, stop=False, resume=None):
        config = KTOConfig(output_dir=str(out), **{**COMMON, "max_steps": 4, "save_strategy": "steps", "save_steps": 2})
        trainer = KTOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, config, None, rows, None, tokenizer,
                             callbacks=[StopAfterTwo()] if stop else None)
        trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: (h["loss"], h["kl"]) for h in trainer.state.log_history if "loss" in h}

    full = run(tmp_path / "a")
    run(tmp_path / "b", stop=True)
    resumed = run(tmp_path / "b", resume=True)
    print(f"resume: full {full}, resumed {resumed}")
    assert resumed[3] == full[3] and resumed[4] == full[4], (full, resumed)


@pytest.mark.parametrize("rows", ["unpaired", "paired"])
def test_streamed_rows_train_as_in_memory(tmp_path, tokenizer, rows):
    """A streamed `IterableDataset` (unpaired rows, or pairs split as they stream) is prepared lazily and trains as
    the same rows in memory; a bad row fails naming its index in the stream."""
    from datasets import Dataset

    from hf_rlhf.toy import preference_dataset

    data = unpaired_dataset(8, seed=1) if rows == "unpaired" else preference_dataset(8, seed=1)
    logs = {}
    for name, dataset in (("memory", data), ("stream", data.to_iterable_dataset())):
        trainer = KTOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, args(tmp_path / name), None, dataset,
                             None, tokenizer)
        trainer.train()
        logs[name] = [(h["loss"], h["kl"]) for h in trainer.state.log_history if "loss" in h]
    assert logs["stream"] == pytest.approx(logs["memory"], abs=1e-6)
    bad = Dataset.from_list([{"prompt": "1+1=", "completion": "2", "label": True}] * 4 +
                            [{"prompt": "2+2=", "completion": "4", "label": None}]).to_iterable_dataset()
    trainer = KTOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, args(tmp_path / "bad"), None, bad, None,
                         tokenizer)
    with pytest.raises(DataValidationError, match=r"row 4.*label"):
        trainer.train()


def test_recipe_documented_command(tmp_path, tiny_model_dir):
    import json

    from recipes import kto as recipe

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = str(tmp_path / "kto")
    results = recipe.main(["--config", os.path.join(root, "recipes", "configs", "kto_toy.yaml"), "--max_steps", "3",
                           "--sft_model_path", str(tiny_model_dir), "--output_dir", out, "--toy_train_size", "32",
                           "--toy_test_size", "16", "--per_device_train_batch_size", "8", "--disable_tqdm", "true"])
    with open(os.path.join(out, "results.json")) as f:
        saved = json.load(f)
    for when in ("before", "after"):
        assert 0.0 <= saved[when]["exact_match"] <= 1.0 and "rewards/margins" in saved[when]
    assert saved["before"]["loss"] == pytest.approx(0.5)  # the policy is its own reference before training
    assert saved["after"] == results["after"]
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_evaluate_after_training_uses_the_kept_reference(tmp_path, tokenizer):
    """Deliberate (as DPO's, docs/trl_compatibility.md): TRL refuses `evaluate(new_rows)` after training with
    `precompute_ref_log_probs` and no ref_model (it keeps no reference); hf_rlhf keeps the frozen reference, so the
    new rows' reference log-probs are the reference's, not the trained policy's."""
    config = args(tmp_path, precompute_ref_log_probs=True)
    trainer = KTOTrainer(build_toy_model(tokenizer, "tiny", seed=0), None, config, None, unpaired_dataset(8, seed=1),
                         None, tokenizer)
    rows = unpaired_dataset(2, seed=2)
    before = trainer.prepare_eval_dataset(rows, "before")["ref_logps"]
    trainer.train()
    after = trainer.prepare_eval_dataset(rows, "after")["ref_logps"]
    assert after == pytest.approx(before, abs=1e-5)
    chosen = [x for x, label in zip(before, rows["label"]) if label]
    policy = trainer.evaluate(eval_dataset=rows)["eval_logps/chosen"]
    assert abs(policy - sum(chosen) / len(chosen)) > 1e-3  # the policy moved; the reference did not
