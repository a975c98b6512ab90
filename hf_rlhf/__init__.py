"""hf_rlhf: RLHF as thin `transformers.Trainer` subclasses.

Names are imported lazily, so `import hf_rlhf` stays cheap and never imports an optional extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .imports import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "AdaptiveKLController": "hf_rlhf.ppo.kl",
    "DPOConfig": "hf_rlhf.configs",
    "DPOTrainer": "hf_rlhf.trainers.dpo",
    "FixedKLController": "hf_rlhf.ppo.kl",
    "GRPOConfig": "hf_rlhf.ppo.grpo_config",
    "GRPOTrainer": "hf_rlhf.trainers.grpo",
    "ModelConfig": "hf_rlhf.configs",
    "PPOConfig": "hf_rlhf.ppo.config",
    "PPOTrainer": "hf_rlhf.trainers.ppo",
    "RewardConfig": "hf_rlhf.configs",
    "RewardTrainer": "hf_rlhf.trainers.reward",
    "SFTConfig": "hf_rlhf.configs",
    "SFTTrainer": "hf_rlhf.trainers.sft",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


if TYPE_CHECKING:  # pragma: no cover
    from .configs import DPOConfig, ModelConfig, RewardConfig, SFTConfig
    from .ppo.config import PPOConfig
    from .ppo.grpo_config import GRPOConfig
    from .ppo.kl import AdaptiveKLController, FixedKLController
    from .trainers.dpo import DPOTrainer
    from .trainers.grpo import GRPOTrainer
    from .trainers.ppo import PPOTrainer
    from .trainers.reward import RewardTrainer
    from .trainers.sft import SFTTrainer
