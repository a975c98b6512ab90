"""`WeightedRewards`: TRL's `reward_funcs` list as one reward source, keeping each function's scores for its metrics.

trl 1.16's GRPOTrainer takes several reward functions / models; a completion's reward is the weighted sum of their
scores (`reward_weights`, default 1 each: TRL's default `multi_objective_aggregation="sum_then_normalize"`), and
each one's mean and std are logged as `rewards/{name}/mean` and `rewards/{name}/std`. As TRL: a function may return
None (or NaN) for rows it does not apply to (left out of its mean and of the sum; a row no function scored is NaN,
left out of its group's baseline with advantage 0), and `async def` functions run concurrently with each other.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from .base import FunctionReward, run_coroutine
from .factory import build_reward_source

logger = logging.getLogger("hf_rlhf")


def reward_name(func) -> str:
    """TRL's name of a reward function or model: the function's `__name__`, the model's path's last part."""
    if isinstance(func, str):
        return func.split("/")[-1]
    config = getattr(func, "config", None)
    if config is not None and not callable(getattr(func, "func", None)):
        return config._name_or_path.split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


class WeightedRewards:
    """Several reward sources summed with weights; `last` holds the (K, B) unweighted scores of the latest call.

    The sources are built by `build_reward_source` when the trainer builds its reward (`build`), since a reward
    adapter needs the loaded policy.

    Args:
        funcs: reward functions, reward models or their paths (anything `build_reward_source` takes).
        weights: one weight per source; None: 1 each.
        processing_classes: the reward models' tokenizers, one per source (None entries: each model's own).
    """

    is_reward_source = True

    def __init__(self, funcs: list, weights: list[float] | None = None, processing_classes=None):
        if not funcs:
            raise ValueError("reward_funcs is empty: pass at least one reward function or model")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions; "
                             "give one per reward function (as TRL)")
        tokenizers = list(processing_classes) if processing_classes is not None else [None] * len(funcs)
        if len(tokenizers) != len(funcs):
            raise ValueError(f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward "
                             "functions; give one per reward function (as TRL)")
        self.funcs, self.tokenizers = list(funcs), tokenizers
        self.names = [reward_name(f) for f in funcs]
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.sources, self.last = None, None

    def build(self, reward_processing_class=None, **source_kwargs) -> WeightedRewards:
        """Build each source (`build_reward_source(func, tokenizer, **source_kwargs)`); returns self."""
        self.sources = [build_reward_source(f, t or reward_processing_class, **source_kwargs)
                        for f, t in zip(self.funcs, self.tokenizers)]
        for source in self.sources:
            if isinstance(source, FunctionReward):
                source.allow_none = True
        return self

    def __call__(self, prompts: list, completions: list, function_kwargs: dict | None = None,
                 **row_fields) -> torch.Tensor:
        """(B,) weighted sum of the sources' scores (NaN where no source scored the row); reward functions (not
        models) also receive `function_kwargs` (TRL's `environments`, `trainer_state`, `log_metric`, `log_extra`).
        Synchronous sources run in order, then the `async` ones together (as TRL's `_calculate_rewards`)."""
        scores: list = [None] * len(self.sources)
        waiting = []
        for i, source in enumerate(self.sources):
            extra = (function_kwargs or {}) if isinstance(source, FunctionReward) else {}
            if isinstance(source, FunctionReward) and source.is_async:
                waiting.append((i, source.acall(prompts, completions, **row_fields, **extra)))
                continue
            scores[i] = torch.as_tensor(source(prompts, completions, **row_fields, **extra), dtype=torch.float32)
        if waiting:
            async def gather():
                return await asyncio.gather(*(coroutine for _, coroutine in waiting))

            for (i, _), result in zip(waiting, run_coroutine(gather())):
                scores[i] = torch.as_tensor(result, dtype=torch.float32)
        self.last = torch.stack(scores)
        unscored = torch.isnan(self.last).all(dim=0)
        if unscored.any():  # TRL's warning, naming the first such row's fields
            row = int(unscored.nonzero()[0])
            fields = {"prompt": prompts[row], "completion": completions[row],
                      **{k: v[row] for k, v in row_fields.items() if isinstance(v, list) and len(v) > row}}
            logger.warning("All reward functions returned None for the following kwargs: %s. Please ensure that at "
                           "least one reward function returns a valid reward.", fields)
        total = (self.weights[:, None] * self.last).nansum(0)
        return total.masked_fill(unscored, float("nan"))
