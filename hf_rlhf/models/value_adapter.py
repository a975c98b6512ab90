"""PPO's value function as its own LoRA adapter ("value") on the policy's frozen base, plus a value head.

With LoRA the four PPO roles can share one frozen base (DESIGN.md, "Memory"):

    role        what runs                                                    trained
    policy      base + the policy adapter (the PeftModel's own, "default")   yes
    reference   base with every adapter off                                  no
    reward      base + reward adapter + its score head (`hf_rlhf.rewards.adapter`)   no
    value       base + value adapter ("value") + a value head                yes
                (or, by default, a value head on the policy's hidden states: no value adapter)

This module adds the value adapter; `PolicyAndValue` runs it under `hf_rlhf.models.adapters.adapter_scope`.
Activation checkpointing is not supported with a value adapter: the recomputation in backward would run under
whichever adapter is active then.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from accelerate.utils import is_peft_model
from torch import nn

from .adapters import set_adapter_requires_grad

VALUE_ADAPTER = "value"


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
    """Add the trainable adapter "value" to the policy `PeftModel` (the policy adapter stays active).

    Returns:
        The value adapter's name.

    Raises:
        ValueError: activation checkpointing is on, or the policy is not a `PeftModel`.
    """
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
    set_adapter_requires_grad(policy, VALUE_ADAPTER, True)
    return VALUE_ADAPTER
