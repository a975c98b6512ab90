"""`hf-rlhf env`: the versions and the device to paste into a bug report (as `trl env` prints them)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "deepspeed", "bitsandbytes")


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def devices() -> str:
    """The accelerator(s) torch sees, or "cpu"."""
    import torch

    if torch.cuda.is_available():
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    if torch.backends.mps.is_available():
        return "MPS"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return ", ".join(torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count()))
    return "cpu"


def environment() -> dict[str, str]:
    """{what: version} of the platform, Python, hf_rlhf, the Hugging Face stack and the device."""
    import os

    from accelerate.commands.config import default_config_file

    info = {"Platform": platform.platform(), "Python version": platform.python_version(),
            "hf_rlhf version": package_version("hf-rlhf")}
    info.update({f"{name} version": package_version(name) for name in PACKAGES})
    info["accelerator(s)"] = devices()
    info["CPU cores"] = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    info["Accelerate default config"] = default_config_file if os.path.isfile(default_config_file) else "not found"
    return info


def print_env() -> None:
    info = "\n".join(f"- {what}: {value}" for what, value in environment().items())
    print(f"\nCopy-paste the following information when reporting an issue:\n\n{info}\n")
