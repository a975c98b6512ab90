"""A toy task that needs a tool (issue 21): adding numbers too long for a tiny model, with a calculator.

A prompt is "a+b=" with `digits`-digit numbers; the policy is meant to call `add(a, b)` and copy the result::

    <|bos|><|system|>tools: add<|user|>48213+90577=<|assistant|><tool_call>{"name": "add", "arguments":
    {"a": 48213, "b": 90577}}</tool_call><|eos|><|user|>result: 138790<|assistant|>138790<|eos|>

(`hf_rlhf.toy.build_toy_tool_tokenizer`'s template.) `tool_sft_dataset` gives such conversations as SFT rows (the
tool schema in a `tools` column, as TRL's conversational rows carry it), `tool_prompt_dataset` the prompts for RL,
`tool_reward` the exact match of the final answer, and `tool_exact_match` the greedy exact match of a policy that
may call the tool (the rollout's own turn loop, greedy).
"""

from __future__ import annotations

import json
import random

import torch

from ..ppo.multiturn import ToolRollout
from ..tools import ToolRunner, tool_dict


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return int(a) + int(b)


def _numbers(rng: random.Random, digits: int) -> tuple[int, int]:
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def tool_prompt_dataset(n: int, seed: int = 0, digits: int = 5):
    """n rows {"prompt": [user message "a+b="], "answer": str(a + b)} (a `datasets.Dataset`)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _numbers(rng, digits)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def tool_sft_dataset(n: int, seed: int = 0, digits: int = 5):
    """n demonstrations {"messages": [user, assistant calling add, tool result, assistant answer], "tools": JSON}."""
    from datasets import Dataset
    from transformers.utils import get_json_schema

    schema = json.dumps([get_json_schema(add)])
    rows = []
    for row in tool_prompt_dataset(n, seed, digits):
        a, b = (int(x) for x in row["prompt"][0]["content"].rstrip("=").split("+"))
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        messages = row["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "name": "add", "content": str(add(a, b))},
                                    {"role": "assistant", "content": row["answer"]}]
        rows.append({"messages": messages, "tools": schema})
    return Dataset.from_list(rows)


def final_answer(completion) -> str:
    """The content of a completion's last assistant message (or the completion itself, as text)."""
    if isinstance(completion, str):
        return completion.strip()
    answers = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return answers[-1].strip() if answers else ""


def tool_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """1.0 when the final answer is the sum, else 0.0 (`answer`: the dataset column; else read from the prompt)."""
    if answer is None:
        answer = [str(add(*(int(x) for x in p[-1]["content"].rstrip("=").split("+")))) for p in prompts]
    return [float(final_answer(c) == a) for c, a in zip(completions, answer)]


@torch.no_grad()
def tool_exact_match(model, tokenizer, rows, tools=(add,), max_tool_calling_iterations: int | None = 2,
                     response_length: int = 120, batch_size: int = 16) -> dict[str, float]:
    """Greedy exact match of `model` on prompt rows (with their `answer`), calling `tools` as a rollout would.

    Returns:
        {"exact_match", "tool_calls_per_completion", "tool_error_rate"}.
    """
    rows = list(rows)
    model.eval()
    loop = ToolRollout(tokenizer, tokenizer.eos_token_id, response_length, max_tool_calling_iterations,
                       ToolRunner(max_workers=4, timeout=10))
    device = next(model.parameters()).device
    correct, calls, failures = 0, 0, 0

    def generate(ids, mask, max_new_tokens):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return out[:, ids.shape[1]:]

    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(r["prompt"], tools=list(tools) or None, add_generation_prompt=True,
                                                 return_dict=False) for r in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sample = loop.run(generate, ids, mask, [tool_dict(tools)] * len(chunk))
        correct += sum(tool_reward([r["prompt"] for r in chunk], sample.completions, [r["answer"] for r in chunk]))
        calls, failures = calls + sum(sample.tool_calls), failures + sum(sample.tool_failures)
    loop.runner.close()
    return {"exact_match": correct / max(len(rows), 1), "tool_calls_per_completion": calls / max(len(rows), 1),
            "tool_error_rate": failures / calls if calls else 0.0}
