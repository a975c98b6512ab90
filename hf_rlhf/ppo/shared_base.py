"""PPO's four roles on ONE frozen base model, as LoRA adapters of the policy's `PeftModel` (DESIGN.md, "Memory").

    role        what runs                                                    trained
    policy      base + the policy adapter (the PeftModel's own, "default")   yes
    reference   base with every adapter off                                  no
    reward      base + reward adapter ("reward") + its score head            no
    value       base + value adapter ("value") + a value head                yes
                (or, by default, a value head on the policy's hidden states: no value adapter)

The base weights are in memory once (optionally 4-bit: `ModelConfig(load_in_4bit=True)`); each role is an
adapter switch. peft's `set_adapter` / `disable_adapter` also flip `requires_grad` (the adapter switched to becomes
trainable, every other one frozen), so every switch here goes through `adapter_scope`, which puts back the active
adapter AND every parameter's `requires_grad` on exit: after scoring, the policy adapter is active again and only
the policy / value trainables require grad.

The reward adapter is what `RewardTrainer` saves for a LoRA reward model trained on the same base checkpoint:
`adapter_config.json` + `adapter_model.safetensors`, with the score head either inside it (a sequence-classification
model, whose `score` peft saves through `modules_to_save`) or next to it in `value_head.safetensors` (a
`ValueHeadModel`). Its LoRA weights are loaded as a second adapter of the policy; its head is applied to the base's
last hidden states (after the final norm, as in `LlamaForSequenceClassification`) with the reward adapter active.
The reward is only that of the trained reward model if the policy's base has the weights the reward adapter was
trained on (the usual chain: SFT checkpoint -> reward adapter on it; PPO from the same SFT checkpoint).

Activation checkpointing is not supported with a value adapter: the recomputation in backward would run under
whichever adapter is active then. The one-base roles are not tested under DeepSpeed ZeRO-3 (the reward runs the
backbone outside the engine's forward).
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..reward_models import backbone_of, gather_last_token_scores, load_reward_stats, unwrap_peft
from .rewards import TokenizedReward

logger = logging.getLogger("hf_rlhf")

REWARD_ADAPTER = "reward"
VALUE_ADAPTER = "value"
_HEAD_NAMES = ("score", "classifier")


def is_peft_model(model) -> bool:
    return unwrap_peft(model) is not model


def adapter_parameter_names(model: nn.Module, adapter: str) -> list[str]:
    """Names of `adapter`'s own parameters in `model.named_parameters()` (e.g. `...q_proj.lora_A.value.weight`)."""
    pattern = re.compile(rf"\.lora_\w+\.{re.escape(adapter)}(\.|$)")
    return [name for name, _ in model.named_parameters() if pattern.search(name)]


