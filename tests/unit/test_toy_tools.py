"""The toy tool task (issue 21): its SFT demonstrations are token for token what a rollout with the calculator
produces, its reward checks the final answer, and the greedy evaluation runs the rollout's turn loop."""

import torch

from hf_rlhf.tools import tool_suffix_ids
from hf_rlhf.toy import (
    build_toy_model,
    build_toy_tool_tokenizer,
    tool_exact_match,
    tool_prompt_dataset,
    tool_reward,
    tool_sft_dataset,
)
from hf_rlhf.toy.tool_task import add


def test_demonstrations_are_what_a_rollout_produces():
    tokenizer = build_toy_tool_tokenizer()
    demo = tool_sft_dataset(3, seed=1, digits=6)[2]
    prompt_row = tool_prompt_dataset(3, seed=1, digits=6)[2]
    assert demo["messages"][0]["content"] == prompt_row["prompt"][0]["content"]
    assert demo["messages"][-1]["content"] == prompt_row["answer"]
    from hf_rlhf.data.chatml import chat_template_row_kwargs

    full = tokenizer.apply_chat_template(demo["messages"], return_dict=False, **chat_template_row_kwargs(demo))
    prompt = tokenizer.apply_chat_template(prompt_row["prompt"], tools=[add], add_generation_prompt=True,
                                           return_dict=False)
    a, b = (int(x) for x in prompt_row["prompt"][0]["content"].rstrip("=").split("+"))
    call = tokenizer(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|eos|>',
                     add_special_tokens=False)["input_ids"]
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": str(a + b)}])
    answer = tokenizer(prompt_row["answer"] + "<|eos|>", add_special_tokens=False)["input_ids"]
    assert full == prompt + call + suffix + answer


def test_reward_reads_the_final_answer():
    prompts = [[{"role": "user", "content": "12345+1="}]] * 3
    completions = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": "12346"},
                    {"role": "assistant", "content": "12346"}],
                   [{"role": "assistant", "content": "12345"}], [{"role": "tool", "content": "12346"}]]
    assert tool_reward(prompts, completions) == [1.0, 0.0, 0.0]
    assert tool_reward(prompts[:1], completions[:1], answer=["7"]) == [0.0]


def test_greedy_tool_evaluation_runs_the_turn_loop(one_thread):
    tokenizer = build_toy_tool_tokenizer()
    model = build_toy_model(tokenizer, seed=0)
    rows = list(tool_prompt_dataset(4, seed=0))
    result = tool_exact_match(model, tokenizer, rows, response_length=24, batch_size=2)
    assert result == {"exact_match": 0.0, "tool_calls_per_completion": 0.0, "tool_error_rate": 0.0}  # random weights
    torch.manual_seed(0)


class Oracle(torch.nn.Module):
    """A 'model' whose greedy turns are the right call, then the tool's result copied (or a wrong digit)."""

    def __init__(self, tokenizer, slip=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.slip = tokenizer, slip

    @property
    def device(self):
        return self.weight.device

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            text = self.tokenizer.decode(ids[mask.bool()])
            if "result: " in text:
                answer = text.rsplit("result: ", 1)[1].split("<|")[0]
                turn = (answer[:-1] + str((int(answer[-1]) + 1) % 10) if self.slip else answer) + "<|eos|>"
            else:
                a, b = text.rsplit("<|user|>", 1)[1].split("=")[0].split("+")
                turn = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|eos|>'
            rows.append(self.tokenizer(turn, add_special_tokens=False)["input_ids"][:max_new_tokens])
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_greedy_evaluation_scores_a_policy_that_uses_the_tool():
    tokenizer = build_toy_tool_tokenizer()
    rows = list(tool_prompt_dataset(5, seed=3, digits=7))
    good = tool_exact_match(Oracle(tokenizer), tokenizer, rows, batch_size=2)
    assert good == {"exact_match": 1.0, "tool_calls_per_completion": 1.0, "tool_error_rate": 0.0}
    assert tool_exact_match(Oracle(tokenizer, slip=True), tokenizer, rows)["exact_match"] == 0.0


def test_demonstrator_calls_the_tool_at_its_rate_on_the_same_problems():
    every = tool_sft_dataset(400, seed=2, digits=3, operation="multiply", tool_rate=1.0)
    some = tool_sft_dataset(400, seed=2, digits=3, operation="multiply", tool_rate=0.25)
    assert [r["messages"][0]["content"] for r in every] == [r["messages"][0]["content"] for r in some]
    called = [any(m.get("tool_calls") for m in r["messages"]) for r in some]
    assert 0.18 < sum(called) / len(called) < 0.32
    for row, uses_tool in zip(some, called):
        a, b = (int(x) for x in row["messages"][0]["content"].rstrip("=").split("*"))
        assert row["messages"][-1] == {**row["messages"][-1], "role": "assistant", "content": str(a * b)}
        assert len(row["messages"]) == (4 if uses_tool else 2)
    assert all(any(m.get("tool_calls") for m in r["messages"]) for r in every)


def test_reward_reads_multiplication_prompts():
    prompts = [[{"role": "user", "content": "123*45="}]] * 2
    completions = [[{"role": "assistant", "content": "5535"}], [{"role": "assistant", "content": "168"}]]
    assert tool_reward(prompts, completions) == [1.0, 0.0]


def test_recipe_evaluation_calls_the_run_tools():
    """The PPO recipe's held-out evaluation with tools runs the turn loop: a policy that calls the tool scores, and
    the tool calls are counted; without tools its call is not run and scores nothing."""
    from datasets import Dataset

    from hf_rlhf.cli.evaluation import evaluate_completions

    tokenizer = build_toy_tool_tokenizer()
    rows = Dataset.from_list(list(tool_prompt_dataset(4, seed=5, digits=4)))

    def reward(prompts, completions, answer):
        return torch.tensor(tool_reward(prompts, completions, answer))

    with_tool = evaluate_completions(Oracle(tokenizer), tokenizer, rows, reward, 120, 3, tools=[add],
                                     max_tool_calling_iterations=1)
    assert with_tool == {"score": 1.0, "exact_match": 1.0, "tool_calls_per_completion": 1.0, "tool_error_rate": 0.0}
    without = evaluate_completions(Oracle(tokenizer), tokenizer, rows, reward, 120, 3)
    assert without == {"score": 0.0, "exact_match": 0.0}
