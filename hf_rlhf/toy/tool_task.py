"""A toy task that needs a tool (issue 21): arithmetic a tiny model cannot do by itself, with a calculator.

A prompt is "a+b=" (operation "add") or "a*b=" ("multiply") with `digits`-digit numbers; the policy is meant to
call the operation's tool and copy its result::

    <|bos|><|system|>tools: multiply<|user|>482*905=<|assistant|><tool_call>{"name": "multiply", "arguments":
    {"a": 482, "b": 905}}</tool_call><|eos|><|user|>result: 436210<|assistant|>436210<|eos|>

(`hf_rlhf.toy.build_toy_tool_tokenizer`'s template.) `tool_sft_dataset` gives such conversations as SFT rows (the
tool schema in a `tools` column, as TRL's conversational rows carry it); its demonstrator calls the tool on a share
`tool_rate` of the problems and writes the answer directly on the others, so SFT leaves the policy calling the tool
on part of the prompts only: the headroom RL with the tool works in. `tool_prompt_dataset` gives the prompts for RL,
`tool_reward` the exact match of the final answer, and `tool_exact_match` the greedy exact match of a policy that
may call the tool (the rollout's own turn loop, greedy).
"""

from __future__ import annotations

import json
import math
import random

from ..rollout.multiturn import greedy_tool_completions


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return int(a) + int(b)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return int(a) * int(b)


# the held-out prompts of the recipes are drawn with toy_seed + this (the SFT demonstrations with toy_seed)
TEST_SEED_OFFSET = 1_000_003

# operation -> (the sign in the prompt, the tool that computes it)
OPERATIONS = {"add": ("+", add), "multiply": ("*", multiply)}


def operation_tool(operation: str):
    """The tool of `operation` ("add" or "multiply")."""
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {sorted(OPERATIONS)}, got {operation!r}")
    return OPERATIONS[operation][1]


def _numbers(rng: random.Random, digits: int, operation: str = "add") -> tuple[int, int]:
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    if operation == "multiply":
        # operands >= sqrt(10^(2 digits - 1)): every product has 2 x digits digits, a result of one length that the
        # tiny model copies into its answer at one offset
        low = math.isqrt(10 ** (2 * digits - 1) - 1) + 1
    return rng.randint(low, high), rng.randint(low, high)


def _operands(prompt: str) -> tuple[str, int, int]:
    """(operation, a, b) of a prompt "a+b=" / "a*b="."""
    text = prompt.strip().rstrip("=")
    for operation, (sign, _) in OPERATIONS.items():
        if sign in text:
            a, b = text.split(sign)
            return operation, int(a), int(b)
    raise ValueError(f"not a toy tool prompt: {prompt!r}")


def tool_prompt_dataset(n: int, seed: int = 0, digits: int = 5, operation: str = "add"):
    """n rows {"prompt": [user message "a+b=" / "a*b="], "answer": str(result)} (a `datasets.Dataset`); the
    operands have `digits` digits (for "multiply", at least sqrt(10^(2 digits - 1)): products of 2 x digits digits)."""
    from datasets import Dataset

    sign, tool = OPERATIONS[operation][0], operation_tool(operation)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _numbers(rng, digits, operation)
        rows.append({"prompt": [{"role": "user", "content": f"{a}{sign}{b}="}], "answer": str(tool(a, b))})
    return Dataset.from_list(rows)


def tool_sft_dataset(n: int, seed: int = 0, digits: int = 5, operation: str = "add", tool_rate: float = 1.0):
    """n demonstrations {"messages": [...], "tools": JSON}, every one rendered with the operation's tool available.

    Args:
        tool_rate: the share of demonstrations that call the tool ([user, assistant calling it, tool result,
            assistant answer]); the others answer at once ([user, assistant answer]), as a demonstrator who works
            some problems out in their head. Which ones is drawn with its own seeded stream, so the problems are the
            same for every rate.
    """
    from datasets import Dataset
    from transformers.utils import get_json_schema

    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate must be in [0, 1], got {tool_rate}")
    tool = operation_tool(operation)
    schema = json.dumps([get_json_schema(tool)])
    uses_tool = random.Random(seed + 7919)
    rows = []
    for row in tool_prompt_dataset(n, seed, digits, operation):
        _, a, b = _operands(row["prompt"][0]["content"])
        answer = {"role": "assistant", "content": row["answer"]}
        if uses_tool.random() < tool_rate:
            call = {"type": "function", "function": {"name": tool.__name__, "arguments": {"a": a, "b": b}}}
            messages = row["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "tool", "name": tool.__name__, "content": str(tool(a, b))}, answer]
        else:
            messages = row["prompt"] + [answer]
        rows.append({"messages": messages, "tools": schema})
    return Dataset.from_list(rows)


def final_answer(completion) -> str:
    """The content of a completion's last assistant message (or the completion itself, as text)."""
    if isinstance(completion, str):
        return completion.strip()
    answers = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return answers[-1].strip() if answers else ""


def tool_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """1.0 when the final answer is the result, else 0.0 (`answer`: the dataset column; else read from the prompt)."""
    if answer is None:
        answer = []
        for prompt in prompts:
            operation, a, b = _operands(prompt[-1]["content"] if isinstance(prompt, list) else prompt)
            answer.append(str(operation_tool(operation)(a, b)))
    return [float(final_answer(c) == a) for c, a in zip(completions, answer)]


def tool_exact_match(model, tokenizer, rows, tools=(add,), max_tool_calling_iterations: int | None = 2,
                     response_length: int = 120, batch_size: int = 16) -> dict[str, float]:
    """Greedy exact match of `model` on prompt rows (with their `answer`), calling `tools` as a rollout would.

    Args:
        tools: the tools the prompts are rendered with and the calls run; empty: no tools (prompts rendered without
            them, a call the policy writes anyway is not run and its turn is the answer).

    Returns:
        {"exact_match", "tool_calls_per_completion", "tool_error_rate"}.
    """
    rows = list(rows)
    prompts = [r["prompt"] for r in rows]
    out = greedy_tool_completions(model, tokenizer, prompts, list(tools), response_length,
                                  max_tool_calling_iterations, batch_size, timeout=10, max_workers=4)
    correct = tool_reward(prompts, out.completions, [r["answer"] for r in rows])
    return {"exact_match": sum(correct) / max(len(rows), 1), **out.summary()}


def check_tool_answers(prompts: list, completions: list, rows) -> dict:
    """The recipes' ground-truth check of the tool task: {"exact_match": share of right final answers}."""
    correct = tool_reward(prompts, completions, list(rows["answer"]))
    return {"exact_match": sum(correct) / max(len(correct), 1)}
