"""A LoRA reward adapter run on the policy's own frozen base: PPO's reward role at no extra base weights.

The reward adapter is what `RewardTrainer` saves for a LoRA reward model trained on the same base checkpoint:
`adapter_config.json` + `adapter_model.safetensors`, with the score head either inside it (a sequence-classification
model, whose `score` peft saves through `modules_to_save`) or next to it in `value_head.safetensors` (a
`ValueHeadModel`). Its LoRA weights are loaded as a second, frozen adapter ("reward") of the policy's `PeftModel`;
its head is applied to the base's last hidden states (after the final norm, as in `LlamaForSequenceClassification`)
with the reward adapter active, switched in and out with `hf_rlhf.models.adapters.adapter_scope`.

The reward is only that of the trained reward model if the policy's base has the weights the reward adapter was
trained on (the usual chain: SFT checkpoint -> reward adapter on it; PPO from the same SFT checkpoint). Not tested
under DeepSpeed ZeRO-3 (the reward runs the backbone outside the engine's forward). To score with the same adapter
on a base of its own instead, pass its path: `hf_rlhf.rewards.model.load_reward_model`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from accelerate.utils import is_peft_model
from peft import PeftConfig, set_peft_model_state_dict
from peft.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file
from torch import nn

from ..models.adapters import adapter_scope, set_adapter_requires_grad, unwrap_peft
from ..models.loading import hub_errors
from ..models.value_head import VALUE_HEAD_FILE, backbone_of, gather_last_token_scores, load_reward_stats
from .base import TokenizedReward

logger = logging.getLogger("hf_rlhf")

REWARD_ADAPTER = "reward"
HEAD_NAMES = ("score", "classifier")


@dataclass
class RewardAdapter:
    """A LoRA reward model saved by `RewardTrainer`, to run on the policy's own frozen base.

    Args:
        path: the adapter directory (`adapter_config.json`, `adapter_model.safetensors`; the score head inside it
            through `modules_to_save`, or in `value_head.safetensors`; `reward_stats.json` when stored).
    """

    path: str


class AdapterReward(TokenizedReward):
    """Reward source: base + reward adapter + score head, scored at each sequence's last real token.

    Built by `attach_reward_adapter`; `policy` is the shared `PeftModel`, `head` a frozen `Linear(hidden, 1)`.
    """

    def __init__(self, policy: nn.Module, head: nn.Linear, tokenizer, batch_size: int = 64, reward_stats=None,
                 name: str = "reward adapter"):
        super().__init__(tokenizer, batch_size)
        self.policy, self.head, self.reward_stats, self.name = policy, head, reward_stats, name

    @property
    def device(self) -> torch.device:
        return next(backbone_of(self.policy).parameters()).device

    def score_batch(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        training = self.policy.training
        self.policy.eval()  # the reward adapter's own dropout stays off
        try:
            with adapter_scope(self.policy, REWARD_ADAPTER):
                hidden = backbone_of(self.policy)(input_ids=input_ids, attention_mask=attention_mask,
                                                  position_ids=position_ids, use_cache=False).last_hidden_state
        finally:
            self.policy.train(training)
        if self.head.weight.device != hidden.device:  # the Trainer may have moved the policy after we were built
            self.head.to(hidden.device)
        scores = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()
        return gather_last_token_scores(scores, attention_mask=attention_mask)


def attach_reward_adapter(policy: nn.Module, spec: RewardAdapter, tokenizer, batch_size: int = 64) -> AdapterReward:
    """Load `spec`'s LoRA weights as the frozen adapter "reward" of `policy`, and its head; return the source.

    Raises:
        ValueError: the policy is not a `PeftModel`, the adapter is not LoRA, or its weights or head do not fit.
        FileNotFoundError: no adapter in `spec.path`.
    """
    if policy is None or not is_peft_model(policy):
        raise ValueError("a RewardAdapter runs on the policy's own base, so the policy must be a LoRA PeftModel: pass "
                         "peft_config (or ModelConfig(use_peft=True)); for a reward adapter on a base of its own, "
                         "pass its path as reward_model (loaded as a PeftModel of its reward model)")
    weights_file = os.path.join(spec.path, SAFETENSORS_WEIGHTS_NAME)
    if not os.path.isfile(weights_file):
        raise FileNotFoundError(f"{weights_file} not found: {spec.path} is not a LoRA reward adapter directory")
    with hub_errors(spec.path, "reward adapter", filename="adapter_config.json"):
        config = PeftConfig.from_pretrained(spec.path)
    if config.peft_type != policy.peft_config[policy.active_adapter].peft_type:
        raise ValueError(f"the reward adapter is {config.peft_type}, the policy's is "
                         f"{policy.peft_config[policy.active_adapter].peft_type}; both must be LoRA")
    _warn_if_other_base(policy, config, spec.path)
    state = load_file(weights_file)
    head_state = {key: value for key, value in state.items() if score_head_key(key) is not None}
    lora_state = {key: value for key, value in state.items() if key not in head_state}

    # frozen and inference-only: no dropout, no modules_to_save (the head lives outside the PeftModel)
    config.modules_to_save, config.lora_dropout, config.inference_mode = None, 0.0, True
    config.task_type = policy.peft_config[policy.active_adapter].task_type
    policy.add_adapter(REWARD_ADAPTER, config)
    result = set_peft_model_state_dict(policy, lora_state, adapter_name=REWARD_ADAPTER)
    missing = [key for key in getattr(result, "missing_keys", []) if f".{REWARD_ADAPTER}." in key]
    unexpected = list(getattr(result, "unexpected_keys", []))
    if missing or unexpected:
        raise ValueError(f"the reward adapter in {spec.path} does not fit the policy's base: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    set_adapter_requires_grad(policy, REWARD_ADAPTER, False)

    hidden = unwrap_peft(policy).config.get_text_config().hidden_size
    head = _load_head(spec.path, head_state, hidden).to(next(backbone_of(policy).parameters()).device)
    reward_stats = load_reward_stats(spec.path)
    return AdapterReward(policy, head, tokenizer, batch_size, reward_stats, name=f"reward adapter {spec.path}")


def score_head_key(key: str) -> str | None:
    """'weight' / 'bias' for a key of a sequence-classification head saved in an adapter file, else None.

    >>> score_head_key("base_model.model.score.weight")
    'weight'
    >>> score_head_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") is None
    True
    """
    parts = key.split(".")
    if "lora_" in key or len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return None
    owners = [p for p in parts[:-1] if p not in ("base_model", "model", "modules_to_save", "original_module")]
    return parts[-1] if owners and owners[-1] in HEAD_NAMES and len(owners) == 1 else None


def _load_head(path: str, head_state: dict, hidden: int) -> nn.Linear:
    value_head_file = os.path.join(path, VALUE_HEAD_FILE)
    if os.path.isfile(value_head_file):  # a ValueHeadModel reward: v_head.weight / v_head.bias
        state = {key.removeprefix("v_head."): value for key, value in load_file(value_head_file).items()}
    else:
        state = {score_head_key(key): value for key, value in head_state.items()}
    if "weight" not in state:
        raise ValueError(f"no score head in {path}: expected `score` saved through modules_to_save (a LoRA "
                         f"sequence-classification reward from RewardTrainer) or {VALUE_HEAD_FILE}")
    if tuple(state["weight"].shape) != (1, hidden):
        raise ValueError(f"the score head in {path} has shape {tuple(state['weight'].shape)}; the policy's base "
                         f"needs (1, {hidden}) (num_labels=1, the base's hidden size)")
    head = nn.Linear(hidden, 1, bias="bias" in state, dtype=state["weight"].dtype)
    head.load_state_dict(state)
    return head.requires_grad_(False)


def _warn_if_other_base(policy, config, path: str) -> None:
    mine = getattr(unwrap_peft(policy).config, "_name_or_path", "") or ""
    theirs = config.base_model_name_or_path or ""
    if mine and theirs and os.path.normpath(mine) != os.path.normpath(theirs):
        logger.warning("the reward adapter %s was trained on %s, but the policy's base is %s: the reward is the "
                       "trained reward model's only if both hold the same weights", path, theirs, mine)
