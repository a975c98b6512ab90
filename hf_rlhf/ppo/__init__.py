"""PPO math as pure tensor functions: KL penalty and controllers, rewards and GAE, critic-free advantages, losses.

Importable with torch alone; the tensor helpers they share live in `hf_rlhf.tensors`.
"""

from .advantages import gae, per_token_rewards
from .critic_free import (
    LOSS_TYPES,
    SCALE_REWARDS,
    aggregate_loss,
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten_advantages,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .losses import policy_loss, value_loss

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "broadcast_to_tokens",
    "gae",
    "grpo_advantages",
    "kl_penalty",
    "per_token_rewards",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "value_loss",
    "whiten_advantages",
]

# The trainer-side pieces import transformers / trl / datasets, so they load on first use: `import hf_rlhf.ppo.kl`
# (or the math above) must stay torch-only.
_LAZY = {
    "PPOConfig": "config",
    "Experience": "experience",
    "PolicyAndValue": "policy_value",
    "RolloutMaker": "rollout",
    "ExperienceLoader": "loader",
    "prepare_prompt_dataset": "loader",
    "build_reward_source": "rewards",
    "FunctionReward": "rewards",
    "ModelReward": "rewards",
    "RewardError": "rewards",
    "RunningMoments": "rewards",
    "HTTPReward": "http_reward",
    "RewardServer": "reward_server",
    "RewardAdapter": "shared_base",
    "ValueAdapter": "shared_base",
    "KLControllerCallback": "callbacks",
    "RewardStatsCallback": "callbacks",
    "EpochFromStepCallback": "callbacks",
}
__all__ += sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(__import__(f"{__name__}.{_LAZY[name]}", fromlist=[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
