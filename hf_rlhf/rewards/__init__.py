"""PPO's reward sources behind one interface: `source(prompts, completions, **row_fields) -> (B,) float32`.

    base.py          the interface's checks (`RewardError`, `check_scores`), `FunctionReward` (a Python function),
                     `TokenizedReward` (re-tokenize for a reward model's own tokenizer)
    model.py         `ModelReward` (a reward model in memory), `load_reward_model` (a path, loaded as what it is)
    adapter.py       `RewardAdapter` / `AdapterReward`: a LoRA reward adapter run on the policy's own frozen base
    http_client.py   `HTTPReward`: a reward served over HTTP (this project's JSON protocol or OpenRLHF's)
    server.py        `RewardServer`: the reference server (`python -m hf_rlhf.rewards.server`)
    factory.py       `build_reward_source`: what a user passes as `reward_model` -> a source
    weighted.py      `WeightedRewards`: TRL's `reward_funcs` list as one source (weighted sum, per-function metrics)

Names load on first use: `import hf_rlhf.rewards` imports none of transformers, peft or the HTTP modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..imports import lazy_exports

_LAZY = {
    "RewardError": ".base",
    "check_scores": ".base",
    "completion_text": ".base",
    "FunctionReward": ".base",
    "TokenizedReward": ".base",
    "ModelReward": ".model",
    "load_reward_model": ".model",
    "reward_model_kind": ".model",
    "RewardAdapter": ".adapter",
    "AdapterReward": ".adapter",
    "attach_reward_adapter": ".adapter",
    "HTTPReward": ".http_client",
    "RewardServer": ".server",
    "build_reward_source": ".factory",
}
__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


if TYPE_CHECKING:  # pragma: no cover
    from .adapter import AdapterReward, RewardAdapter, attach_reward_adapter
    from .base import FunctionReward, RewardError, TokenizedReward, check_scores, completion_text
    from .factory import build_reward_source
    from .http_client import HTTPReward
    from .model import ModelReward, load_reward_model, reward_model_kind
    from .server import RewardServer
