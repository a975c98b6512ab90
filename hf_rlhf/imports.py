"""Optional dependencies: availability checks and imports that name the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
import sys

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


def lazy_exports(package: str, table: dict[str, str]):
    """`(__getattr__, __dir__)` for a package whose public names load on first use.

    Args:
        package: the package's `__name__`.
        table: public name -> the module that defines it, absolute or relative to `package` (".rollout").

    Usage, in the package's `__init__.py`: `__getattr__, __dir__ = lazy_exports(__name__, _LAZY)`.
    """

    def __getattr__(name: str):
        if name in table:
            module = table[name]
            return getattr(importlib.import_module(package + module if module.startswith(".") else module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
