"""Drop-in check for GRPO with tools (issue 21): one TRL tool script runs through `trl.GRPOTrainer` 1.16 and through
`hf_rlhf.GRPOTrainer`, only the import changed.

The script is what TRL's docs show ("Agent Training" > "Tools"): a tool function with type hints and a Google-style
docstring, reward functions in `reward_funcs=[...]` reading a dataset column, conversational prompts, `GRPOConfig`
and `GRPOTrainer(model=<path>, reward_funcs=..., args=..., train_dataset=..., tools=[...])`, then `train()`.

The model is the toy Llama and the toy tool tokenizer (`hf_rlhf.toy.build_toy_tool_tokenizer`: a chat template
that renders tools, tool calls and tool results, and the `response_template` that transformers' `parse_response`
reads the calls with; TRL takes a tokenizer's own response template as it is). A random tiny model never writes a
tool call, so the fixture first teaches it one (teacher forcing on 32 demonstrations, ~20 s): sampled at
temperature 1 it then calls `add` in most completions, with arguments that are often wrong.

Asserted on both sides: the run trains (the policy's weights change), tool calls were made and parsed (the tool
ran, its results are `tool` messages in the completions the reward functions receive, `tools/call_frequency` > 0),
and every metric name a TRL user reads in the train logs is logged by hf_rlhf too (`TRL_ONLY` is empty; the names
only hf_rlhf logs are PPOTrainer's own, `HF_RLHF_ONLY`). Losses are not compared: the two libraries sample with
different random streams. What differs is listed in docs/grpo.md ("GRPOTrainer: a drop-in for trl.GRPOTrainer").
"""

import random

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import set_seed

pytestmark = pytest.mark.integration

trl = pytest.importorskip("trl")
import hf_rlhf  # noqa: E402
from hf_rlhf.toy import build_toy_model, build_toy_tool_tokenizer  # noqa: E402

LIBRARIES = (trl, hf_rlhf)
# logged by hf_rlhf only: PPOTrainer's names for its rollout and loss statistics
HF_RLHF_ONLY = {"loss/policy_avg", "objective/entropy", "objective/kl_coef", "objective/raw_scores",
                "objective/rlhf_reward", "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg",
                "policy/entropy_avg", "policy_loss", "val/num_eos_tokens", "val/ratio"}  # TRL: policy_loss with a bonus
TOOL_RUNS = []  # (library name, a, b) of every call of the tool


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


# ---------------------------------------------------------------------------------------------------
# the script, written once as a TRL user writes it; `lib` is trl or hf_rlhf


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    TOOL_RUNS.append((CURRENT[0], a, b))
    return a + b


CURRENT = ["trl"]


def correct_sum(prompts, completions, answer, **kwargs):
    """1 when the last assistant message is the sum."""
    return [float(completion[-1]["content"].strip() == expected) for completion, expected in zip(completions, answer)]


def right_arguments(prompts, completions, **kwargs):
    """The share of the call's arguments that are the prompt's numbers (0 without a call)."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        numbers = [int(x) for x in prompt[-1]["content"].rstrip("=").split("+")]
        calls = [call for message in completion for call in message.get("tool_calls") or []]
        arguments = calls[0]["function"]["arguments"] if calls else {}
        scores.append(sum(arguments.get(key) == n for key, n in zip("ab", numbers)) / 2)
    return scores


def prompts(n: int = 16, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def grpo_tool_script(lib, model_path, output_dir, seen):
    random.seed(0)
    np.random.seed(0)
    set_seed(0)
    CURRENT[0] = lib.__name__

    def spy(prompts, completions, **kwargs):  # what a reward function receives, to assert on
        seen.extend(completions)
        return [0.0] * len(completions)

    args = lib.GRPOConfig(output_dir=output_dir, num_generations=4, per_device_train_batch_size=8,
                          max_completion_length=96, max_steps=3, logging_steps=1, learning_rate=1e-3, seed=0,
                          report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                          gradient_checkpointing=False, disable_tqdm=True)
    trainer = lib.GRPOTrainer(model=model_path, reward_funcs=[correct_sum, right_arguments, spy], args=args,
                              train_dataset=prompts(), tools=[add])
    initial = {name: p.detach().clone() for name, p in policy_of(trainer).named_parameters()}
    trainer.train()
    changed = [name for name, p in policy_of(trainer).named_parameters() if not torch.equal(p.detach(), initial[name])]
    return trainer.state.log_history, changed


def policy_of(trainer):
    return getattr(trainer.model, "policy", trainer.model)  # hf_rlhf's module holds the policy (and a value head)


# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """The toy Llama taught to answer "a+b=" with a call of `add`, then the result; saved with its tokenizer."""
    tokenizer = build_toy_tool_tokenizer()
    rng = random.Random(1)
    rows = []
    for _ in range(32):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        rows.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "name": "add", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}],
            tools=[add], return_dict=False))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    model = build_toy_model(tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    torch.manual_seed(0)
    for _ in range(150):
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = str(tmp_path_factory.mktemp("tool_caller"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)  # the response template is saved with it
    return path


def test_tool_script_runs_through_both_with_only_the_import_changed(tmp_path, tool_caller):
    logs, seen = {}, {}
    TOOL_RUNS.clear()
    for lib in LIBRARIES:
        seen[lib] = []
        history, changed = grpo_tool_script(lib, tool_caller, str(tmp_path / lib.__name__), seen[lib])
        logs[lib] = [h for h in history if "loss" in h]
        assert len(logs[lib]) == 3, lib.__name__
        assert changed, f"{lib.__name__}: no parameter changed"
        # tool calls were made, parsed and answered: the tool ran, and its result is a tool message
        assert any(run[0] == lib.__name__ for run in TOOL_RUNS), lib.__name__
        with_tool = [c for c in seen[lib] if any(m["role"] == "tool" for m in c)]
        assert with_tool and all(c[0]["tool_calls"][0]["function"]["name"] == "add" for c in with_tool)
        assert all(h["tools/call_frequency"] > 0 for h in logs[lib]), lib.__name__

    theirs, ours = (set().union(*map(set, logs[lib])) for lib in LIBRARIES)
    trl_only, ours_only = theirs - ours, ours - theirs
    print("trl losses:", [h["loss"] for h in logs[trl]], "hf_rlhf losses:", [h["loss"] for h in logs[hf_rlhf]])
    print("tool calls per completion (trl, hf_rlhf):",
          [[h["tools/call_frequency"] for h in logs[lib]] for lib in LIBRARIES])
    print("metric names only trl logs:", sorted(trl_only), "only hf_rlhf:", sorted(ours_only))
    assert not trl_only, sorted(trl_only)
    assert ours_only == HF_RLHF_ONLY, sorted(ours_only)
    for name in ("reward", "reward_std", "rewards/correct_sum/mean", "rewards/right_arguments/mean",
                 "completions/mean_length", "entropy", "clip_ratio/region_mean", "num_tokens", "step_time"):
        assert all(name in h for lib in LIBRARIES for h in logs[lib]), name
