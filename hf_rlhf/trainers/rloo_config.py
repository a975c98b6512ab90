"""`RLOOConfig`: trl 1.16's `RLOOConfig` (its fields, names and defaults) on `GRPOConfig`'s loop.

TRL's RLOOConfig is GRPOConfig's batches, generation, reward and logging options plus `normalize_advantages` and
`reward_clip_range`, without GRPO's loss options. So here it is a `GRPOConfig` with RLOO's defaults and RLOO's math
fixed, as `trl.RLOOTrainer` computes it (trl/trainer/rloo_trainer.py, `_generate_and_score_completions` and
`_compute_loss`):

- the leave-one-out baseline over the prompt's `num_generations` completions (default 2, TRL's), optionally
  whitened over the batch (`normalize_advantages`);
- the KL in the reward, `beta` (default 0.05, TRL's) x the response's summed k1 estimate log(π_old / π_ref), taken
  from the rollout's log-probs and subtracted from each score before the baseline (GRPO puts β·k3 in the loss);
- the sequence-level ratio exp(Σ_t log π - Σ_t log π_old), clipped at 1 - epsilon / 1 + epsilon_high, the loss a
  mean over sequences;
- `reward_clip_range=(min, max)`: the weighted reward clamped before the KL penalty.

GRPOConfig options that TRL's RLOOConfig does not have (`loss_type`, `scale_rewards`, `importance_sampling_level`,
`delta`, `entropy_coef`, ...: `GRPO_ONLY`) are refused when set, as TRL refuses an unknown keyword; hf_rlhf's own
PPOConfig options (`generation_backend`, `kl_target`, ...) work as for GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import trl

from .grpo_config import GRPOConfig

# TRL's GRPOConfig fields its RLOOConfig lacks: set here only to RLOO's fixed values
GRPO_ONLY = frozenset(f.name for f in fields(trl.GRPOConfig)) - frozenset(f.name for f in fields(trl.RLOOConfig))


@dataclass
class RLOOConfig(GRPOConfig):
    """trl 1.16's `RLOOConfig`: every field under its name with TRL's default (see the module docstring for the
    math they select); a `GRPOConfig` underneath.

    Args:
        normalize_advantages: whiten the advantages over the generation batch (mean 0, std 1; TRL's).
        reward_clip_range: (min, max) for the weighted reward before the KL penalty; None: no clipping.
    """

    advantage_estimator: str = field(default="rloo", metadata={"help": "RLOO's leave-one-out baseline."})
    num_generations: int | None = field(default=2, metadata={"help": "Completions per prompt (TRL's RLOO: 2)."})
    beta: float = field(default=0.05, metadata={"help": "KL coefficient in the reward (TRL's RLOO: 0.05)."})
    kl_coef: float = field(default=0.05, metadata={"help": "β: TRL's `beta`."})
    kl_in_loss: bool = field(default=False, metadata={"help": "RLOO: the KL is in the reward, not the loss."})
    kl_estimator: str = field(default="k1", metadata={"help": "RLOO: the first-order log-ratio, summed."})
    importance_sampling_level: str = field(
        default="sequence_sum", metadata={"help": "RLOO: one ratio per response, exp(Σ log π - Σ log π_old)."})
    loss_type: str = field(default="grpo", metadata={"help": "RLOO: the mean over sequences of their loss."})
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clip range for rewards as (min, max). If None, no clipping is applied."})

    def __post_init__(self):
        defaults = {f.name: f.default for f in fields(self)}
        for name in sorted(GRPO_ONLY):
            if name in defaults and getattr(self, name) != defaults[name]:
                raise ValueError(f"RLOOConfig.{name}={getattr(self, name)!r}: trl's RLOOConfig has no option "
                                 f"{name!r} (RLOO's loss and KL are fixed: see hf_rlhf.trainers.rloo_config). Use "
                                 "GRPOConfig(advantage_estimator='rloo', ...) to combine RLOO with GRPO's options.")
        if self.reward_clip_range is not None:
            if isinstance(self.reward_clip_range, str):  # from the command line: "min,max"
                self.reward_clip_range = tuple(float(v) for v in self.reward_clip_range.split(","))
            low, high = (float(v) for v in self.reward_clip_range)
            if not low <= high:
                raise ValueError(f"RLOOConfig.reward_clip_range must be (min, max) with min <= max, got "
                                 f"{self.reward_clip_range!r}")
            self.reward_clip_range = (low, high)
        super().__post_init__()

