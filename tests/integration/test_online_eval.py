"""Evaluation of PPO / GRPO (`eval_dataset`, `evaluate()`, `eval_strategy`, `load_best_model_at_end`): TRL's eval
metrics, pass@k, compute_metrics; a run with evaluation trains bit-for-bit as the same run without, resume included;
bad eval rows are named before any model loads."""

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from hf_rlhf import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from hf_rlhf.data.validation import DataValidationError
from hf_rlhf.toy import build_toy_model, prompt_dataset

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def has_a_one(prompts, completions, **kwargs):
    return [float("1" in c) for c in completions]


def shortness(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]


def build_policy(arch, tokenizer):
    if arch == "llama":
        return build_toy_model(tokenizer)
    config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def grpo(tmp_path, tokenizer, name="run", arch="llama", evaluate=True, **kw):
    # 2 prompts x 4 samples a generation, micro-batches of 2: 4 optimizer steps per generation (steps_per_generation)
    options = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, steps_per_generation=4,
                   num_generations=4, max_completion_length=6, max_steps=8, logging_steps=1, report_to="none",
                   learning_rate=3e-3, disable_tqdm=True, save_strategy="no", seed=0, per_device_eval_batch_size=8,
                   beta=0.04)
    if evaluate:
        options.update(eval_strategy="steps", eval_steps=3)
    options.update(kw)
    return GRPOTrainer(build_policy(arch, tokenizer), [has_a_one, shortness], args=GRPOConfig(**options),
                       train_dataset=prompt_dataset(16, seed=0), processing_class=tokenizer,
                       eval_dataset=prompt_dataset(6, seed=1, split="test") if evaluate else None)


def train_logs(trainer) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def eval_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "eval_reward" in h]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_evaluation_leaves_training_bit_equal(tmp_path, tokenizer, arch):
    plain = grpo(tmp_path, tokenizer, "plain", arch, evaluate=False)
    plain.train()
    evaluated = grpo(tmp_path, tokenizer, "eval", arch, eval_on_start=True)
    evaluated.train()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), evaluated.model.named_parameters()):
        assert torch.equal(a, b), name
    assert [h["loss"] for h in train_logs(plain).values()] == [h["loss"] for h in train_logs(evaluated).values()]
    evals = eval_logs(evaluated)
    assert [h["step"] for h in evals] == [0, 3, 6, 8]  # on start, every 3 steps (mid-generation), at the end
    for h in evals:  # TRL's names (eval_ prefix), per reward function, pass@k over the 4 completions of a prompt
        assert {"eval_loss", "eval_reward_std", "eval_rewards/has_a_one/mean", "eval_rewards/shortness/std",
                "eval_completions/mean_length", "eval_frac_reward_zero_std", "eval_pass@1", "eval_pass@2",
                "eval_pass@4"} <= set(h)
        assert h["eval_reward"] == pytest.approx(h["eval_rewards/has_a_one/mean"] + h["eval_rewards/shortness/mean"])
        assert h["eval_pass@1"] <= h["eval_pass@2"] <= h["eval_pass@4"]


def test_resume_mid_generation_with_evaluation_is_exact(tmp_path, tokenizer):
    full = grpo(tmp_path, tokenizer, "full", save_strategy="steps", save_steps=2)
    full.train()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")  # mid-generation
    resumed = grpo(tmp_path, tokenizer, "resumed", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert {s: h["loss"] for s, h in train_logs(full).items() if s > 2} == \
        {s: h["loss"] for s, h in train_logs(resumed).items() if s > 2}
    # the evaluations after the checkpoint see the same weights and the same evaluation stream
    assert [h["eval_reward"] for h in eval_logs(full) if h["step"] > 2] == \
        [h["eval_reward"] for h in eval_logs(resumed) if h["step"] > 2]


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path, tokenizer):
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    trainer = grpo(tmp_path, tokenizer, save_strategy="steps", save_steps=3, max_steps=9, load_best_model_at_end=True,
                   metric_for_best_model="eval_peak", greater_is_better=True, learning_rate=3e-2)
    # a metric that peaks at step 3 (of evaluations at 3, 6, 9): the best checkpoint is not the last one
    trainer.compute_metrics_fn = lambda prompts, completions, **kw: {"peak": -abs(trainer.state.global_step - 3)}
    trainer.add_callback(Snapshot())
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-3")
    assert [h["eval_peak"] for h in eval_logs(trainer)] == [0, -3, -6]
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, snapshots[3][name]), name
    assert any(not torch.equal(p, snapshots[9][n]) for n, p in trainer.model.named_parameters())


