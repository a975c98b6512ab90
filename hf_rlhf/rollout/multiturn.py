"""The multi-turn rollout with tools: the batch generates a turn together, tool calls run, results are appended,
and the rows that called a tool generate again, until every row answers without a call, runs out of
`response_length`, or reaches `max_tool_calling_iterations` (TRL 1.16 GRPOTrainer's `_tool_call_loop`, in batch).

What the policy sees is kept token for token: each turn's sampled ids (up to and including the stop token), then
the ids the chat template renders for the tool messages and the next generation prompt
(`hf_rlhf.tools.tool_suffix_ids`). Those environment ids are in the context (attention) and out of the loss
(`hf_rlhf.tools.pack_turns`: `loss_mask` 0 on them). Like TRL, `response_length` bounds the whole multi-turn
response (policy and environment tokens); a tool result that would leave no room for the next turn is dropped and
the row ends with its call. Rows that finished wait while the others generate (one `generate` call per turn with
the rows still active).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..tools.execution import ToolRunner, tool_dict
from ..tools.masks import pack_turns
from ..tools.parsing import parse_turn, tool_suffix_ids

# generate(ids (N, L) left-padded, mask (N, L), max_new_tokens) -> (N, T) sampled ids, pad after an early stop
Generate = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class MultiTurnSample:
    """A multi-turn rollout's responses (B rows, R columns, right-padded) and what happened in it."""

    response_ids: torch.LongTensor  # (B, R) every response-side token the policy saw, in order
    loss_mask: torch.Tensor  # (B, R) 1 on tokens the policy generated (trained on)
    context_mask: torch.Tensor  # (B, R) 1 on every real token (policy and environment)
    stopped: torch.Tensor  # (B,) bool: the last turn ended with the stop token
    completions: list[list[dict]]  # B message lists: assistant turns (with tool_calls) and tool messages
    tool_calls: list[int] = field(default_factory=list)  # per row: calls made
    tool_failures: list[int] = field(default_factory=list)  # per row: calls answered with an error


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


