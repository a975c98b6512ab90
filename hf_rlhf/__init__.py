"""hf_rlhf: RLHF as thin `transformers.Trainer` subclasses.

Names are imported lazily, so `import hf_rlhf` stays cheap and never imports an optional extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "AdaptiveKLController": "hf_rlhf.ppo.kl",
    "FixedKLController": "hf_rlhf.ppo.kl",
    "ModelConfig": "hf_rlhf.configs",
    "PPOConfig": "hf_rlhf.ppo.config",
    "PPOTrainer": "hf_rlhf.trainers.ppo",
    "RewardConfig": "hf_rlhf.configs",
    "RewardTrainer": "hf_rlhf.trainers.reward",
    "SFTConfig": "hf_rlhf.configs",
    "SFTTrainer": "hf_rlhf.trainers.sft",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_rlhf' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from .configs import ModelConfig, RewardConfig, SFTConfig
    from .ppo.config import PPOConfig
    from .ppo.kl import AdaptiveKLController, FixedKLController
    from .trainers.ppo import PPOTrainer
    from .trainers.reward import RewardTrainer
    from .trainers.sft import SFTTrainer
