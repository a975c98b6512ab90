"""Reward sources for PPO behind one interface, and running reward statistics.

    source(prompts: list, completions: list, **row_fields) -> torch.Tensor (B,) float32

`prompts` are the dataset's prompts as given (strings, or message lists for conversational data); `completions`
the decoded responses (strings, or `[{"role": "assistant", "content": ...}]` for conversational prompts);
`row_fields` the dataset's other columns as lists of length B (e.g. `answer`), as TRL passes them to GRPO reward
functions.

Sources:
  - `FunctionReward`: any Python callable `(prompts, completions, **kwargs) -> list[float]` (verifiable rewards).
    Errors, a wrong number of scores and NaN/inf scores raise a `RewardError` naming the function (and the row).
  - `ModelReward`: a sequence-classification reward model (one label) or a `ValueHeadModel`, with its OWN
    tokenizer: prompt + completion text is re-tokenized for the reward model exactly as `RewardTrainer` tokenized
    its training pairs (`[bos] prompt + completion [eos]`, or the chat template), left-padded, and scored at the
    last real token. The policy and the reward model may therefore use different tokenizers (TRL issue #3595).

  - `hf_rlhf.ppo.http_reward.HTTPReward`: a reward served over HTTP (a remote reward model or verifier), with a
    documented JSON protocol (this project's, or OpenRLHF's remote reward model API).
  - `hf_rlhf.ppo.shared_base.AdapterReward`: a LoRA reward adapter (+ its score head) run on the policy's own
    frozen base (`RewardAdapter(path)` or `"adapter:<path>"`).

`build_reward_source` turns what a user passes (a callable, a model, a path, a URL, an adapter) into a source.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..collators import LeftPaddingCollator
from ..data import _special_prefix, _tokenize_prompt_completion
from ..reward_models import find_score_head, get_rewards, load_reward_stats, reward_config_of


class RewardError(ValueError):
    """A reward source failed or returned unusable scores; `row` is the batch row at fault, when known."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        self.row = row


def _completion_text(completion) -> str:
    if isinstance(completion, list):  # conversational: assistant messages
        return "".join(message["content"] for message in completion)
    return completion


class FunctionReward:
    """A Python reward function, called as TRL's GRPO calls it: `func(prompts=..., completions=..., **row_fields)`.

    Args:
        func: returns one number per completion.
        name: shown in errors (default: the function's `__name__`).
    """

    def __init__(self, func: Callable, name: str | None = None):
        self.func = func
        self.name = name or getattr(func, "__name__", type(func).__name__)

    def __call__(self, prompts: list, completions: list, **row_fields) -> torch.Tensor:
        try:
            scores = self.func(prompts=prompts, completions=completions, **row_fields)
        except Exception as err:
            raise RewardError(f"reward function {self.name!r} raised {type(err).__name__}: {err}") from err
        return check_scores(scores, len(completions), f"reward function {self.name!r}", prompts, completions)


def check_scores(scores, expected: int, source: str, prompts=None, completions=None) -> torch.Tensor:
    """Scores as a (B,) float32 tensor; raise a `RewardError` naming `source` (and the row) if they are unusable."""
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().float().cpu().reshape(-1).tolist()
    try:
        scores = list(scores)
    except TypeError:
        raise RewardError(f"{source} returned {type(scores).__name__}, expected a list of {expected} numbers") from None
    if len(scores) != expected:
        raise RewardError(f"{source} returned {len(scores)} scores for {expected} completions; it must return one "
                          "number per completion")
    for row, score in enumerate(scores):
        try:
            value = float(score)
        except (TypeError, ValueError):
            raise RewardError(f"{source} returned {score!r} for row {row}, expected a number", row) from None
        if not math.isfinite(value):
            where = f"row {row}"
            if prompts is not None:
                where += f" (prompt {prompts[row]!r}, completion {_completion_text(completions[row])!r})"
            raise RewardError(f"{source} returned {value} for {where}; scores must be finite", row)
    return torch.tensor([float(s) for s in scores], dtype=torch.float32)


