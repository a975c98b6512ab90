"""`build_reward_source`: what a user passes as `reward_model` (a callable, a model, a path, a URL, an adapter),
turned into a reward source `(prompts, completions, **row_fields) -> (B,)`."""

from __future__ import annotations

from torch import nn
from transformers import AutoTokenizer

from ..models.loading import check_model_path, hub_errors
from ..models.value_head import load_reward_stats, reward_config_of
from .adapter import RewardAdapter, attach_reward_adapter
from .base import FunctionReward
from .http_client import HTTPReward
from .model import ModelReward, find_file, load_reward_model

ADAPTER_PREFIX = "adapter:"


def check_reward_model_path(reward_model) -> None:
    """Fail at once for a reward model given by a path that cannot be loaded (`check_model_path`: no such local
    directory, or a hub id not in the local hub cache while offline, or on a Hub that cannot be reached or has no
    such repo), so that a run fails before its policy is loaded. URLs, `adapter:` paths and anything that is not a
    path are left to `build_reward_source`.

    Raises:
        ModelUnavailableError: one line naming the path.
    """
    if isinstance(reward_model, str) and not reward_model.startswith(("http://", "https://", ADAPTER_PREFIX)):
        check_model_path(reward_model, "reward model")


def build_reward_source(reward_model, reward_processing_class=None, *, batch_size: int = 64, model_config=None,
                        device=None, policy=None, policy_tokenizer=None):
    """A reward source from what the user passed.

    Args:
        reward_model: a callable `(prompts, completions, **kwargs) -> list[float]`; a reward model (`nn.Module`);
            a path / hub id of a saved reward model (a sequence-classification model, a `ValueHeadModel`, or a LoRA
            reward adapter on its own base: see `hf_rlhf.rewards.model.reward_model_kind`); an `http://` /
            `https://` URL (an `HTTPReward` with its defaults); a LoRA reward adapter on the policy's base
            (`RewardAdapter(path)` or `"adapter:<path>"`); or a ready source (`FunctionReward`, `ModelReward`,
            `HTTPReward`, or any object with `is_reward_source = True`).
        reward_processing_class: the reward model's tokenizer (default: the one saved with the reward model, else
            its base's).
        batch_size: rows per reward-model forward.
        model_config: a `ModelConfig` for loading a path (dtype, attention).
        device: where to put a reward model.
        policy: the policy `PeftModel`, whose base a reward adapter runs on.
        policy_tokenizer: the policy's tokenizer (renders chat prompts for OpenRLHF's protocol; an adapter's
            default tokenizer).

    Raises:
        ValueError: a path that holds no reward model (the message lists what it holds).
        TypeError: anything else that is not a reward source.
    """
    if callable(getattr(reward_model, "build", None)) and getattr(reward_model, "is_reward_source", False):
        # several sources in one (`WeightedRewards`, TRL's reward_funcs list): each built as below
        return reward_model.build(reward_processing_class, batch_size=batch_size, model_config=model_config,
                                  device=device, policy=policy, policy_tokenizer=policy_tokenizer)
    if isinstance(reward_model, str) and reward_model.startswith(ADAPTER_PREFIX):
        reward_model = RewardAdapter(reward_model.removeprefix(ADAPTER_PREFIX))
    if isinstance(reward_model, RewardAdapter):
        return attach_reward_adapter(policy, reward_model, reward_processing_class or policy_tokenizer,
                                     batch_size=batch_size)
    if isinstance(reward_model, str) and reward_model.startswith(("http://", "https://")):
        reward_model = HTTPReward(reward_model)
    if isinstance(reward_model, HTTPReward) and reward_model.tokenizer is None:
        reward_model.tokenizer = reward_processing_class or policy_tokenizer
    if isinstance(reward_model, (FunctionReward, ModelReward)) or getattr(reward_model, "is_reward_source", False):
        return reward_model
    path, reward_stats = None, None
    if isinstance(reward_model, str):
        path, reward_model = reward_model, load_reward_model(reward_model, model_config)
        reward_stats = load_reward_stats(reward_model) or load_reward_stats(path)  # a LoRA adapter's are in its dir
    if isinstance(reward_model, nn.Module):
        if reward_processing_class is None:
            saved_with = path if path is not None and find_file(path, "tokenizer_config.json") else None
            tokenizer_path = saved_with or reward_config_of(reward_model)._name_or_path
            with hub_errors(tokenizer_path, "reward model tokenizer", filename="tokenizer_config.json"):
                reward_processing_class = AutoTokenizer.from_pretrained(tokenizer_path)
        if device is not None and getattr(reward_model, "hf_device_map", None) is None:
            reward_model = reward_model.to(device)
        return ModelReward(reward_model, reward_processing_class, batch_size=batch_size, reward_stats=reward_stats)
    if callable(reward_model):
        return FunctionReward(reward_model)
    raise TypeError(f"reward_model must be a callable, a reward model, a path, a URL or a RewardAdapter, got "
                    f"{type(reward_model).__name__}")