@contextmanager
def adapter_scope(model: nn.Module, adapter: str | None):
    """Run the `PeftModel` `model` with only `adapter` active (None: every adapter off), then restore it.

    On exit the previously active adapter is active again and every parameter has the `requires_grad` it had on
    entry (peft's own switches change it).
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    previous = model.active_adapter
    try:
        if adapter is None:
            with model.disable_adapter():
                yield model
        elif adapter == previous:
            yield model
        else:
            model.set_adapter(adapter)
            try:
                yield model
            finally:
                model.set_adapter(previous)
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


# ---------------------------------------------------------------------------------------------------
# The reward: an adapter of the policy + the reward model's head


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
    from peft import PeftConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    if policy is None or not is_peft_model(policy):
        raise ValueError("a RewardAdapter runs on the policy's own base, so the policy must be a LoRA PeftModel: pass "
                         "peft_config (or ModelConfig(use_peft=True)); for a reward on a separate model load it as "
                         "PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base, "
                         "num_labels=1), path) and pass that")
    weights_file = os.path.join(spec.path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise FileNotFoundError(f"{weights_file} not found: {spec.path} is not a LoRA reward adapter directory")
    config = PeftConfig.from_pretrained(spec.path)
    if config.peft_type != policy.peft_config[policy.active_adapter].peft_type:
        raise ValueError(f"the reward adapter is {config.peft_type}, the policy's is "
                         f"{policy.peft_config[policy.active_adapter].peft_type}; both must be LoRA")
    _warn_if_other_base(policy, config, spec.path)
    state = load_file(weights_file)
    head_state = {key: value for key, value in state.items() if _head_key(key) is not None}
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
    for name in adapter_parameter_names(policy, REWARD_ADAPTER):
        policy.get_parameter(name).requires_grad_(False)

    hidden = unwrap_peft(policy).config.get_text_config().hidden_size
    head = _load_head(spec.path, head_state, hidden).to(next(backbone_of(policy).parameters()).device)
    reward_stats = load_reward_stats(spec.path)
    return AdapterReward(policy, head, tokenizer, batch_size, reward_stats, name=f"reward adapter {spec.path}")


def _head_key(key: str) -> str | None:
    """'weight' / 'bias' for a key of the sequence-classification head saved in an adapter file, else None."""
    parts = key.split(".")
    if "lora_" in key or len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return None
    owners = [p for p in parts[:-1] if p not in ("base_model", "model", "modules_to_save", "original_module")]
    return parts[-1] if owners and owners[-1] in _HEAD_NAMES and len(owners) == 1 else None


def _load_head(path: str, head_state: dict, hidden: int) -> nn.Linear:
    from safetensors.torch import load_file

    value_head_file = os.path.join(path, "value_head.safetensors")
    if os.path.isfile(value_head_file):  # a ValueHeadModel reward: v_head.weight / v_head.bias
        state = {key.removeprefix("v_head."): value for key, value in load_file(value_head_file).items()}
    else:
        state = {_head_key(key): value for key, value in head_state.items()}
    if "weight" not in state:
        raise ValueError(f"no score head in {path}: expected `score` saved through modules_to_save (a LoRA "
                         "sequence-classification reward from RewardTrainer) or value_head.safetensors")
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


# ---------------------------------------------------------------------------------------------------
# The value: an adapter of the policy + a value head


@dataclass
class ValueAdapter:
    """The value function as its own LoRA adapter ("value") on the policy's base, plus a value head.

    Args:
        peft_config: the value adapter's `LoraConfig` (default: the policy adapter's, as a fresh adapter).
    """

    peft_config: object | None = None


def resolve_value_adapter(value_model) -> ValueAdapter | None:
    """`value_model="adapter"` or a `ValueAdapter` -> the spec; anything else -> None."""
    if isinstance(value_model, ValueAdapter):
        return value_model
    if isinstance(value_model, str) and value_model == "adapter":
        return ValueAdapter()
    return None


def add_value_adapter(policy: nn.Module, spec: ValueAdapter, activation_checkpointing: bool = False) -> str:
    """Add the trainable adapter "value" to the policy `PeftModel` (policy adapter stays active); its name."""
    import copy

    if activation_checkpointing:  # the recomputation in backward would run under whichever adapter is active then
        raise ValueError("value_model='adapter' does not work with activation_checkpointing (the recomputed forward "
                         "would not run under the value adapter); turn one of them off")
    if not is_peft_model(policy):
        raise ValueError("value_model='adapter' puts the value function on the policy's base as a LoRA adapter, so "
                         "the policy must be a PeftModel: pass peft_config (or ModelConfig(use_peft=True))")
    config = copy.deepcopy(spec.peft_config if spec.peft_config is not None
                           else policy.peft_config[policy.active_adapter])
    config.inference_mode = False
    policy.add_adapter(VALUE_ADAPTER, config)
    for name in adapter_parameter_names(policy, VALUE_ADAPTER):
        policy.get_parameter(name).requires_grad_(True)
    return VALUE_ADAPTER
