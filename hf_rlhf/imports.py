"""Optional dependencies: availability checks and imports that name the extra to install."""

from __future__ import annotations

import importlib
import importlib.util

# module name -> the hf-rlhf extra that installs it
_EXTRAS = {
    "bitsandbytes": "qlora",
    "deepspeed": "deepspeed",
    "flash_attn": "flash",
    "matplotlib": "plot",
    "psutil": "bench",
}


def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_flash_attn_available() -> bool:
    return is_available("flash_attn")


def require(module: str, feature: str):
    """Import an optional module, or raise an ImportError that says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = _EXTRAS.get(module)
        hint = f"pip install 'hf-rlhf[{extra}]'" if extra else f"pip install {module}"
        raise ImportError(f"{feature} needs the optional package '{module}': {hint}") from err
