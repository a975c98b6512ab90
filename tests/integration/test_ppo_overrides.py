"""PPOTrainer's override points and its stats through `report_to="tensorboard"`.

- a subclass's `compute_rewards` is called for every rollout with the rows' prompts, completions and other
  columns, and its scores are what PPO trains on (`objective/raw_scores`);
- a `reward_source` assigned after `__init__` is the one the next rollout uses;
- `report_to="tensorboard"` writes event files holding PPO's stats (the `tensorboard` extra).
"""

import glob

import pytest
import torch

from hf_rlhf.toy import build_toy_model
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def make_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_ppo_epochs=1, response_length=6, max_steps=3, logging_steps=1, save_strategy="no",
                    report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True, temperature=1.0)
    defaults.update(kw)
    return PPOConfig(**defaults)


def text_scores(completions) -> torch.Tensor:
    """Scores that differ from row to row and rollout to rollout."""
    return torch.tensor([sum(ord(ch) % 7 for ch in c) / 10.0 + (i % 2) for i, c in enumerate(completions)])


def never_called(prompts, completions, **columns):
    raise AssertionError("the reward given to __init__ must not be called once it is overridden")


class TextRewardPPO(PPOTrainer):
    def __init__(self, *args, **kwargs):
        self.calls = []
        super().__init__(*args, **kwargs)

    def compute_rewards(self, prompts, completions, **columns):
        scores = text_scores(completions)
        self.calls.append({"prompts": list(prompts), "completions": list(completions), "columns": columns,
                           "scores": scores})
        return scores


def test_subclass_compute_rewards_is_what_ppo_trains_on(tmp_path, tokenizer, prompts):
    trainer = TextRewardPPO(build_toy_model(tokenizer), never_called, args=make_args(tmp_path),
                              train_dataset=prompts, processing_class=tokenizer)
    trainer.train()

    assert len(trainer.calls) == 3  # one rollout of 4 prompts per optimizer step
    answers = dict(zip(prompts["prompt"], prompts["answer"]))
    for call in trainer.calls:
        assert len(call["prompts"]) == len(call["completions"]) == 4
        assert all(p in answers for p in call["prompts"])  # the dataset's prompts, as given
        assert all(isinstance(c, str) for c in call["completions"])
        assert call["columns"]["answer"] == [answers[p] for p in call["prompts"]]  # the other columns, row-aligned
    logged = [h["objective/raw_scores"] for h in trainer.state.log_history if "objective/raw_scores" in h]
    expected = [float(call["scores"].mean()) for call in trainer.calls]
    assert logged == pytest.approx(expected, abs=1e-6)
    assert len(set(expected)) > 1  # the check could tell rollouts apart


def test_reward_source_set_after_init_takes_effect(tmp_path, tokenizer, prompts):
    trainer = PPOTrainer(build_toy_model(tokenizer), never_called, args=make_args(tmp_path, max_steps=2),
                         train_dataset=prompts, processing_class=tokenizer)
    seen = []

    def new_source(prompts, completions, **columns):
        seen.append(text_scores(completions))
        return seen[-1]

    trainer.reward_source = new_source
    trainer.train()
    logged = [h["objective/raw_scores"] for h in trainer.state.log_history if "objective/raw_scores" in h]
    assert logged == pytest.approx([float(s.mean()) for s in seen], abs=1e-6) and len(seen) == 2


def test_tensorboard_event_files_hold_ppo_stats(tmp_path, tokenizer, prompts):
    pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install 'hf_rlhf[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging_dir = tmp_path / "out"  # the Trainer writes under output_dir/runs/
    trainer = TextRewardPPO(build_toy_model(tokenizer), never_called,
                              args=make_args(tmp_path, report_to="tensorboard"),
                              train_dataset=prompts, processing_class=tokenizer)
    trainer.train()

    files = glob.glob(str(logging_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, list(logging_dir.rglob("*"))
    scalars = {}
    for path in files:
        events = EventAccumulator(path)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in events.Scalars(tag)]
    history = [h for h in trainer.state.log_history if "objective/kl" in h]
    for name in ("objective/kl", "loss/policy_avg", "objective/raw_scores"):
        tag = "train/" + name
        assert tag in scalars, sorted(scalars)
        assert [step for step, _ in scalars[tag]] == [h["step"] for h in history]
        assert [value for _, value in scalars[tag]] == pytest.approx([h[name] for h in history], rel=1e-6)
