"""The package imports on a CPU machine without any extra, and names the extra when one is missing."""

import subprocess
import sys

import pytest

from hf_rlhf.imports import require


def test_public_names_import_without_optional_extras():
    # simulate a machine where none of the extras is installed: their imports fail
    code = (
        "import sys\n"
        "for name in ('bitsandbytes', 'deepspeed', 'flash_attn', 'matplotlib'):\n"
        "    sys.modules[name] = None  # import fails, importlib.util.find_spec returns None\n"
        "import hf_rlhf\n"
        "from hf_rlhf import (SFTTrainer, SFTConfig, RewardTrainer, RewardConfig, ModelConfig,\n"
        "                     AdaptiveKLController, FixedKLController, PPOTrainer, PPOConfig)\n"
        "from hf_rlhf.collators import PackingCollator, LeftPaddingCollator, PairwiseCollator\n"
        "from hf_rlhf.models.loading import quantization_config\n"
        "try:\n"
        "    quantization_config(ModelConfig(use_peft=True, load_in_4bit=True))\n"
        "except ImportError as e:\n"
        "    assert \"hf-rlhf[qlora]\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('4-bit loading without bitsandbytes did not fail')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bare_import_is_light():
    code = "import sys, hf_rlhf; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_optional_dependency_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'hf-rlhf\[flash\]'"):
        require("flash_attn", "flash attention")
    with pytest.raises(ImportError, match="pip install not_a_module_xyz"):
        require("not_a_module_xyz", "something")


def test_unknown_attribute():
    import hf_rlhf

    with pytest.raises(AttributeError):
        hf_rlhf.NotAThing  # noqa: B018