class ToolRollout:
    """Runs the turn loop for one rollout batch.

    Args:
        tokenizer: the policy's tokenizer (checked by `hf_rlhf.tools.check_tool_tokenizer`).
        stop_token_id: the id that ends a turn (the template's end of turn).
        response_length: the budget of the whole multi-turn response, policy and environment tokens.
        max_tool_calling_iterations: most rounds of tool calls (None: no limit but the budget).
        runner: the `ToolRunner` that executes the calls.
        chat_template_kwargs: passed to the chat template when rendering tool results.
    """

    def __init__(self, tokenizer, stop_token_id: int, response_length: int, max_tool_calling_iterations: int | None,
                 runner: ToolRunner, chat_template_kwargs: dict | None = None):
        self.tokenizer, self.stop_token_id, self.response_length = tokenizer, stop_token_id, response_length
        self.max_iterations = max_tool_calling_iterations
        self.runner, self.chat_template_kwargs = runner, chat_template_kwargs

    def run(self, generate: Generate, query_ids: torch.Tensor, query_mask: torch.Tensor,
            tool_sets: list[dict[str, Callable]]) -> MultiTurnSample:
        """Generate, call tools, repeat.

        Args:
            generate: samples one turn for a left-padded batch (see `Generate`).
            query_ids, query_mask: (B, Q) left-padded prompts (rendered with the tools).
            tool_sets: per row, {name: callable} of the tools it may call (one environment instance per row).
        """
        pad, budget, device = self.tokenizer.pad_token_id, self.response_length, query_ids.device
        rows = query_ids.shape[0]
        prompts = [q[m.bool()].tolist() for q, m in zip(query_ids.cpu(), query_mask.cpu())]
        ids: list[list[int]] = [[] for _ in range(rows)]
        flags: list[list[int]] = [[] for _ in range(rows)]
        messages: list[list[dict]] = [[] for _ in range(rows)]
        stopped, calls, failures = [False] * rows, [0] * rows, [0] * rows
        active, rounds = list(range(rows)), 0
        while active:
            budgets = [budget - len(ids[i]) for i in active]
            contexts = [prompts[i] + ids[i] for i in active]
            context_ids, context_mask = _left_pad(contexts, pad, device)
            sampled = generate(context_ids, context_mask, max(budgets)).tolist()
            wanting = []  # (row, its assistant message) whose calls run this round
            for j, i in enumerate(active):
                turn = sampled[j][:budgets[j]]
                ended = self.stop_token_id in turn
                if ended:
                    turn = turn[:turn.index(self.stop_token_id) + 1]
                ids[i] += turn
                flags[i] += [1] * len(turn)
                message = parse_turn(self.tokenizer, turn, prefix=contexts[j], tools=list(tool_sets[i].values()))
                malformed = message.pop("malformed", False)
                messages[i].append(message)
                stopped[i] = ended
                if ended and (message.get("tool_calls") or malformed) and (
                        self.max_iterations is None or rounds < self.max_iterations):
                    wanting.append((i, message, malformed))
            active = self._answer(wanting, ids, flags, messages, calls, failures, tool_sets)
            rounds += 1
        response_ids, loss_mask, context_mask = pack_turns(ids, flags, pad, device=device)
        return MultiTurnSample(response_ids, loss_mask, context_mask, torch.tensor(stopped, device=device), messages,
                               calls, failures)

    def _answer(self, wanting, ids, flags, messages, calls, failures, tool_sets) -> list[int]:
        """Run the round's calls (one pool for the batch), append results that fit; the rows that go on."""
        jobs, owners = [], []
        for i, message, malformed in wanting:
            if malformed:  # the text opens a tool call the template's parser cannot read
                owners.append((i, None))
                continue
            for call in message["tool_calls"]:
                jobs.append((call, tool_sets[i]))
                owners.append((i, len(jobs) - 1))
        results = self.runner.run(jobs)
        answers: dict[int, list[dict]] = {}
        for i, job in owners:
            if job is None:
                name, content, failed = "unknown", str({"error": "could not parse the tool call"}), True
            else:
                name, content, failed = results[job]
            calls[i] += 1
            failures[i] += int(failed)
            answers.setdefault(i, []).append({"role": "tool", "name": name, "content": content})
        going_on = []
        for i, tool_messages in answers.items():
            suffix = tool_suffix_ids(self.tokenizer, tool_messages, self.chat_template_kwargs)
            if len(ids[i]) + len(suffix) >= self.response_length:  # no room for a next turn: the row ends here
                continue
            ids[i] += suffix
            flags[i] += [0] * len(suffix)
            messages[i] += tool_messages
            going_on.append(i)
        return sorted(going_on)


@dataclass
class ToolCompletions:
    """Greedy multi-turn completions of N prompts (`greedy_tool_completions`)."""

    completions: list[list[dict]]  # N message lists: assistant turns (with tool_calls) and tool messages
    tool_calls: list[int]  # per prompt: calls made
    tool_failures: list[int]  # per prompt: calls answered with an error

    def summary(self) -> dict[str, float]:
        """{"tool_calls_per_completion", "tool_error_rate"} (the share of calls answered with an error)."""
        calls = sum(self.tool_calls)
        return {"tool_calls_per_completion": calls / max(len(self.completions), 1),
                "tool_error_rate": sum(self.tool_failures) / calls if calls else 0.0}


