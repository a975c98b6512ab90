"""`ModelConfig`: how to load a model (weights, dtype, attention, LoRA, 4/8-bit), a `trl.ModelConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

import trl

from ..imports import is_flash_attn_available
from .base_config import cuda_available
from .config_checks import check_field_types, renamed_options


def default_attn_implementation() -> str:
    """`flash_attention_2` when flash-attn is installed and CUDA is there, else `sdpa`."""
    return "flash_attention_2" if (cuda_available() and is_flash_attn_available()) else "sdpa"


@renamed_options("max_seq_length")
@dataclass
class ModelConfig(trl.ModelConfig):
    """How to load a model: weights, dtype, attention, LoRA adapters and bitsandbytes quantization.

    A `trl.ModelConfig` (every TRL option, same names) with what differs here:
    - `dtype` defaults to "float32", as TRL's: a checkpoint saved in bf16 (most hub models) is trained with fp32
      weights and mixed precision (`bf16=True` autocasts the compute). Pure-bf16 weights (`dtype="bfloat16"`, or
      "auto" for the saved dtype) halve the weights' memory, but updates smaller than bf16's resolution round away:
      at a 2e-5 learning rate a norm weight of 1.0 does not move. LoRA adapters and DeepSpeed's fp32 master weights
      are not affected either way.
    - `attn_implementation=None` resolves per device: flash_attention_2 with flash-attn on CUDA, else sdpa.
    - `lora_target_modules=None` means every linear layer but the head (peft's "all-linear"), not peft's per-model
      default (q_proj, v_proj on Llama).
    - `bnb_4bit_use_double_quant` (transformers' name) is accepted with TRL's `use_bnb_nested_quant`; either
      turns nested quantization on.
    - `bnb_4bit_compute_dtype` (None: bfloat16 on CUDA, float32 on CPU) and `trust_remote_code` are added.
    - a 4/8-bit base without `use_peft` is an error (it could not be trained).
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local path. None: the recipe's embedded toy model."}
    )
    # TRL's "float32": small updates survive in fp32 weights (bf16 rounds them away)
    dtype: str = field(
        default="float32",
        metadata={"help": "Weights dtype: float32 (default, as TRL), bfloat16, float16, or auto (as saved). bfloat16 "
                          "halves the weights' memory, but small full-fine-tuning updates round away in it.",
                  "choices": ["auto", "float32", "bfloat16", "float16"]},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "eager, sdpa or flash_attention_2. None: flash_attention_2 when flash-attn and CUDA "
                          "are available, else sdpa."},
    )
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt. None: all linear layers except the output head."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code from the Hub."})
    bnb_4bit_use_double_quant: bool = field(
        default=False, metadata={"help": "Quantize the quantization constants (TRL: use_bnb_nested_quant)."}
    )
    bnb_4bit_compute_dtype: str | None = field(
        default=None, metadata={"help": "Compute dtype of 4-bit layers. None: bfloat16 on CUDA, float32 on CPU."}
    )

    def __post_init__(self):
        check_field_types(self)
        # checked before TRL's __post_init__ so that the messages say what to do
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("ModelConfig: load_in_4bit and load_in_8bit cannot both be set.")
        if (self.load_in_4bit or self.load_in_8bit) and not self.use_peft:
            raise ValueError("ModelConfig: a 4/8-bit base cannot be trained in full; set use_peft=True (QLoRA).")
        super().__post_init__()  # one-element lora_target_modules ("all-linear", one module name) -> that string
        self.use_bnb_nested_quant = self.bnb_4bit_use_double_quant = (
            self.use_bnb_nested_quant or self.bnb_4bit_use_double_quant)
        if self.attn_implementation is None:
            self.attn_implementation = default_attn_implementation()
        elif self.attn_implementation.startswith("flash_attention") and not is_flash_attn_available():
            raise ImportError(
                f"attn_implementation={self.attn_implementation!r} needs flash-attn: pip install 'hf-rlhf[flash]' "
                "(CUDA only), or use attn_implementation='sdpa'."
            )