def test_best_eval_reward_is_the_one_reloaded(tmp_path, tokenizer):
    trainer = grpo(tmp_path, tokenizer, learning_rate=1e-1, save_strategy="steps", save_steps=3, max_steps=9,
                   load_best_model_at_end=True, metric_for_best_model="eval_reward", eval_do_sample=False)
    assert trainer.args.greater_is_better  # the Trainer's rule for a metric not named *loss
    trainer.train()
    rewards = {h["step"]: h["eval_reward"] for h in eval_logs(trainer)}
    best_step = max(rewards, key=lambda s: (rewards[s], -s))  # the first of equal bests, as the Trainer keeps it
    assert trainer.state.best_metric == rewards[best_step]
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    # greedy evaluation of the reloaded weights gives the best checkpoint's eval reward again
    assert trainer.evaluate()["eval_reward"] == pytest.approx(rewards[best_step])


def test_greedy_evaluation_compute_metrics_and_dict_datasets(tmp_path, tokenizer):
    seen = {}

    def lengths(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return {"mean_chars": sum(len(c) for c in completions) / len(completions)}

    trainer = GRPOTrainer(build_toy_model(tokenizer), has_a_one, processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                          max_completion_length=6, eval_do_sample=False, report_to="none",
                                          per_device_eval_batch_size=2),
                          train_dataset=prompt_dataset(8, seed=0), compute_metrics=lengths)
    rows = prompt_dataset(5, seed=1, split="test")
    first, second = trainer.evaluate(rows), trainer.evaluate(rows)
    assert first["eval_reward"] == second["eval_reward"] and first["eval_mean_chars"] == second["eval_mean_chars"]
    assert len(seen["completions"]) == 5 and seen["prompts"] == list(rows["prompt"])  # one greedy completion each
    assert seen["columns"]["answer"] == list(rows["answer"])  # the rows' columns reach compute_metrics
    assert first["eval_mean_chars"] == pytest.approx(sum(map(len, seen["completions"])) / 5)
    assert "eval_pass@1" not in first  # one completion per prompt: no pass@k
    both = trainer.evaluate({"a": rows, "b": rows})
    assert both["eval_a_reward"] == both["eval_b_reward"] == first["eval_reward"]


def test_pass_at_1_is_the_accuracy_of_a_binary_reward(tmp_path, tokenizer):
    trainer = GRPOTrainer(build_toy_model(tokenizer), has_a_one, processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                          max_completion_length=8, report_to="none", temperature=2.0,
                                          num_generations_eval=8, per_device_eval_batch_size=16),
                          train_dataset=prompt_dataset(8, seed=0))
    metrics = trainer.evaluate(prompt_dataset(6, seed=1, split="test"))
    assert 0 < metrics["eval_pass@1"] < 1
    assert metrics["eval_pass@1"] == pytest.approx(metrics["eval_reward"])
    assert metrics["eval_pass@1"] <= metrics["eval_pass@2"] <= metrics["eval_pass@4"] <= metrics["eval_pass@8"]


def test_ppo_with_a_value_function_evaluates(tmp_path, tokenizer):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, response_length=6, report_to="none",
                max_steps=2, eval_strategy="steps", eval_steps=1, disable_tqdm=True)
    trainer = PPOTrainer(build_toy_model(tokenizer), has_a_one, args=PPOConfig(**args), processing_class=tokenizer,
                         train_dataset=prompt_dataset(8, seed=0), eval_dataset=prompt_dataset(4, seed=1))
    trainer.train()
    evals = eval_logs(trainer)
    assert len(evals) == 2 and "eval_loss" not in evals[0]  # no loss without a group baseline
    assert evals[0]["eval_rewards/reward/mean"] == evals[0]["eval_reward"]
    with pytest.raises(ValueError, match="metric_for_best_model='eval_reward'"):
        PPOTrainer("/no/such/model", has_a_one, args=PPOConfig(**args, load_best_model_at_end=True, save_steps=1),
                   train_dataset=prompt_dataset(8, seed=0), eval_dataset=prompt_dataset(4, seed=1))


def test_bad_eval_rows_are_named_before_any_model_loads(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none")
    rows = [{"prompt": "2+2="}, {"prompt": "  "}]
    with pytest.raises(DataValidationError, match=r"eval_dataset\['hard'\], row 1, field 'prompt'"):
        GRPOTrainer("/no/such/model", has_a_one, args=args, train_dataset=prompt_dataset(8, seed=0),
                    eval_dataset={"easy": [{"prompt": "1+1="}], "hard": rows})
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        GRPOTrainer("/no/such/model", has_a_one, train_dataset=prompt_dataset(8, seed=0),
                    args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                    eval_strategy="steps", report_to="none"))
    with pytest.raises(ValueError, match="per_device_eval_batch_size=6 .* num_generations_eval=4"):
        GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, eval_strategy="steps",
                   per_device_eval_batch_size=6)