class TokenizedReward:
    """Base of the sources that score with a model of their own tokenizer: re-tokenize, left-pad, batch.

    Args:
        tokenizer: the reward model's tokenizer (needs a pad token; a chat template for conversational prompts).
        batch_size: rows per forward.

    Subclasses implement `score_batch(input_ids (B, T), attention_mask (B, T), position_ids (B, T)) -> (B,)` and
    set `name`; `position_ids` count real tokens only (models with absolute position embeddings need them).
    """

    name = "reward model"

    def __init__(self, tokenizer, batch_size: int = 64):
        if tokenizer.pad_token_id is None:
            raise ValueError("the reward tokenizer has no pad token; set reward_processing_class.pad_token")
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.collator = LeftPaddingCollator(tokenizer.pad_token_id, passthrough=False)
        self.prefix = _special_prefix(tokenizer)

    def tokenize(self, prompt, completion) -> list[int]:
        """Token ids of prompt + completion, as `RewardTrainer` tokenized its pairs."""
        text = _completion_text(completion)
        if isinstance(prompt, list):
            messages = list(prompt) + [{"role": "assistant", "content": text}]
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        return _tokenize_prompt_completion(self.tokenizer, prompt, text, self.prefix,
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


class ModelReward(TokenizedReward):
    """A reward model with its own tokenizer; scores at the last real token of left-padded batches.

    Args:
        model: `AutoModelForSequenceClassification` (num_labels=1), a `ValueHeadModel`, or a `PeftModel` of either.
        tokenizer: the reward model's tokenizer (needs a pad token; a chat template for conversational prompts).
        batch_size: rows per forward.
    """

    def __init__(self, model: nn.Module, tokenizer, batch_size: int = 64):
        find_score_head(model)  # fails now, not mid-training, for a model that gives no scalar per sequence
        super().__init__(tokenizer, batch_size)
        self.model = model.eval().requires_grad_(False)
        self.reward_stats = load_reward_stats(model)
        self.name = type(reward_config_of(model)).__name__.removesuffix("Config") + " reward model"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score_batch(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        return get_rewards(self.model, input_ids, attention_mask, position_ids)


def build_reward_source(reward_model, reward_processing_class=None, *, batch_size: int = 64, model_config=None,
                        device=None, policy=None, policy_tokenizer=None):
    """A reward source from what the user passed.

    Args:
        reward_model: a callable `(prompts, completions, **kwargs) -> list[float]`; a reward model (`nn.Module`);
            a path / hub id of a sequence-classification reward model; an `http://` / `https://` URL (an
            `HTTPReward` with its defaults); a LoRA reward adapter on the policy's base (`RewardAdapter(path)` or
            `"adapter:<path>"`); or a ready source (`FunctionReward`, `ModelReward`, `HTTPReward`, or any object
            with `is_reward_source = True`).
        reward_processing_class: the reward model's tokenizer (default: loaded from the model's path).
        batch_size: rows per reward-model forward.
        model_config: a `ModelConfig` for loading a path (dtype, attention, quantization).
        device: where to put a reward model.
        policy: the policy `PeftModel`, whose base a reward adapter runs on.
        policy_tokenizer: the policy's tokenizer (renders chat prompts for OpenRLHF's protocol; an adapter's
            default tokenizer).
    """
    from .http_reward import HTTPReward
    from .shared_base import RewardAdapter, attach_reward_adapter

    if isinstance(reward_model, str) and reward_model.startswith("adapter:"):
        reward_model = RewardAdapter(reward_model.removeprefix("adapter:"))
    if isinstance(reward_model, RewardAdapter):
        return attach_reward_adapter(policy, reward_model, reward_processing_class or policy_tokenizer,
                                     batch_size=batch_size)
    if isinstance(reward_model, str) and reward_model.startswith(("http://", "https://")):
        reward_model = HTTPReward(reward_model)
    if isinstance(reward_model, HTTPReward) and reward_model.tokenizer is None:
        reward_model.tokenizer = reward_processing_class or policy_tokenizer
    if isinstance(reward_model, (FunctionReward, ModelReward)) or getattr(reward_model, "is_reward_source", False):
        return reward_model
    if isinstance(reward_model, str):
        reward_model = _load_reward_model(reward_model, model_config)
    if isinstance(reward_model, nn.Module):
        if reward_processing_class is None:
            from transformers import AutoTokenizer

            reward_processing_class = AutoTokenizer.from_pretrained(reward_config_of(reward_model)._name_or_path)
        if device is not None and getattr(reward_model, "hf_device_map", None) is None:
            reward_model = reward_model.to(device)
        return ModelReward(reward_model, reward_processing_class, batch_size=batch_size)
    if callable(reward_model):
        return FunctionReward(reward_model)
    raise TypeError(f"reward_model must be a callable, a reward model, a path, a URL or a RewardAdapter, got "
                    f"{type(reward_model).__name__}")


def _load_reward_model(path: str, model_config=None) -> nn.Module:
    from dataclasses import replace

    from transformers import AutoModelForSequenceClassification

    from ..configs import ModelConfig
    from ..models import load_model

    config = replace(model_config, model_name_or_path=path, use_peft=False, load_in_4bit=False,
                     load_in_8bit=False) if model_config is not None else ModelConfig(model_name_or_path=path)
    return load_model(config, AutoModelForSequenceClassification, num_labels=1)


# ---------------------------------------------------------------------------------------------------
# Running statistics for `reward_normalization="running"`


class RunningMoments:
    """Mean and variance of every score seen so far, merged batch by batch (Chan et al. 1979's parallel update).

    Args:
        mean, var, count: the state (var is the population variance of the `count` scores seen).
    """

    def __init__(self, mean: float = 0.0, var: float = 1.0, count: int = 0):
        self.mean, self.var, self.count = float(mean), float(var), int(count)

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values: torch.Tensor) -> None:
        values = values.detach().double().reshape(-1)
        n = values.numel()
        if n == 0:
            return
        batch_mean, batch_var = values.mean().item(), values.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var, self.count = m2 / total, total

    def normalize(self, values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        return (values - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])