@torch.no_grad()
def greedy_tool_completions(model, tokenizer, prompts: list[list[dict]], tools: list, response_length: int,
                            max_tool_calling_iterations: int | None, batch_size: int = 64,
                            chat_template_kwargs: dict | None = None, timeout: float | None = 30.0,
                            max_workers: int = 8) -> ToolCompletions:
    """Greedy completions of conversational `prompts` through the rollout's turn loop, calling `tools`.

    Args:
        prompts: N conversations, rendered with `tools` and a generation prompt.
        tools: the callables the policy may call; empty: the prompts are rendered without tools and a call the
            policy writes anyway is not run (its turn is the completion).
        response_length, max_tool_calling_iterations: as in a rollout (`ToolRollout`).
    """
    was_training = model.training
    model.eval()
    tools = list(tools or [])
    iterations = max_tool_calling_iterations if tools else 0
    loop = ToolRollout(tokenizer, tokenizer.eos_token_id, response_length, iterations,
                       ToolRunner(max_workers=max_workers, timeout=timeout), chat_template_kwargs)
    device = next(model.parameters()).device
    kwargs = chat_template_kwargs or {}
    out = ToolCompletions([], [], [])

    def generate(ids, mask, max_new_tokens):
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return new[:, ids.shape[1]:]

    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            rendered = [tokenizer.apply_chat_template(p, tools=tools or None, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False, **kwargs) for p in chunk]
            ids, mask = _left_pad(rendered, tokenizer.pad_token_id, device)
            sample = loop.run(generate, ids, mask, [tool_dict(tools)] * len(chunk))
            out.completions += sample.completions
            out.tool_calls += sample.tool_calls
            out.tool_failures += sample.tool_failures
    finally:
        loop.runner.close()
        model.train(was_training)
    return out


ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def rollout_func_sample(output: dict, rows: int, tokenizer, stop_token_id: int | None, conversational: bool,
                        device) -> tuple[torch.Tensor, torch.Tensor, MultiTurnSample, dict]:
    """What a TRL-style `rollout_func` returned, as the rollout's tensors.

    Args:
        output: {"prompt_ids": B lists, "completion_ids": B lists, "logprobs": B lists (not used: the rollout's own
            forward computes the old log-probs), "env_mask"?: B lists of 0/1 (1: the policy's token, 0: the
            environment's; TRL's name), any other key: a field passed to the reward (a list of B values, or one
            value for every row)}.
        rows: B, the completions the rollout expects (one per prompt row given to the function).

    Returns:
        (query_ids (B, Q) left-padded, query_mask (B, Q), the sample, extra reward fields).

    Raises:
        ValueError: a required key is missing, or a list does not have B rows / an env_mask row does not match its
            completion.
    """
    missing = [key for key in ROLLOUT_FUNC_KEYS if key not in output]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict")
    prompt_ids, completion_ids = [list(p) for p in output["prompt_ids"]], [list(c) for c in output["completion_ids"]]
    if len(prompt_ids) != rows or len(completion_ids) != rows:
        raise ValueError(f"rollout_func returned {len(prompt_ids)} prompt_ids and {len(completion_ids)} "
                         f"completion_ids for {rows} rollout rows (one completion per row, num_generations included)")
    if any(not p for p in prompt_ids) or any(not c for c in completion_ids):
        raise ValueError("rollout_func returned an empty prompt or completion")
    env_mask = output.get("env_mask")
    flags = [list(m) for m in env_mask] if env_mask is not None else [[1] * len(c) for c in completion_ids]
    if len(flags) != rows:
        raise ValueError(f"rollout_func returned {len(flags)} env_mask rows for {rows} completions")
    query_ids, query_mask = _left_pad(prompt_ids, tokenizer.pad_token_id, device)
    response_ids, loss_mask, context_mask = pack_turns(completion_ids, flags, tokenizer.pad_token_id, device=device)
    if (loss_mask.sum(1) == 0).any():
        raise ValueError("rollout_func returned a completion whose env_mask marks no token as the policy's")
    last_policy = [max(i for i, f in enumerate(row) if f) for row in flags]
    stopped = torch.tensor([stop_token_id is not None and c[i] == stop_token_id
                            for c, i in zip(completion_ids, last_policy)], device=device)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    extra = {key: value for key, value in output.items() if key not in ROLLOUT_FUNC_KEYS + ("env_mask",)}
    for key, value in list(extra.items()):
        if not isinstance(value, list):
            extra[key] = [value] * rows
        elif len(value) != rows:
            raise ValueError(f"rollout_func's extra field {key!r} has {len(value)} values for {rows} completions")
    return query_ids, query_mask, MultiTurnSample(response_ids, loss_mask, context_mask, stopped, completions), extra
