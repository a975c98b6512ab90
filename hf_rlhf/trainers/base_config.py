"""`BaseConfig` pieces every trainer config shares: the non-finite options, device-dependent defaults,
the model options of a trainer config, `pad_to_multiple_of`.

Device-dependent defaults: `bf16` and `activation_checkpointing` (formerly
`gradient_checkpointing`) are left unset (`None`) and resolved in
`__post_init__`: on CUDA both are on (as in TRL); on CPU both are off, because bf16 autocast plus
gradient checkpointing ran SFT at 0.55-0.58x the fp32 speed on a 2-core CPU. Passing either
explicitly always wins.

Multi-process runs without CUDA set `use_cpu=True` (`torchrun`, or `accelerate launch` with the DDP config), or
`ddp_backend="gloo"` (DeepSpeed): only then does accelerate count the processes of the gloo group on CPU; without
it every process trains alone on all the data, and they all write the same output directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .option_ranges import check_option_ranges


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@dataclass
class NonFiniteOptions:
    """What every trainer does with a non-finite loss / grad norm (`hf_rlhf.training.nonfinite`), and how it is
    logged."""

    nonfinite_policy: str = field(
        default="stop", metadata={"help": "A NaN/inf loss or grad norm before an optimizer step: stop (save nothing "
                                          "from that step on) or skip (drop that step). "
                                          "See hf_rlhf.training.nonfinite.",
                                  "choices": ["stop", "skip"]},
    )
    logging_nan_inf_filter: bool = field(
        default=False, metadata={"help": "The Trainer's filter that logs a NaN/inf loss as the mean of the others "
                                         "(0 at a window's first step); off: a NaN loss is logged as NaN."},
    )


class DeviceDefaultsMixin:
    """Resolve `bf16` / `activation_checkpointing` left as None from the device (see module docstring)."""

    def _resolve_device_defaults(self):
        check_option_ranges(self)  # every config's __post_init__ starts here: options are checked before any work
        if self.bf16 is None:
            self.bf16 = (not self.fp16) and cuda_bf16_supported() and not self.use_cpu
        if self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = cuda_available() and not self.use_cpu
        if not cuda_available():
            self.dataloader_pin_memory = False  # pinning needs an accelerator; torch warns otherwise
            if _launched_multi_process():  # else accelerate counts 1 process: W lone runs on all the data
                if not _deepspeed_launch(self):
                    self.use_cpu = True  # accelerate's MULTI_CPU (gloo) group
                elif self.ddp_backend is None:
                    self.ddp_backend = "gloo"  # DeepSpeed's group is gloo on CPU; accelerate must be told to count it


def _launched_multi_process() -> bool:
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _deepspeed_launch(args) -> bool:
    # DeepSpeed runs on CPU through its own init (gloo); use_cpu would switch it off in TrainingArguments
    import os

    return bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


PAD_TO_MULTIPLE_OF_HELP = ("Pad batches to a multiple of this. 'auto' (TRL's default): no padding "
                           "(it pads on Neuron only).")


def resolve_pad_to_multiple_of(value, owner: str) -> int | None:
    """TRL's `pad_to_multiple_of` values: an int, None, "auto" (None: no Neuron here), or those as command-line
    strings."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "none", "null"):
            return None
        if not text.isdigit():
            raise ValueError(f"{owner}.pad_to_multiple_of must be an int, None or 'auto', got {value!r}.")
        value = int(text)
    if value is not None and value < 1:
        raise ValueError(f"{owner}.pad_to_multiple_of must be >= 1, got {value}.")
    return value


@dataclass
class TrainerModelOptions:
    """Options TRL's SFT and reward configs share for the model the trainer builds and trains (mixed into both).

    Args:
        model_init_kwargs: keyword arguments for `from_pretrained` when the trainer's `model` is a path (a dict, or
            JSON on the command line); they win over `ModelConfig`'s. Ignored, with a warning, for a built model.
        trust_remote_code: allow custom modelling code when the trainer loads the model or the tokenizer.
        activation_offloading: keep activations in CPU memory between the forward and the backward
            (`trl.models.activation_offloading`); needs CUDA.
    """

    model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when model is a path (dict or JSON)."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code when loading the model or tokenizer."}
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Offload activations to CPU memory between forward and backward (CUDA)."}
    )

    def _check_model_options(self):
        name = type(self).__name__
        for option in ("model_init_kwargs", "dataset_kwargs"):
            value = getattr(self, option, None)
            if isinstance(value, str) and not value.lstrip().startswith("{"):
                raise ValueError(f"{name}.{option} must be a dict (or a JSON object on the command line), got "
                                 f"{value!r}.")
        if self.activation_offloading and (not cuda_available() or self.use_cpu):
            raise ValueError(f"{name}.activation_offloading=True moves activations from the GPU to CPU memory; "
                             "without CUDA they are in CPU memory already. Set activation_offloading=False.")
        if self.activation_offloading and _deepspeed_launch(self):
            raise ValueError(f"{name}.activation_offloading is not supported with DeepSpeed (as in TRL); use "
                             "DeepSpeed's own offload_param / offload_optimizer settings.")
