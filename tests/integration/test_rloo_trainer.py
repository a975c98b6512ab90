"""RLOOTrainer as trl 1.16's: trains with TRL's metric names (`kl` the token mean of the rollout's k1), its KL in the
reward and `reward_clip_range`; exact resume mid-generation; evaluation; bad rows named before any model loads."""

import shutil

import pytest
import torch

from hf_rlhf import RLOOConfig, RLOOTrainer
from hf_rlhf.data.validation import DataValidationError
from hf_rlhf.toy import build_toy_model, prompt_dataset

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def digits(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / 2 for c in completions]


def rloo(tmp_path, tokenizer, name="run", **kw):
    # 2 prompts x 2 completions per micro-batch; 2 micro-batches a generation, 2 iterations: 4 steps per generation
    options = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, steps_per_generation=2,
                   num_iterations=2, max_completion_length=6, max_steps=8, logging_steps=1, report_to="none",
                   learning_rate=1e-2, disable_tqdm=True, save_strategy="steps", save_steps=3, seed=0)
    options.update(kw)
    return RLOOTrainer(build_toy_model(tokenizer), digits, args=RLOOConfig(**options),
                       train_dataset=prompt_dataset(16, seed=0), processing_class=tokenizer)


def train_logs(trainer):
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def test_rloo_trains_with_trls_metrics_and_resumes_exactly(tmp_path, tokenizer):
    full = rloo(tmp_path, tokenizer, "full")
    before = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    full.train()
    assert any(not torch.equal(before[n], p) for n, p in full.model.named_parameters())
    logs = train_logs(full)
    for name in ("reward", "reward_std", "rewards/digits/mean", "rewards/digits/std", "frac_reward_zero_std", "kl",
                 "entropy", "clip_ratio/low_mean", "clip_ratio/high_max", "completions/mean_length", "num_tokens"):
        assert name in logs[1], name
    assert abs(logs[1]["kl"]) < 1e-6 < abs(logs[5]["kl"])  # the reference is the initial policy
    # step 3 is mid-generation (4 steps each): the resumed run regenerates nothing and continues exactly
    shutil.copytree(tmp_path / "full" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    resumed = rloo(tmp_path, tokenizer, "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    assert {s: h["loss"] for s, h in logs.items() if s > 3} == \
        {s: h["loss"] for s, h in train_logs(resumed).items() if s > 3}
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_kl_in_the_reward_and_reward_clip_range(tmp_path, tokenizer):
    trainer = rloo(tmp_path, tokenizer, max_steps=5, reward_clip_range=(0.0, 0.5), beta=0.5, save_strategy="no")
    trainer.train()
    logs = train_logs(trainer)
    # after the first generation the policy moved: the rollout's k1 KL (the token mean TRL logs) is in the reward,
    # rlhf_reward = clipped score - β · Σ k1 (sequence means)
    later = logs[5]
    assert later["objective/scores"] <= 0.5  # clamped before the KL penalty
    assert later["reward"] >= later["objective/scores"]  # the logged reward is TRL's unclamped one
    assert later["objective/rlhf_reward"] == pytest.approx(
        later["objective/scores"] - 0.5 * later["objective/kl"], abs=1e-5)


def test_evaluation_and_bad_rows(tmp_path, tokenizer):
    args = RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=6,
                      report_to="none", per_device_eval_batch_size=4)
    with pytest.raises(DataValidationError, match="eval_dataset, row 1, field 'prompt'"):
        RLOOTrainer("/no/such/model", digits, args=args, train_dataset=prompt_dataset(8, seed=0),
                    eval_dataset=[{"prompt": "1+1="}, {"prompt": ""}])
    with pytest.raises(DataValidationError, match="row 0"):
        RLOOTrainer("/no/such/model", digits, args=args, train_dataset=[{"prompt": None}])
    trainer = RLOOTrainer(build_toy_model(tokenizer), digits, args=args, train_dataset=prompt_dataset(8, seed=0),
                          processing_class=tokenizer)
    metrics = trainer.evaluate(prompt_dataset(4, seed=1, split="test"))
    assert {"eval_reward", "eval_rewards/digits/mean", "eval_loss", "eval_pass@1", "eval_pass@2"} <= set(metrics)


def test_trls_parameters_in_trls_order():
    import inspect

    import trl

    theirs = list(inspect.signature(trl.RLOOTrainer.__init__).parameters)
    ours = list(inspect.signature(RLOOTrainer.__init__).parameters)
    assert ours[:len(theirs)] == theirs and ours[len(theirs):] == ["kwargs"]


def test_train_dataset_is_required_as_in_trl(tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):  # TRL's message, before any model loads
        RLOOTrainer("/no/such/model", digits, args=RLOOConfig(output_dir=str(tmp_path), report_to="none"))


def test_unscored_rows_warn_and_train_on_the_scored_ones(tmp_path, tokenizer, caplog):
    # as TRL's RLOO: a row every reward function returned None for is warned about, left out of its siblings'
    # baselines and given advantage 0; the scored rows still train
    def odd_rows_only(prompts, completions, **kwargs):
        return [None if i % 2 == 0 else float(sum(map(ord, c)) % 7) for i, c in enumerate(completions)]

    def nothing(prompts, completions, **kwargs):
        return [None] * len(completions)

    args = RLOOConfig(output_dir=str(tmp_path / "none"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to="none", learning_rate=1e-2, disable_tqdm=True,
                      save_strategy="no", seed=0)
    trainer = RLOOTrainer(build_toy_model(tokenizer), nothing, args=args, train_dataset=prompt_dataset(8, seed=0),
                          processing_class=tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # no advantage anywhere

    args.output_dir = str(tmp_path / "half")
    trainer = RLOOTrainer(build_toy_model(tokenizer), odd_rows_only, args=args,
                          train_dataset=prompt_dataset(8, seed=0), processing_class=tokenizer)
    rollouts = []
    make = trainer._make_experience
    trainer._make_experience = lambda *a, **k: rollouts.append(make(*a, **k)) or rollouts[-1]
    trainer.train()
    advantages = rollouts[0][0].advantages[:, 0]  # (B,) the sequence advantage on each row's first token
    assert advantages[0::2].eq(0).all() and advantages[1::2].ne(0).any()
