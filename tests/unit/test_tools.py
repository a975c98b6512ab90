"""Tools in rollouts (issue 21): packing policy and environment tokens, parsing a turn with the chat template's tool
format, the tool-result tokens, the bounded tool pool, and the turn loop on a scripted generator."""

import threading

import pytest
import torch

from hf_rlhf.rollout.multiturn import ToolRollout
from hf_rlhf.tools import ToolRunner, check_tool_tokenizer, pack_turns, parse_turn, tool_dict, tool_suffix_ids
from hf_rlhf.tools import execution as execution_module
from hf_rlhf.toy import build_toy_tokenizer, build_toy_tool_tokenizer


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_toy_tool_tokenizer()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError("disk on fire")


async def async_add(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- pack_turns --------------------------------------------------------------------------------------
def test_pack_turns_marks_policy_and_environment_tokens():
    ids, loss, context = pack_turns([[5, 6, 7, 8, 9], [3]], [[1, 1, 0, 0, 1], [1]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [3, 0, 0, 0, 0]]
    assert loss.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert context.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert pack_turns([[1]], [[1]], pad_id=0, width=3)[0].shape == (1, 3)


@pytest.mark.parametrize("ids,flags,message", [([[1, 2]], [[1]], "flags"), ([[1]], [[2]], "0 or 1"),
                                               ([[1, 2]], [[1, 1]], "width")])
def test_pack_turns_rejects_bad_rows(ids, flags, message):
    with pytest.raises(ValueError, match=message):
        pack_turns(ids, flags, pad_id=0, width=1 if message == "width" else None)


# -- parsing -----------------------------------------------------------------------------------------
def test_tokenizer_without_tool_support_is_named(tool_tokenizer):
    with pytest.raises(ValueError, match="drops the tool call"):
        check_tool_tokenizer(build_toy_tokenizer())  # the plain toy template renders no tool_calls
    plain = build_toy_tool_tokenizer()
    plain.response_template = None
    with pytest.raises(ValueError, match="response_template"):
        check_tool_tokenizer(plain)
    check_tool_tokenizer(tool_tokenizer)


def test_parse_turn_reads_calls_with_the_template_and_types_arguments(tool_tokenizer):
    prefix = tool_tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tools=[add],
                                                add_generation_prompt=True, return_dict=False)
    turn = ids_of(tool_tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": "2"}}</tool_call><|eos|>')
    message = parse_turn(tool_tokenizer, turn, prefix=prefix, tools=[add])
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert parse_turn(tool_tokenizer, ids_of(tool_tokenizer, "3<|eos|>"), prefix, [add]) == {
        "role": "assistant", "content": "3"}
    bad = parse_turn(tool_tokenizer, ids_of(tool_tokenizer, '<tool_call>{"name": "ad</tool_call><|eos|>'), prefix,
                     [add])
    assert bad["malformed"] and "tool_calls" not in bad


def test_tool_suffix_is_what_the_template_renders_after_the_turn(tool_tokenizer):
    suffix = tool_suffix_ids(tool_tokenizer, [{"role": "tool", "name": "add", "content": "42"}])
    assert tool_tokenizer.decode(suffix) == "<|user|>result: 42<|assistant|>"
    # the whole conversation rendered at once is the turns' ids and the suffix, token for token
    messages = [{"role": "user", "content": "40+2="}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}]}
    prompt = tool_tokenizer.apply_chat_template(messages, tools=[add], add_generation_prompt=True, return_dict=False)
    turn = ids_of(tool_tokenizer, '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call><|eos|>')
    full = tool_tokenizer.apply_chat_template(messages + [call, {"role": "tool", "name": "add", "content": "42"}],
                                              tools=[add], add_generation_prompt=True, return_dict=False)
    assert full == prompt + turn + suffix


# -- ToolRunner --------------------------------------------------------------------------------------
def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_runner_turns_every_failure_into_a_message():
    tools = tool_dict([add, broken, async_add])
    runner = ToolRunner(max_workers=2, timeout=5)
    out = runner.run([(call("add", a=1, b=2), tools), (call("broken", x=1), tools), (call("nope"), tools),
                      (call("add", a=1), tools), (call("async_add", a=2, b=3), tools), ({"type": "x"}, tools)])
    assert out[0] == ("add", "3", False)
    assert out[1][0] == "broken" and "disk on fire" in out[1][1] and out[1][2]
    assert out[2] == ("nope", str({"error": "Tool nope not found."}), True)
    assert out[3][2] and "missing 1 required positional argument" in out[3][1]  # a bad call
    assert out[4] == ("async_add", "5", False)
    assert out[5][2] and "Unsupported" in out[5][1]
    runner.close()


