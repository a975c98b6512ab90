"""PPOTrainer with the GRPO options: dynamic sampling (filter_groups) keeps exact resume and fills rollouts with
informative groups; mask_truncated_completions leaves unstopped responses out of the loss; clip-higher and GSPO's
sequence-level ratio train end to end."""

import shutil

import pytest
import torch

from hf_rlhf.rl.critic_free import informative_groups
from hf_rlhf.toy import build_toy_model, prompt_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def has_a_one(prompts, completions, **kwargs):
    """A binary reward: many groups of the random policy's samples score all 0 (dynamic sampling drops those)."""
    return [float("1" in c) for c in completions]


def step_logs(trainer, after: int = 0) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h and h["step"] > after}


def count_generate(model, counter: list):
    original = model.generate

    def generate(*args, **kwargs):
        counter.append(1)
        return original(*args, **kwargs)

    model.generate = generate
    return model


def _trainer(output_dir, tokenizer, counter, **kw):
    # rollouts of 8 rows = 2 prompts x 4 samples, 4 micro-batches of 2, one optimizer step each: 4 steps per rollout
    options = dict(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                   rollout_batch_size=8, num_ppo_epochs=1, response_length=6, max_steps=12, logging_steps=1,
                   save_strategy="steps", save_steps=2, report_to="none", learning_rate=3e-3, seed=0,
                   disable_tqdm=True, temperature=1.0, advantage_estimator="grpo", num_generations=4,
                   reward_normalization="running", filter_groups=True, max_num_gen_batches=4, epsilon_high=0.28,
                   importance_sampling_level="sequence", loss_type="grpo", kl_in_loss=True, kl_estimator="k3")
    options.update(kw)
    policy = count_generate(build_toy_model(tokenizer), counter)
    return PPOTrainer(policy, has_a_one, args=PPOConfig(**options), train_dataset=prompt_dataset(16, seed=0),
                      processing_class=tokenizer)


# 4 optimizer steps per rollout (12 steps, 3 rollouts), or one (3 steps, 3 rollouts: the loss's forward gives the old
# log-probs, `old_logprobs_in_loss`, with a fixed beta); {checkpoint: first step of each later rollout}
RESUME_CASES = {
    "four_steps": (dict(), 12, {4: (5, 9), 6: (9,)}),
    "one_step": (dict(gradient_accumulation_steps=4, max_steps=3, save_steps=1), 3, {1: (2, 3)}),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_dynamic_sampling_resumes_exactly(tmp_path, tokenizer, case):
    options, steps, checkpoints = RESUME_CASES[case]
    calls = []
    full = _trainer(tmp_path / "full", tokenizer, calls, **options)
    assert full.args.old_logprobs_in_loss == (case == "one_step")
    full.train()
    reference = step_logs(full)
    assert sorted(reference) == list(range(1, steps + 1))
    firsts = range(1, steps + 1, steps // 3)
    assert len(calls) == sum(reference[s]["filter/gen_batches"] for s in firsts) > 3  # refilled: a call per round
    assert sum(reference[s]["filter/dropped_groups"] for s in firsts) > 0
    for step, later in checkpoints.items():  # at a rollout boundary; mid-rollout
        run_dir = tmp_path / f"resume-{step}"
        shutil.copytree(tmp_path / "full" / f"checkpoint-{step}", run_dir / f"checkpoint-{step}")
        calls.clear()
        resumed = _trainer(run_dir, tokenizer, calls, **options)
        resumed.train(resume_from_checkpoint=True)
        logs = step_logs(resumed, after=step)
        assert sorted(logs) == list(range(step + 1, steps + 1))
        for s, log in logs.items():
            assert log == reference[s], f"resumed from checkpoint-{step}, step {s}"
        assert len(calls) == sum(reference[s]["filter/gen_batches"] for s in later)


def test_dynamic_sampling_keeps_informative_groups_first(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, [], max_num_gen_batches=8, reward_normalization="none",
                       missing_eos_penalty=None)
    loader = trainer.get_train_dataloader()
    seen = {}

    def make(rows, indices, refill=None):
        experience, stats = trainer._make_experience(rows, indices, refill)
        seen.update(experience=experience, stats=stats)
        return experience, stats

    loader.make_experience = make
    next(iter(loader))
    experience, stats = seen["experience"], seen["stats"]
    assert experience.scores.shape == (8,)
    kept = informative_groups(experience.scores, 4)
    if stats["filter/refilled_with_dropped"] == 0:  # filled with informative groups only
        assert kept.all()
    else:  # informative groups first, dropped ones only completing the rollout
        n = int(kept.sum())
        assert kept[:n].all() and not kept[n:].any()
    # the refill prompts are a pure function of (seed, epoch, rollout, rank, round)
    assert loader.refill_indices(0, 0, 1) == loader.refill_indices(0, 0, 1) != loader.refill_indices(0, 0, 2)


def test_mask_truncated_completions_leaves_unstopped_rows_out(tmp_path, tokenizer):
    # token 92, frequent in the random policy's samples, as the stop token: emitted within 30 tokens on some rows only
    stop = 92
    common = dict(filter_groups=False, max_steps=1, save_strategy="no", stop_token_id=stop, response_length=30,
                  importance_sampling_level="token")
    runs = {}
    for masked in (False, True):
        trainer = _trainer(tmp_path / str(masked), tokenizer, [], mask_truncated_completions=masked, **common)
        loader = trainer.get_train_dataloader()
        next(iter(loader))
        runs[masked] = loader._rollout["experience"]
    plain, masked = runs[False], runs[True]
    assert torch.equal(plain.response_ids, masked.response_ids)  # the same samples
    stopped = (plain.response_ids == stop).any(dim=1)
    assert 0 < int(stopped.sum()) < len(stopped)
    assert torch.equal(masked.response_mask[stopped], plain.response_mask[stopped])
    assert masked.response_mask[~stopped].sum() == 0
    # the group baselines still counted the truncated rows (TRL's order): the same advantages on kept rows
    torch.testing.assert_close(masked.advantages[stopped], plain.advantages[stopped])
    with pytest.raises(ValueError, match="mask_truncated_completions needs a stop token"):
        trainer = _trainer(tmp_path / "none", tokenizer, [], mask_truncated_completions=True, stop_token=None,
                           **{k: v for k, v in common.items() if k != "stop_token_id"})
        next(iter(trainer.get_train_dataloader()))
