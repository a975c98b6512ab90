"""PPO: its math as pure tensor functions, and the pieces `PPOTrainer` runs in the Trainer's loop.

Math (importable with torch alone; the tensor helpers they share live in `hf_rlhf.tensors`):
    kl.py               KL penalty estimators, `FixedKLController`, `AdaptiveKLController`
    advantages.py       per-token rewards with the KL penalty, GAE
    critic_free.py      GRPO / RLOO / REINFORCE++ advantages, whitening, loss aggregation (`loss_type`)
    losses.py           clipped policy and value losses
    running_moments.py  `RunningMoments`: running reward statistics for `reward_normalization="running"`

Loop pieces (import transformers / trl / datasets / peft):
    config.py           `PPOConfig`
    experience.py       `Experience`: what a rollout hands to `compute_loss`
    loader.py           `ExperienceLoader`: the Trainer's train dataloader (rollouts), prompt dataset preparation
    rollout.py          `RolloutMaker`: generate, score, reference, rewards, advantages
    policy_value.py     `PolicyAndValue`: policy + value function as the one trained module; saving and loading
    value_adapter.py    `ValueAdapter`: the value function as a LoRA adapter on the policy's base
    callbacks.py        KL controller and reward statistics as checkpointed callbacks; the logged-epoch fix

The reward sources PPO scores with are `hf_rlhf.rewards`.
"""

from ..imports import lazy_exports
from .advantages import gae, per_token_rewards
from .critic_free import (
    LOSS_TYPES,
    SCALE_REWARDS,
    aggregate_loss,
    broadcast_to_tokens,
    grpo_advantages,
    informative_groups,
    reinforce_pp_advantages,
    rloo_advantages,
    truncated_loss_mask,
    whiten_advantages,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .losses import (IMPORTANCE_SAMPLING_LEVELS, importance_log_weights, policy_loss, policy_loss_per_token,
                     value_loss)
from .running_moments import RunningMoments

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "aggregate_loss",
    "broadcast_to_tokens",
    "gae",
    "grpo_advantages",
    "importance_log_weights",
    "informative_groups",
    "kl_penalty",
    "per_token_rewards",
    "policy_loss",
    "policy_loss_per_token",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "truncated_loss_mask",
    "value_loss",
    "whiten_advantages",
]

# The loop pieces import transformers / trl / datasets / peft, so they load on first use: `import hf_rlhf.ppo.kl`
# (or the math above) must stay torch-only.
_LAZY = {
    "PPOConfig": ".config",
    "Experience": ".experience",
    "PolicyAndValue": ".policy_value",
    "RolloutMaker": ".rollout",
    "ExperienceLoader": ".loader",
    "prepare_prompt_dataset": ".loader",
    "ValueAdapter": ".value_adapter",
    "KLControllerCallback": ".callbacks",
    "RewardStatsCallback": ".callbacks",
    "EpochFromStepCallback": ".callbacks",
}
__all__ += sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
