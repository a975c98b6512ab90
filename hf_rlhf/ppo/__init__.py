"""PPO math as pure tensor functions: KL penalty and controllers, rewards and GAE, clipped losses.

Importable with torch alone; the tensor helpers they share live in `hf_rlhf.tensors`.
"""

from .advantages import gae, per_token_rewards
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from .losses import policy_loss, value_loss

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "gae",
    "kl_penalty",
    "per_token_rewards",
    "policy_loss",
    "value_loss",
]
