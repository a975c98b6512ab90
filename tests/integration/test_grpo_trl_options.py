"""GRPOTrainer with the TRL 1.16 options it used to refuse (issue 42): each new loss type trains; the sampler
correction logs the mismatch injected into the engine's log-probs; None and async rewards; log_completions writes a
reloadable JSONL; shuffle_dataset=False takes the prompts in order; the options run on two architectures."""

import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hf_rlhf import GRPOConfig, GRPOTrainer
from hf_rlhf.toy import build_toy_model, prompt_dataset

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def digit_count(prompts, completions, **kwargs):
    """Rewards that differ inside a group of random samples: the number of digits."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _trainer(tmp_path, tokenizer, reward=digit_count, model=None, **kw):
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", learning_rate=5e-2,
                   seed=0, disable_tqdm=True, save_strategy="no")
    options.update(kw)
    return GRPOTrainer(model if model is not None else build_toy_model(tokenizer), reward,
                       args=GRPOConfig(**options), train_dataset=prompt_dataset(16, seed=0), processing_class=tokenizer)


def _changed(trainer, before):
    return sum(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def _last_log(trainer):
    return [h for h in trainer.state.log_history if "loss" in h][-1]


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_each_new_loss_type_trains(tmp_path, tokenizer, loss_type):
    trainer = _trainer(tmp_path, tokenizer, loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _changed(trainer, before) > 0
    logs = _last_log(trainer)
    expected = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "luspo": "clip_ratio/region_mean",
                "sapo": "policy_loss"}[loss_type]
    assert expected in logs and math.isfinite(logs[expected])


def test_injected_sampler_offset_is_logged_and_corrects_the_loss(tmp_path, tokenizer):
    """The engine's log-probs shifted by -0.05: TRL's sampling/* metrics read the shift, and with token_mask and
    clip_max 1.04 every token's ratio exp(0.05) ≈ 1.051 is masked, so the policy loss is 0 and nothing moves."""
    offset = 0.05
    trainer = _trainer(tmp_path, tokenizer, vllm_importance_sampling_correction=True,
                       vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.04, max_steps=1)
    engine = trainer.rollout_maker.engine
    generate = engine.generate

    def shifted(*args, **kwargs):
        out = generate(*args, **kwargs)
        return dataclasses.replace(out, logprobs=out.logprobs - offset)

    engine.generate = shifted
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _last_log(trainer)
    assert logs["sampling/sampling_logp_difference/mean"] == pytest.approx(offset, abs=1e-4)
    assert logs["sampling/sampling_logp_difference/max"] == pytest.approx(offset, abs=1e-4)
    assert logs["sampling/importance_sampling_ratio/max"] == 0.0  # every ratio masked
    assert logs["policy_loss"] == 0.0 and _changed(trainer, before) == 0
    # truncating instead keeps the tokens at weight 1.04: the policy trains
    trainer = _trainer(tmp_path / "truncate", tokenizer, vllm_importance_sampling_correction=True,
                       vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.04,
                       max_steps=1)
    trainer.rollout_maker.engine.generate = shifted
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _last_log(trainer)
    assert logs["sampling/importance_sampling_ratio/max"] == pytest.approx(1.04)
    assert _changed(trainer, before) > 0


def test_none_and_async_rewards_as_trl(tmp_path, tokenizer):
    def not_applicable(prompts, completions, **kwargs):
        return [None] * len(completions)

    async def async_digits(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return digit_count(prompts, completions)

    trainer = _trainer(tmp_path, tokenizer, reward=[async_digits, not_applicable], log_completions=True)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _changed(trainer, before) > 0
    logs = _last_log(trainer)
    assert math.isnan(logs["rewards/not_applicable/mean"])  # TRL: nanmean over no value
    assert logs["reward"] == logs["rewards/async_digits/mean"]
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert len(rows) == 2 * 4 and {r["rewards"]["not_applicable"] for r in rows} == {None}
    assert [r["rewards"]["async_digits"] for r in rows[:4]] == digit_count(None, [r["completion"] for r in rows[:4]])


def test_all_none_rewards_train_nothing_and_warn(tmp_path, tokenizer, caplog):
    def always_none(prompts, completions, **kwargs):
        return [None] * len(completions)

    trainer = _trainer(tmp_path, tokenizer, reward=always_none)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    assert _changed(trainer, before) == 0


def test_shuffle_dataset_false_takes_prompts_in_order(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, shuffle_dataset=False, log_completions=True, max_steps=1)
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert [r["prompt"] for r in rows] == [prompt_dataset(16, seed=0)[0]["prompt"]] * 4


def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_options_together_on_two_architectures(tmp_path, tokenizer, arch):
    """delta, top_entropy_quantile, off_policy_mask_threshold, adaptive entropy, sync_ref_model, normalize_then_sum,
    pad_to_multiple_of and cast_lm_head_to_fp32 in one run of each architecture (the MoE one with its router loss)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))
    from zoo_models import build

    moe = arch == "qwen2_moe"
    trainer = _trainer(tmp_path, tokenizer, reward=[digit_count, length], model=build(arch), delta=1.5,
                       top_entropy_quantile=0.5, off_policy_mask_threshold=0.5, use_adaptive_entropy=True,
                       entropy_target=10.0, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
                       multi_objective_aggregation="normalize_then_sum", pad_to_multiple_of=8,
                       cast_lm_head_to_fp32=True, router_aux_loss_coef=0.01 if moe else None)
    assert trainer.aux_loss_enabled == moe
    ref_before = [p.clone() for p in trainer.ref_model.parameters()]
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _changed(trainer, before) > 0
    assert any(not torch.equal(a, b) for a, b in zip(ref_before, trainer.ref_model.parameters()))  # synced
    logs = _last_log(trainer)
    assert logs["entropy_coef"] == pytest.approx(0.01)  # entropy below the target: + 2 × 0.005
    assert ("aux_loss" in logs) == moe and (not moe or logs["aux_loss"] > 0)


def test_resume_is_exact_with_shuffle_off_and_adaptive_entropy(tmp_path, tokenizer):
    """A run stopped at a checkpoint and resumed logs the same losses as the uninterrupted run: the prompt order of
    shuffle_dataset=False and the adaptive entropy coefficient (a stateful callback) come back."""
    options = dict(shuffle_dataset=False, use_adaptive_entropy=True, entropy_target=10.0, entropy_coef_delta=0.01,
                   max_steps=4, save_strategy="steps", save_steps=2, loss_type="sapo")
    full = _trainer(tmp_path / "full", tokenizer, **options)
    full.train()
    resumed = _trainer(tmp_path / "resumed", tokenizer, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    logs = {h["step"]: h for h in full.state.log_history if "loss" in h}
    again = {h["step"]: h for h in resumed.state.log_history if "loss" in h}
    for step in (3, 4):
        assert again[step]["loss"] == logs[step]["loss"] and again[step]["entropy_coef"] == logs[step]["entropy_coef"]
    assert logs[4]["entropy_coef"] == pytest.approx(0.04)


def test_liger_kernel_refuses_a_lora_on_the_lm_head(tmp_path, tokenizer):
    from peft import LoraConfig

    def build(peft_config, **kw):
        return GRPOTrainer(build_toy_model(tokenizer), digit_count, args=GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
            report_to="none", **kw),
            train_dataset=prompt_dataset(8, seed=0), processing_class=tokenizer, peft_config=peft_config)

    on_head = LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="use_liger_kernel=True with a peft adapter on `lm_head`"):
        build(on_head, use_liger_kernel=True)
    build(on_head)  # without liger the chunked LM head runs the adapter: it trains
    build(LoraConfig(r=4, target_modules=["q_proj"]), use_liger_kernel=True)
    build(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), use_liger_kernel=True)


def test_beam_search_generation_kwargs_train(tmp_path, tokenizer):
    # TRL's test_train_with_generation_kwargs: sampled beam search; with prefix sharing on and two iterations (the
    # old log-probs would come off the decoding) the rollout prefills inside generate and runs a policy forward
    trainer = _trainer(tmp_path, tokenizer, prefix_sharing=True, num_iterations=2, max_steps=2,
                       generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1})
    assert trainer.rollout_maker.capture_decoding is False
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _changed(trainer, before) > 0
    with pytest.raises(ValueError, match="beam search"):
        _trainer(tmp_path, tokenizer, vllm_importance_sampling_correction=True, generation_kwargs={"num_beams": 2})


def _stream(n=16):
    from datasets import IterableDataset

    rows = list(prompt_dataset(n, seed=0))
    return IterableDataset.from_generator(lambda: iter(rows))


def test_streamed_prompts_as_trl(tmp_path, tokenizer):
    # a streamed train set: accelerate must not dispatch batches, and it is read by one process (TRL's settings)
    trainer = GRPOTrainer(build_toy_model(tokenizer), digit_count, train_dataset=_stream(), processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                          max_completion_length=6, max_steps=2, report_to="none", save_strategy="no",
                                          dataloader_num_workers=2, disable_tqdm=True))
    assert trainer.args.accelerator_config.dispatch_batches is False and trainer.args.dataloader_num_workers == 0
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _changed(trainer, before) > 0
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer("/no/such/model", digit_count, train_dataset=_stream(), processing_class=tokenizer,
                    args=GRPOConfig(output_dir=str(tmp_path), accelerator_config={"dispatch_batches": True}))
    # a streamed eval set leaves a map-style train set's workers; its own loader has none; args unchanged
    trainer = _trainer(tmp_path, tokenizer, dataloader_num_workers=2, per_device_eval_batch_size=4)
    trainer.eval_dataset = _stream(4)
    assert trainer.get_train_dataloader().num_workers == 2 and trainer.get_eval_dataloader().num_workers == 0
    assert trainer.args.dataloader_num_workers == 2
    assert math.isfinite(trainer.evaluate()["eval_reward"])


def test_prompt_workers_read_the_same_rows_and_resume_exactly(tmp_path, tokenizer):
    # dataloader_num_workers: worker processes read the coming rollouts' prompt rows; the run is the one without
    # them, loss for loss, and resuming mid-generation with them stays exact
    def run(name, workers, resume=None, **kw):
        trainer = _trainer(tmp_path / name, tokenizer, dataloader_num_workers=workers, max_steps=6, num_iterations=2,
                           save_strategy="steps", save_steps=3, **kw)
        trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    alone = run("alone", 0)
    assert run("workers", 2) == alone
    resumed = run("workers", 2, resume=str(tmp_path / "workers" / "checkpoint-3"))
    assert {s: v for s, v in resumed.items() if s > 3} == {s: v for s, v in alone.items() if s > 3}
