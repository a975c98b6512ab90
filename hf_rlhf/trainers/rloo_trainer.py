"""RLOOTrainer: trl 1.16's `RLOOTrainer` signature, defaults and logged metrics on `GRPOTrainer`'s loop.

A TRL RLOO script runs with `from hf_rlhf import RLOOConfig, RLOOTrainer` in place of `from trl import ...`: the
same keywords (`model`, `reward_funcs`, `args`, `train_dataset`, `eval_dataset`, `processing_class`,
`reward_processing_classes`, `callbacks`, `optimizers`, `quantization_config` (refused, as GRPOTrainer),
`peft_config`), the same rows, and TRL's metric names: `reward`, `reward_std`, `rewards/{name}/mean|std`,
`frac_reward_zero_std`, `completions/*`, `kl` (the token mean of the rollout's k1 log-ratio, as TRL's RLOO logs it),
`entropy`, `clip_ratio/*`, `num_tokens`. The math is `RLOOConfig`'s (hf_rlhf.trainers.rloo_config).
"""

from __future__ import annotations

import torch

from ..tensors import masked_sum
from .grpo_trainer import GRPOTrainer
from .rloo_config import RLOOConfig


class RLOOTrainer(GRPOTrainer):
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740) with trl 1.16 `RLOOTrainer`'s arguments.

    Args:
        model: the policy: a path or hub id, a causal LM or a `PeftModel`.
        reward_funcs: a reward function `(prompts, completions, **columns) -> list[float]`, a reward model or its
            path, or a list of them (summed with `RLOOConfig.reward_weights`).
        args: an `RLOOConfig` (a trl `RLOOConfig` is converted, field for field).
        train_dataset, eval_dataset: prompt rows (`prompt`: text or messages); other columns reach the rewards.
        processing_class, reward_processing_classes, callbacks, optimizers, peft_config: as `GRPOTrainer` / TRL.
        quantization_config: refused: load with `model_config=hf_rlhf.ModelConfig(load_in_4bit=True, ...)`.
        **kwargs: hf_rlhf's extras (`ref_model`, `model_config`, `compute_metrics`, ...).
    """

    config_class = RLOOConfig
    tag_names = ("hf_rlhf", "trl", "rloo")
    default_output_dir = "rloo-output"

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, **kwargs):
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, quantization_config=quantization_config,
                         peft_config=peft_config, **kwargs)

    def compute_rewards(self, prompts: list, completions: list, **columns) -> torch.Tensor:
        """The weighted reward, clamped to `reward_clip_range` (TRL: before the KL penalty; the logged `reward` is
        the unclamped one)."""
        rewards = super().compute_rewards(prompts, completions, **columns)
        clip = self.args.reward_clip_range
        return rewards if not clip else rewards.clamp(min=clip[0], max=clip[1])

    def _make_experience(self, rows, indices, refill=None):
        experience, stats = super()._make_experience(rows, indices, refill)
        if self.args.uses_reference:  # TRL's `kl`: Σ k1 over every rank's completion tokens / their count
            mask = experience.response_mask
            kl = masked_sum(experience.old_logprobs - experience.ref_logprobs, mask)
            totals = self.accelerator.reduce(torch.stack([kl.float(), mask.sum().float()]), reduction="sum")
            stats["kl"] = (totals[0] / totals[1].clamp(min=1.0)).item()
        return experience, stats
