"""Switching the adapters of a `PeftModel` that several roles share (PPO's policy, value and reward adapters).

peft's `set_adapter` / `disable_adapter` also flip `requires_grad` (the adapter switched to becomes trainable,
every other one frozen), so every switch goes through `adapter_scope`, which puts back the active adapter AND every
parameter's `requires_grad` on exit. Whether a model is a `PeftModel` at all: `accelerate.utils.is_peft_model`.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

from torch import nn


def adapter_parameter_names(model: nn.Module, adapter: str) -> list[str]:
    """Names of `adapter`'s own LoRA parameters in `model.named_parameters()` (e.g. `...q_proj.lora_A.value.weight`).

    Args:
        model: a `PeftModel`, or a module holding one (the names keep the module's own prefix).
        adapter: the adapter's name.

    Returns:
        The parameter names, in `named_parameters()` order.
    """
    pattern = re.compile(rf"\.lora_\w+\.{re.escape(adapter)}(\.|$)")
    return [name for name, _ in model.named_parameters() if pattern.search(name)]


def set_adapter_requires_grad(model: nn.Module, adapter: str, requires_grad: bool) -> None:
    """Set `requires_grad` of `adapter`'s own LoRA parameters in `model` (every other parameter left as it is).

    Args:
        model: a `PeftModel`, or a module holding one.
        adapter: the adapter's name.
        requires_grad: the flag to set.
    """
    for name in adapter_parameter_names(model, adapter):
        model.get_parameter(name).requires_grad_(requires_grad)


@contextmanager
def adapter_scope(model: nn.Module, adapter: str | None):
    """Run the `PeftModel` `model` with only `adapter` active (None: every adapter off), then restore it.

    On exit (an exception included) the previously active adapter is active again and every parameter has the
    `requires_grad` it had on entry (peft's own switches change it).

    Args:
        model: a `PeftModel`.
        adapter: the adapter to run with, or None for the base alone.
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


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The `PreTrainedModel` inside a `PeftModel` (the model itself otherwise); never imports peft."""
    import sys

    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model