def test_tool_runner_runs_calls_concurrently_and_times_out():
    # handshakes, not a stopwatch: each `meet` call waits for the other at a barrier, which only opens when both run
    # at once; `hang` can only finish once the test sets `release`, after `run` returned, so `run` returning at all,
    # with the call timed out, shows that it did not wait for it (however fast or slow the machine)
    barrier, release = threading.Barrier(2, timeout=30), threading.Event()

    def meet(x: int) -> int:
        """Waits for the other call.

        Args:
            x: returned.
        """
        barrier.wait()
        return x

    def hang(x: int) -> int:
        """Blocks until released.

        Args:
            x: returned.
        """
        release.wait(120)
        return x

    runner = ToolRunner(max_workers=4, timeout=60)
    out = runner.run([(call("meet", x=1), tool_dict([meet])), (call("meet", x=2), tool_dict([meet]))])
    assert out == [("meet", "1", False), ("meet", "2", False)], f"the two calls did not run at once: {out}"
    runner.close()

    runner = ToolRunner(max_workers=4, timeout=0.3)
    try:
        out = runner.run([(call("hang", x=1), tool_dict([hang]))])
        assert out[0][2] and "timed out after 0.3 s" in out[0][1], f"run waited for the call: {out}"
    finally:
        release.set()
    runner.close()


EXECUTION = execution_module.__file__


def test_a_hung_tool_neither_blocks_the_next_turn_nor_the_exit():
    import subprocess
    import sys

    script = (
        "import importlib.util, sys, time\n"  # the module alone (stdlib only): no trl import in the child
        f"spec = importlib.util.spec_from_file_location('execution', {EXECUTION!r})\n"
        "execution = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(execution)\n"
        "ToolRunner = execution.ToolRunner\n"
        "def hang(x: int) -> int:\n"
        "    time.sleep(1000)\n"
        "runner = ToolRunner(max_workers=1, timeout=0.3)\n"
        "call = {'type': 'function', 'function': {'name': 'hang', 'arguments': {'x': 1}}}\n"
        "first = runner.run([(call, {'hang': hang})])\n"
        "second = runner.run([(call, {'hang': hang})])  # the only slot is still held: times out, no hang\n"
        "print(first[0][2], second[0][2], 'timed out' in second[0][1])\n"
    )
    # the tool sleeps 1000 s: the process exiting within the timeout shows that the hung thread does not hold the
    # interpreter's exit
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]


# -- the turn loop -----------------------------------------------------------------------------------
class Script:
    """A generator that answers each call with scripted texts per row, recording what it was given."""

    def __init__(self, tokenizer, turns_by_row):
        self.tokenizer, self.turns, self.calls = tokenizer, turns_by_row, []

    def __call__(self, ids, mask, max_new_tokens):
        rows = []
        for row_ids, row_mask in zip(ids, mask):
            context = row_ids[row_mask.bool()].tolist()
            row = next(r for r, p in enumerate(self.prompts) if context[:len(p)] == p)
            turn = ids_of(self.tokenizer, self.turns[row].pop(0))[:max_new_tokens]
            rows.append(turn)
        self.calls.append((len(rows), max_new_tokens))
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def run_loop(tokenizer, prompts, turns, tools, budget=200, iterations=None, timeout=5):
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tools=tools,
                                              add_generation_prompt=True, return_dict=False) for p in prompts]
    width = max(len(r) for r in rendered)
    query = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rendered])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rendered])
    script = Script(tokenizer, turns)
    script.prompts = rendered
    loop = ToolRollout(tokenizer, tokenizer.eos_token_id, budget, iterations, ToolRunner(2, timeout))
    return loop.run(script, query, mask, [tool_dict(tools)] * len(prompts)), script


CALL = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call><|eos|>'


def test_loop_keeps_generated_ids_and_appends_tool_tokens(tool_tokenizer):
    out, script = run_loop(tool_tokenizer, ["40+2=", "1+1="], [[CALL, "42<|eos|>"], ["2<|eos|>"]], [add])
    suffix = tool_suffix_ids(tool_tokenizer, [{"role": "tool", "name": "add", "content": "42"}])
    first, second = ids_of(tool_tokenizer, CALL), ids_of(tool_tokenizer, "42<|eos|>")
    expected = first + suffix + second
    n = len(expected)
    assert out.response_ids[0, :n].tolist() == expected
    assert out.loss_mask[0, :n].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * len(second)
    assert out.context_mask[0].sum() == n and out.loss_mask[0, n:].sum() == 0
    assert out.response_ids[1, :2].tolist() == ids_of(tool_tokenizer, "2<|eos|>") and out.context_mask[1].sum() == 2
    assert out.stopped.tolist() == [True, True]
    assert script.calls[0][0] == 2 and script.calls[1][0] == 1  # the finished row waited, out of the batch
    assert out.completions[0] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}]},
        {"role": "tool", "name": "add", "content": "42"}, {"role": "assistant", "content": "42"}]
    assert out.tool_calls == [1, 0] and out.tool_failures == [0, 0]


