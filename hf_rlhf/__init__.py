"""hf_rlhf: RLHF as thin `transformers.Trainer` subclasses.

Names are imported lazily, so `import hf_rlhf` stays cheap and never imports an optional extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .imports import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "AdaptiveKLController": "hf_rlhf.rl.kl",
    "DPOConfig": "hf_rlhf.trainers.dpo_config",
    "DistillationConfig": "hf_rlhf.trainers.distillation_config",
    "DistillationTrainer": "hf_rlhf.trainers.distillation_trainer",
    "DPOTrainer": "hf_rlhf.trainers.dpo_trainer",
    "FixedKLController": "hf_rlhf.rl.kl",
    "GRPOConfig": "hf_rlhf.trainers.grpo_config",
    "GRPOTrainer": "hf_rlhf.trainers.grpo_trainer",
    "KTOConfig": "hf_rlhf.trainers.kto_config",
    "KTOTrainer": "hf_rlhf.trainers.kto_trainer",
    "ModelConfig": "hf_rlhf.trainers.model_config",
    "PPOConfig": "hf_rlhf.trainers.ppo_config",
    "PPOTrainer": "hf_rlhf.trainers.ppo_trainer",
    "RewardConfig": "hf_rlhf.trainers.reward_config",
    "RewardTrainer": "hf_rlhf.trainers.reward_trainer",
    "RLOOConfig": "hf_rlhf.trainers.rloo_config",
    "RLOOTrainer": "hf_rlhf.trainers.rloo_trainer",
    "SFTConfig": "hf_rlhf.trainers.sft_config",
    "SFTTrainer": "hf_rlhf.trainers.sft_trainer",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


if TYPE_CHECKING:  # pragma: no cover
    from .rl.kl import AdaptiveKLController, FixedKLController
    from .trainers.distillation_config import DistillationConfig
    from .trainers.distillation_trainer import DistillationTrainer
    from .trainers.dpo_config import DPOConfig
    from .trainers.dpo_trainer import DPOTrainer
    from .trainers.grpo_config import GRPOConfig
    from .trainers.grpo_trainer import GRPOTrainer
    from .trainers.kto_config import KTOConfig
    from .trainers.kto_trainer import KTOTrainer
    from .trainers.model_config import ModelConfig
    from .trainers.ppo_config import PPOConfig
    from .trainers.ppo_trainer import PPOTrainer
    from .trainers.reward_config import RewardConfig
    from .trainers.reward_trainer import RewardTrainer
    from .trainers.rloo_config import RLOOConfig
    from .trainers.rloo_trainer import RLOOTrainer
    from .trainers.sft_config import SFTConfig
    from .trainers.sft_trainer import SFTTrainer
