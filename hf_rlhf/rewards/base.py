"""The reward-source interface, its checks, and the two sources every other one builds on.

    source(prompts: list, completions: list, **row_fields) -> torch.Tensor (B,) float32

`prompts` are the dataset's prompts as given (strings, or message lists for conversational data); `completions`
the decoded responses (strings, or `[{"role": "assistant", "content": ...}]` for conversational prompts);
`row_fields` the dataset's other columns as lists of length B (e.g. `answer`), as TRL passes them to GRPO reward
functions.

- `FunctionReward`: any Python callable `(prompts, completions, **kwargs) -> list[float]` (verifiable rewards).
  Errors, a wrong number of scores and NaN/inf scores raise a `RewardError` naming the function (and the row).
- `TokenizedReward`: the base of the sources that score with a model of their own tokenizer: prompt + completion
  text is re-tokenized exactly as `RewardTrainer` tokenized its training pairs (`[bos] prompt + completion [eos]`,
  or the chat template), left-padded, and scored at the last real token. The policy and the reward model may
  therefore use different tokenizers (TRL issue #3595).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable

import torch

from ..collators import LeftPaddingCollator
from ..data import special_prefix, tokenize_prompt_completion


class RewardError(ValueError):
    """A reward source failed or returned unusable scores; `row` is the batch row at fault, when known."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        self.row = row


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion: itself, or its assistant messages' contents joined (conversational data)."""
    if isinstance(completion, list):
        return "".join(message["content"] for message in completion)
    return completion


def check_scores(scores, expected: int, source: str, prompts=None, completions=None,
                 allow_none: bool = False) -> torch.Tensor:
    """Scores as a (B,) float32 tensor; raise a `RewardError` naming `source` (and the row) if they are unusable.

    Args:
        scores: a tensor or a sequence of numbers, one per completion.
        expected: B, the number of completions.
        source: the source's name, for errors.
        prompts, completions: the batch, quoted in the error for a non-finite score.
        allow_none: None and NaN are taken as NaN, "this row is not scored" (TRL's GRPO reward functions); inf is
            still an error.
    """
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().float().cpu().reshape(-1).tolist()
    try:
        scores = list(scores)
    except TypeError:
        raise RewardError(f"{source} returned {type(scores).__name__}, expected a list of {expected} numbers") from None
    if len(scores) != expected:
        raise RewardError(f"{source} returned {len(scores)} scores for {expected} completions; it must return one "
                          "number per completion")
    if allow_none:
        scores = [math.nan if score is None else score for score in scores]
    for row, score in enumerate(scores):
        try:
            value = float(score)
        except (TypeError, ValueError):
            raise RewardError(f"{source} returned {score!r} for row {row}, expected a number", row) from None
        if not math.isfinite(value) and not (allow_none and math.isnan(value)):
            where = f"row {row}"
            if prompts is not None:
                where += f" (prompt {prompts[row]!r}, completion {completion_text(completions[row])!r})"
            raise RewardError(f"{source} returned {value} for {where}; scores must be finite", row)
    return torch.tensor([float(s) for s in scores], dtype=torch.float32)


class FunctionReward:
    """A Python reward function, called as TRL's GRPO calls it: `func(prompts=..., completions=..., **row_fields)`.

    Args:
        func: returns one number per completion.
        name: shown in errors (default: the function's `__name__`).
    """

    def __init__(self, func: Callable, name: str | None = None, allow_none: bool = False):
        self.func = func
        self.name = name or getattr(func, "__name__", type(func).__name__)
        self.allow_none = allow_none  # None / NaN for rows the function does not score (TRL's GRPO)
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)

    def __call__(self, prompts: list, completions: list, **row_fields) -> torch.Tensor:
        if self.is_async:
            return run_coroutine(self.acall(prompts, completions, **row_fields))
        try:
            scores = self.func(prompts=prompts, completions=completions, **row_fields)
        except Exception as err:
            raise RewardError(f"reward function {self.name!r} raised {type(err).__name__}: {err}") from err
        return self._check(scores, prompts, completions)

    async def acall(self, prompts: list, completions: list, **row_fields) -> torch.Tensor:
        """Await an `async def` reward function (TRL runs those concurrently: `hf_rlhf.rewards.WeightedRewards`)."""
        try:
            scores = await self.func(prompts=prompts, completions=completions, **row_fields)
        except Exception as err:
            raise RewardError(f"reward function {self.name!r} raised {type(err).__name__}: {err}") from err
        return self._check(scores, prompts, completions)

    def _check(self, scores, prompts, completions) -> torch.Tensor:
        return check_scores(scores, len(completions), f"reward function {self.name!r}", prompts, completions,
                            allow_none=self.allow_none)


def run_coroutine(coroutine):
    """Run a coroutine to its end from synchronous code: `asyncio.run`, or in a thread of its own when this thread
    already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    out = {}

    def target():
        try:
            out["value"] = asyncio.run(coroutine)
        except BaseException as err:  # re-raised in the caller's thread
            out["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class TokenizedReward:
    """Base of the sources that score with a model of their own tokenizer: re-tokenize, left-pad, batch.

    Args:
        tokenizer: the reward model's tokenizer (needs a pad token; a chat template for conversational prompts).
        batch_size: rows per forward.

    Subclasses implement `score_batch(input_ids (B, T), attention_mask (B, T), position_ids (B, T)) -> (B,)` and
    `device`, and set `name`; `position_ids` count real tokens only (absolute position embeddings need them).
    """

    name = "reward model"

    def __init__(self, tokenizer, batch_size: int = 64):
        if tokenizer.pad_token_id is None:
            raise ValueError("the reward tokenizer has no pad token; set reward_processing_class.pad_token")
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.collator = LeftPaddingCollator(tokenizer.pad_token_id, passthrough=False)
        self.prefix = special_prefix(tokenizer)

    def tokenize(self, prompt, completion) -> list[int]:
        """Token ids of prompt + completion, as `RewardTrainer` tokenized its pairs."""
        text = completion_text(completion)
        if isinstance(prompt, list):
            messages = list(prompt) + [{"role": "assistant", "content": text}]
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        return tokenize_prompt_completion(self.tokenizer, prompt, text, self.prefix,
                                           self.tokenizer.eos_token_id)["input_ids"]

    def score_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **row_fields) -> torch.Tensor:
        ids = [self.tokenize(p, c) for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(ids), self.batch_size):
            batch = self.collator([{"input_ids": x} for x in ids[start:start + self.batch_size]])
            scores.append(self.score_batch(*(batch[k].to(self.device) for k in ("input_ids", "attention_mask",
                                                                                 "position_ids"))))
        return check_scores(torch.cat(scores), len(completions), self.name, prompts, completions)
