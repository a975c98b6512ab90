"""Greedy batched generation and the recipes' generic held-out evaluation."""

import pytest
import torch
from datasets import Dataset

from hf_rlhf.cli.evaluation import evaluate_completions
from hf_rlhf.generation import generate_completions
from hf_rlhf.toy import make_tasks, prompt_dataset, reward_fn
from hf_rlhf.toy.chain import check_answers


def test_generate_completions_batched_equals_one_at_a_time(tokenizer, tiny_model):
    prompts = [r["prompt"] for r in make_tasks(6, seed=5, split="test")]
    batched = generate_completions(tiny_model, tokenizer, prompts, max_new_tokens=6, batch_size=6)
    single = [generate_completions(tiny_model, tokenizer, [p], max_new_tokens=6, batch_size=1)[0] for p in prompts]
    assert batched == single
    assert tokenizer.padding_side == "right" and not any("<|" in c for c in batched)
    conv = [[{"role": "user", "content": p}] for p in prompts[:3]]
    conv_batched = generate_completions(tiny_model, tokenizer, conv, max_new_tokens=4, batch_size=3)
    assert conv_batched == [generate_completions(tiny_model, tokenizer, [c], 4, 1)[0] for c in conv]



def verifiable(prompts, completions, answer):
    """A 0/1 reward (the toy ground truth) with a PPO reward source's signature."""
    return torch.tensor(reward_fn(prompts, completions, answer))


def test_evaluation_of_a_verifiable_reward_reports_exact_match(tokenizer, tiny_model):
    rows = prompt_dataset(12, seed=1, split="test")
    completions = generate_completions(tiny_model, tokenizer, list(rows["prompt"]), 6, 12)
    expected = sum(reward_fn(list(rows["prompt"]), completions, list(rows["answer"]))) / 12
    out = evaluate_completions(tiny_model, tokenizer, rows, verifiable, 6, 5)
    assert out == {"score": pytest.approx(expected), "exact_match": pytest.approx(expected)}


def test_evaluation_of_a_continuous_reward_reports_the_mean_score_only(tokenizer, tiny_model):
    rows = Dataset.from_dict({"prompt": ["1+2=", "3+4=", "sort cba="], "weight": [0.5, 1.5, 2.0]})
    seen = {}

    def length_reward(prompts, completions, weight):
        seen["weight"] = weight  # the dataset's other columns arrive by name
        return torch.tensor([w * (len(c) + 0.5) for c, w in zip(completions, weight)])

    completions = generate_completions(tiny_model, tokenizer, list(rows["prompt"]), 4)
    out = evaluate_completions(tiny_model, tokenizer, rows, length_reward, 4, 2)
    assert out == {"score": pytest.approx(sum(w * (len(c) + 0.5) for c, w in zip(completions, rows["weight"])) / 3)}
    assert seen["weight"] == [0.5, 1.5, 2.0]


def test_evaluation_with_a_check_reports_its_metrics(tokenizer, tiny_model):
    """The toy task checks the ground truth whatever the training reward (here a constant)."""
    rows = prompt_dataset(8, seed=2, split="test")
    completions = generate_completions(tiny_model, tokenizer, list(rows["prompt"]), 6)
    out = evaluate_completions(tiny_model, tokenizer, rows, lambda p, c, **kw: torch.full((len(c),), 0.25), 6, 8,
                               check=check_answers)
    assert out == {"score": 0.25, **check_answers(list(rows["prompt"]), completions, rows)}