def test_loop_shows_errors_to_the_policy_and_goes_on(tool_tokenizer):
    bad_call = '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call><|eos|>'
    garbled = '<tool_call>{"name": "bro</tool_call><|eos|>'
    out, _ = run_loop(tool_tokenizer, ["a", "b"], [[bad_call, "1<|eos|>"], [garbled, "2<|eos|>"]], [add, broken])
    first = out.completions[0][1]
    assert first["role"] == "tool" and "disk on fire" in first["content"]
    assert "could not parse the tool call" in out.completions[1][1]["content"]
    assert out.completions[0][-1]["content"] == "1" and out.completions[1][-1]["content"] == "2"
    assert out.tool_failures == [1, 1]
    text = tool_tokenizer.decode(out.response_ids[0][out.context_mask[0].bool()])
    assert "result: {'error': 'RuntimeError: disk on fire'}" in text


def test_loop_limits_and_budget(tool_tokenizer):
    # max_tool_calling_iterations=1: the second call is not run, the row ends with it
    out, _ = run_loop(tool_tokenizer, ["a"], [[CALL, CALL, "x<|eos|>"]], [add], iterations=1)
    assert out.tool_calls == [1] and len(out.completions[0]) == 3 and out.stopped.tolist() == [True]
    # no room for the next turn after the result: the result is dropped and the row ends with its call
    budget = len(ids_of(tool_tokenizer, CALL)) + 3
    out, _ = run_loop(tool_tokenizer, ["a"], [[CALL, "x<|eos|>"]], [add], budget=budget)
    assert out.context_mask.sum() == len(ids_of(tool_tokenizer, CALL)) and len(out.completions[0]) == 1
    # a turn cut by the budget did not stop
    out, _ = run_loop(tool_tokenizer, ["a"], [["123456<|eos|>"]], [add], budget=3)
    assert out.stopped.tolist() == [False] and out.loss_mask.sum() == 3


# -- rollout_func output -----------------------------------------------------------------------------
def test_rollout_func_output_becomes_the_rollout(tool_tokenizer):
    from hf_rlhf.rollout.multiturn import rollout_func_sample

    eos = tool_tokenizer.eos_token_id
    output = {"prompt_ids": [[1, 5, 6], [1, 7]], "completion_ids": [[8, 9, 10, eos], [11, 12]],
              "logprobs": [[0.0] * 4, [0.0] * 2], "env_mask": [[1, 0, 0, 1], [1, 1]], "tag": ["a", "b"], "k": 3}
    query_ids, query_mask, sample, extra = rollout_func_sample(output, 2, tool_tokenizer, eos, True, "cpu")
    pad = tool_tokenizer.pad_token_id
    assert query_ids.tolist() == [[1, 5, 6], [pad, 1, 7]] and query_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert sample.response_ids.tolist() == [[8, 9, 10, eos], [11, 12, pad, pad]]
    assert sample.loss_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert sample.context_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert sample.stopped.tolist() == [True, False]
    assert extra == {"tag": ["a", "b"], "k": [3, 3]}
    assert sample.completions[0][0]["role"] == "assistant"
    with pytest.raises(ValueError, match="must return keys"):
        rollout_func_sample({"prompt_ids": [[1]]}, 1, tool_tokenizer, eos, True, "cpu")
    with pytest.raises(ValueError, match="for 3 rollout rows"):
        rollout_func_sample(output, 3, tool_tokenizer, eos, True, "cpu")
    with pytest.raises(ValueError, match="flags"):
        rollout_func_sample({**output, "env_mask": [[1], [1, 1]]}, 2, tool_tokenizer, eos, True, "cpu")


def test_rollout_tokenizer_swaps_in_trls_prefix_preserving_template():
    # Qwen3's stock template drops earlier thinking once a tool message follows (not prefix-preserving): as TRL, the
    # rollout renders with TRL's training version of it, on a copy; the tokenizer given keeps its own
    from pathlib import Path

    import trl
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    from hf_rlhf.tools import check_tool_tokenizer, rollout_tokenizer
    from hf_rlhf.toy import build_toy_tool_tokenizer

    tokenizer = build_toy_tool_tokenizer()
    assert rollout_tokenizer(tokenizer) is tokenizer  # prefix-preserving already
    stock = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer.chat_template, tokenizer.response_template = stock, None
    assert not is_chat_template_prefix_preserving(tokenizer)
    swapped = rollout_tokenizer(tokenizer)
    assert swapped is not tokenizer and is_chat_template_prefix_preserving(swapped)
    check_tool_tokenizer(swapped)  # TRL's response template for Qwen3, set before the swap
    assert swapped.response_template is not None
    assert tokenizer.chat_template == stock and tokenizer.response_template is None
