"""`SampleCompletionsCallback`: greedy completions of a few fixed prompts at the start, every N steps and at the end,
printed and appended to `<output_dir>/completions.jsonl`, so a run shows what the policy writes, not only numbers.

The model comes with the callback event (`model=`): a causal LM, or a wrapper with a `.policy` (PPO's
`PolicyAndValue`). Generation runs on the main process only, except under DeepSpeed ZeRO-3: there every forward
gathers the sharded weights collectively, so every rank generates (transformers' `synced_gpus`) and the main
process alone prints and writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from transformers import TrainerCallback

from ..generation import generate_completions


def _write_line(text: str) -> None:
    # tqdm.write keeps an active progress bar intact; tqdm comes with transformers
    try:
        from tqdm.auto import tqdm

        tqdm.write(text)
    except ImportError:  # pragma: no cover
        print(text)


class SampleCompletionsCallback(TrainerCallback):
    """Log greedy completions of `prompts` at step 0, every `every_n_steps` optimizer steps and at the end.

    Args:
        prompts: a few prompts (strings, or message lists rendered with the chat template).
        every_n_steps: how often; None or 0: only at the start and the end.
        max_new_tokens: generation length.
        score_fn: optional `(prompts, completions) -> list[float]` (e.g. `hf_rlhf.toy.reward_fn`), logged as `score`.
        filename: JSONL file inside `args.output_dir` (None: print only).
        tools: the run's tools: completions are then multi-turn (the rollout's turn loop, greedy, calling them) and
            logged as message lists; `max_new_tokens` bounds the whole multi-turn response.
        max_tool_calling_iterations: as the run's (`PPOConfig.max_tool_calling_iterations`).

    `history` holds every logged row: {"step", "prompt", "completion"[, "score"]}.

    On resume from step G the file keeps the rows of the steps before G and the callback samples at G only where the
    uninterrupted run did (a multiple of `every_n_steps`), so the file reads as the uninterrupted run's.
    """

    def __init__(self, prompts: Sequence, every_n_steps: int | None = None, max_new_tokens: int = 16,
                 score_fn: Callable | None = None, filename: str | None = "completions.jsonl",
                 tools: list | None = None, max_tool_calling_iterations: int | None = None):
        if not prompts:
            raise ValueError("SampleCompletionsCallback needs at least one prompt")
        self.prompts, self.every_n_steps = list(prompts), every_n_steps
        self.max_new_tokens, self.score_fn, self.filename = max_new_tokens, score_fn, filename
        self.tools, self.max_tool_calling_iterations = list(tools or []), max_tool_calling_iterations
        self.history: list[dict] = []
        self._last_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:  # resumed: read on as the uninterrupted run's log would
            self._forget_from(args, state)
            if not (self.every_n_steps and state.global_step % self.every_n_steps == 0):
                return  # the uninterrupted run sampled no block at this step
        self._sample(args, state, **kwargs)

    def _forget_from(self, args, state) -> None:
        """Drop the rows of step >= the resumed step: the interrupted run wrote them, the resumed run writes them
        again."""
        self.history = [row for row in self.history if row["step"] < state.global_step]
        self._last_step = None
        path = os.path.join(args.output_dir, self.filename) if self.filename else None
        if not state.is_world_process_zero or path is None or not os.path.isfile(path):
            return
        with open(path) as f:
            kept = [line for line in f if _row_step(line) < state.global_step]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._sample(args, state, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._sample(args, state, **kwargs)

    def _sample(self, args, state, model=None, processing_class=None, **kwargs):
        if model is None or processing_class is None:
            return
        if not state.is_world_process_zero and not _sharded_zero3(args):
            return
        if self._last_step == state.global_step:  # e.g. the end falls on a sampling step
            return
        self._last_step = state.global_step
        policy = getattr(model, "policy", model)
        if self.tools:
            from ..rollout.multiturn import greedy_tool_completions

            completions = greedy_tool_completions(policy, processing_class, self.prompts, self.tools,
                                                  self.max_new_tokens, self.max_tool_calling_iterations).completions
        else:
            completions = generate_completions(policy, processing_class, self.prompts, self.max_new_tokens)
        if not state.is_world_process_zero:  # a ZeRO-3 rank that only took part in the gathers
            return
        scores = self.score_fn(self.prompts, completions) if self.score_fn is not None else None
        rows = []
        for i, (prompt, completion) in enumerate(zip(self.prompts, completions)):
            row = {"step": state.global_step, "prompt": prompt, "completion": completion}
            if scores is not None:
                row["score"] = float(scores[i])
            rows.append(row)
        self.history += rows
        _write_line(f"[hf_rlhf] sample completions at step {state.global_step}:")
        for row in rows:
            score = f"  (score {row['score']:.3g})" if "score" in row else ""
            _write_line(f"  {_show(row['prompt'])!s:>28} -> {_show_completion(row['completion'])}{score}")
        if self.filename:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, self.filename), "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")


def _row_step(line: str) -> float:
    """The step of a completions.jsonl line; infinity for a blank or partly written one (a killed run's last)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _sharded_zero3(args) -> bool:
    """True when the weights are ZeRO-3 shards over several processes (a forward is then a collective op)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return args.world_size > 1 and is_deepspeed_zero3_enabled()


def _show_completion(completion) -> str:
    """A completion on one line: its text, or a multi-turn one's turns ("call add({...})", "-> 42", "'42'")."""
    if not isinstance(completion, list):
        return repr(completion)
    parts = []
    for message in completion:
        if message.get("role") == "tool":
            parts.append(f"-> {message.get('content')}")
            continue
        if message.get("content"):
            parts.append(repr(message["content"]))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(f"call {function.get('name')}({json.dumps(function.get('arguments'))})")
    return " | ".join(parts) or "''"


def _show(prompt) -> str:
    if isinstance(prompt, list):  # a conversation: its last message
        return prompt[-1]["content"]
    return prompt
