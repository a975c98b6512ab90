"""Configuration dataclasses.

`ModelConfig` says how to load a model (dtype, attention, LoRA, 4/8-bit). The trainer configs are
`transformers.TrainingArguments` subclasses, so every Trainer option (optimizer, scheduler, logging,
checkpoints, DeepSpeed, ...) works unchanged. Option names follow TRL where TRL has the same option.

Dataset preparation reads a `DataOptions` (`SFTDataOptions` for SFT data, `PreferenceDataOptions` for pairs);
`SFTConfig` and `RewardConfig` inherit those, so a trainer config is passed to `hf_rlhf.data` as is, and code
without a trainer config (PPO's ptx data, tests) builds a plain `DataOptions`.

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

from dataclasses import dataclass, field, fields

import trl
from transformers import TrainingArguments

from .config_checks import check_field_types, renamed_options
from .imports import is_flash_attn_available
from .option_ranges import check_option_ranges


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def default_attn_implementation() -> str:
    """`flash_attention_2` when flash-attn is installed and CUDA is there, else `sdpa`."""
    return "flash_attention_2" if (_cuda_available() and is_flash_attn_available()) else "sdpa"


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


# ---------------------------------------------------------------------------------------------------
# Data options: what dataset preparation reads (`hf_rlhf.data.prepare_sft_dataset` /
# `prepare_preference_dataset`). The trainer configs inherit them, so a config is itself a data options object.

OVERLONG_CHOICES = ["truncate", "drop", "error"]
PROMPT_TOKENIZATION_CHOICES = ["apart", "joint"]  # as `hf_rlhf.data.tokenization.PROMPT_TOKENIZATIONS`


@dataclass
class InputCheckOptions:
    """How strict the up-front input checks are (`hf_rlhf.data.check_unknown_tokens`); in every trainer config.

    Args:
        max_unk_share: a row with more than this share of the tokenizer's unknown token cannot be represented by it.
        strict: such rows are an error (naming the first); else their count is logged as a warning.
    """

    max_unk_share: float = field(
        default=0.1, metadata={"help": "Largest share of unknown tokens a row may have before it is reported."})
    strict: bool = field(default=False, metadata={"help": "Rows above max_unk_share are an error, not a warning."})


@renamed_options("max_seq_length")
@dataclass
class DataOptions(InputCheckOptions):
    """Dataset preparation options shared by SFT and reward data (mixed into `SFTConfig` and `RewardConfig`).

    Usable alone where no trainer config exists, e.g. `DataOptions(max_length=None)` for PPO's ptx data.

    Args:
        dataset_num_proc: processes for `Dataset.map` while tokenizing; None: this process only.
        max_length: longest tokenized sequence; None: no limit.
        overlong_policy: a sequence longer than `max_length`: `truncate` (keep the start), `drop`, or `error`.
        chat_template_path: a tokenizer directory or a Jinja file whose template replaces the tokenizer's one.
        eos_token: the token appended to plain text; None: the tokenizer's eos token.
        pad_token: the padding token; None: the tokenizer's (read by the trainers, `ensure_pad_token`).
        prompt_tokenization: the prompt / completion boundary of plain-text prompt data where tokens merge across
            it (a prompt ending in a space: "3+4? " + "7"). `apart` (default): the prompt's own tokens, then the
            completion's, as the model sees them at inference. `joint`: prompt + completion tokenized as one text,
            the completion starting where its tokens diverge from the prompt's own: TRL's, to reproduce TRL's losses
            exactly. The number of rows it changes is logged once per dataset (in memory; a stream is not counted
            ahead). Conversations go through the chat template either way; for SFT's conversational prompt /
            completion rows whose template renders the prompt differently when a completion follows, `apart` is an
            error naming the row, `joint` starts the completion where they diverge (TRL's).
    """

    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preparation."})
    max_length: int | None = field(default=1024, metadata={"help": "Longest tokenized sequence."})
    overlong_policy: str = field(
        default="truncate",
        metadata={"help": "Sequences longer than max_length: truncate (keep the start), drop, or error.",
                  "choices": OVERLONG_CHOICES},
    )
    chat_template_path: str | None = field(default=None, metadata={"help": "Tokenizer dir or Jinja file."})
    eos_token: str | None = field(default=None, metadata={"help": "End-of-sequence token. None: the tokenizer's."})
    pad_token: str | None = field(default=None, metadata={"help": "Padding token. None: the tokenizer's."})
    prompt_tokenization: str = field(
        default="apart",
        metadata={"help": "Where tokens merge across the prompt/completion boundary: apart (as at inference) or "
                          "joint (TRL's tokenization, its losses exactly).", "choices": PROMPT_TOKENIZATION_CHOICES},
    )

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self, TrainingArguments):  # a trainer config checked every field already
            check_field_types(self)
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"{name}.max_length must be >= 2, got {self.max_length}.")
        if not 0 <= self.max_unk_share <= 1:
            raise ValueError(f"{name}.max_unk_share must be in [0, 1], got {self.max_unk_share}.")
        if self.overlong_policy not in OVERLONG_CHOICES:
            raise ValueError(f"{name}.overlong_policy={self.overlong_policy!r}; expected one of {OVERLONG_CHOICES}.")
        if self.prompt_tokenization not in PROMPT_TOKENIZATION_CHOICES:
            raise ValueError(f"{name}.prompt_tokenization={self.prompt_tokenization!r}; expected one of "
                             f"{PROMPT_TOKENIZATION_CHOICES}.")
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # mixed into a TrainingArguments: its own __post_init__ runs next
            parent()

    @classmethod
    def from_options(cls, options: "DataOptions"):
        """`options` as a `cls` (e.g. `SFTDataOptions`): itself when it is one (a trainer config), else its
        `DataOptions` fields with `cls`'s defaults for the rest.

        Raises:
            TypeError: `options` is not a `DataOptions` (duck-typed args are not accepted).
        """
        if isinstance(options, cls):
            return options
        if not isinstance(options, DataOptions):
            raise TypeError(f"options must be a DataOptions (a trainer config, {cls.__name__}(...) or "
                            f"DataOptions(...)), got {type(options).__name__}")
        return cls(**{f.name: getattr(options, f.name) for f in fields(DataOptions)})


@renamed_options("max_seq_length")
@dataclass
class SFTDataOptions(DataOptions):
    """`DataOptions` plus what only SFT data reads; `SFTConfig` is one. Defaults and help texts are SFT's.

    Args:
        dataset_text_field: column of plain-text datasets.
        completion_only_loss: loss on the completion only (None: yes for prompt/completion data); truncation
            must leave a completion token, or the example is dropped.
        assistant_only_loss: loss on assistant turns only (conversational data; the chat template must mark them).
    """

    max_length: int | None = field(default=1024, metadata={"help": "Longest tokenized example / packed row length."})
    overlong_policy: str = field(
        default="truncate",
        metadata={"help": "Examples longer than max_length: truncate (keep the start), drop, or error.",
                  "choices": OVERLONG_CHOICES},
    )
    eos_token: str | None = field(default=None, metadata={"help": "End-of-turn token. None: the tokenizer's."})
    dataset_text_field: str = field(default="text", metadata={"help": "Column of plain-text datasets."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Loss on completions only. None: yes for prompt/completion datasets."}
    )
    assistant_only_loss: bool = field(default=False, metadata={"help": "Loss on assistant turns only."})


@renamed_options("max_seq_length")
@dataclass
class PreferenceDataOptions(DataOptions):
    """`DataOptions` plus what only preference pairs read; `RewardConfig` is one. Defaults and help are its.

    Args:
        overlong_policy: defaults to `drop` (TRL filters over-long pairs); see `RewardConfig`.
        use_margin: use the dataset's `margin` column. None: when the column is there.
    """

    max_length: int | None = field(default=1024, metadata={"help": "Longest tokenized chosen or rejected sequence."})
    overlong_policy: str = field(
        default="drop",
        metadata={"help": "Pairs with a side longer than max_length: drop, truncate (keep the start; pairs left "
                          "identical are dropped), or error.", "choices": OVERLONG_CHOICES},
    )
    use_margin: bool | None = field(
        default=None, metadata={"help": "Use the 'margin' column in the loss. None: when the dataset has one."}
    )


@dataclass
class NonFiniteOptions:
    """What every trainer does with a non-finite loss / grad norm (`hf_rlhf.nonfinite`), and how it is logged."""

    nonfinite_policy: str = field(
        default="stop", metadata={"help": "A NaN/inf loss or grad norm before an optimizer step: stop (save nothing "
                                          "from that step on) or skip (drop that step). See hf_rlhf.nonfinite.",
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
            self.bf16 = (not self.fp16) and _cuda_bf16() and not self.use_cpu
        if self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = _cuda_available() and not self.use_cpu
        if not _cuda_available():
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



PAD_TO_MULTIPLE_OF_HELP = "Pad batches to a multiple of this. 'auto' (TRL's default): no padding (it pads on Neuron only)."


def resolve_pad_to_multiple_of(value, owner: str) -> int | None:
    """TRL's `pad_to_multiple_of` values: an int, None, "auto" (None: no Neuron here), or those as command-line strings."""
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
        if self.activation_offloading and (not _cuda_available() or self.use_cpu):
            raise ValueError(f"{name}.activation_offloading=True moves activations from the GPU to CPU memory; "
                             "without CUDA they are in CPU memory already. Set activation_offloading=False.")
        if self.activation_offloading and _deepspeed_launch(self):
            raise ValueError(f"{name}.activation_offloading is not supported with DeepSpeed (as in TRL); use "
                             "DeepSpeed's own offload_param / offload_optimizer settings.")


@renamed_options("max_seq_length")
@dataclass
class SFTConfig(SFTDataOptions, TrainerModelOptions, NonFiniteOptions, DeviceDefaultsMixin, TrainingArguments):
    """Supervised fine-tuning options (a `TrainingArguments`).

    Data (`SFTDataOptions`, read by `hf_rlhf.data.prepare_sft_dataset`):
        dataset_text_field: column of plain-text datasets.
        max_length: longest tokenized example; also the packed row length.
        overlong_policy: what to do with an example longer than `max_length`: `truncate` (keep the
            start, TRL's `keep_start`), `drop`, or `error`. The number affected is logged.
        chat_template_path: a tokenizer directory or a Jinja file whose template replaces the
            tokenizer's one.
        dataset_num_proc, eos_token, pad_token, prompt_tokenization: see `DataOptions` (`prompt_tokenization=
            'joint'` tokenizes prompt + completion as TRL does, where tokens merge across the boundary).
    Packing:
        packing: pack the dataset into rows of `max_length` (best-fit decreasing, `trl.pack_dataset`);
            examples never attend to each other (restarted `position_ids`, no attention mask).
        padding_free: concatenate each batch into one row without pre-packing the dataset.
        packing_check: with `packing` or `padding_free`, check before training that two short sequences give the
            model the same outputs packed and apart, and refuse the architecture otherwise (OPT: its mask ignores
            `position_ids`); `hf_rlhf.packing_check`. A few milliseconds; False skips it.
        packing_strategy: `bfd` (best-fit decreasing, an example longer than a row is truncated), `bfd_split`
            (the overflow becomes its own example) or `wrapped` (cut mid-example): `trl.pack_dataset`.
        eval_packing: pack the eval dataset; None: as `packing`.
        shuffle_dataset: shuffle the prepared dataset with `seed` (before packing too, as TRL).
        dataset_kwargs: `{"skip_prepare_dataset": True}` passes datasets to the collator as they are (they must
            hold `input_ids`, or the `data_collator` given must build them).
        truncation_mode: `keep_start` (TRL's only supported mode; `keep_end` is deprecated in TRL and refused).
    Loss:
        completion_only_loss: loss on the completion only (None: yes for prompt/completion data).
        assistant_only_loss: loss on assistant turns only (conversational data).
        loss_type: `nll` or `dft` (Dynamic Fine-Tuning, https://huggingface.co/papers/2508.05629: each token's
            NLL weighted by its detached probability). TRL's deprecated `chunked_nll` is `nll`.
        router_aux_loss_coef: weight of a Mixture-of-Experts model's load-balancing loss (None: the model config's
            own; 0.0 turns it off); an error for a model that is not MoE.
    Model (`TrainerModelOptions`): model_init_kwargs, trust_remote_code, activation_offloading.
    """

    learning_rate: float = field(default=2e-5, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on for CUDA with bf16, off on CPU."}
    )
    packing: bool = field(default=False, metadata={"help": "Pack examples into rows of max_length."})
    packing_strategy: str = field(
        default="bfd", metadata={"help": "Dataset packing strategy (trl.pack_dataset): bfd, bfd_split or wrapped.",
                                 "choices": ["bfd", "bfd_split", "wrapped", "bfd-requeue"]},
    )
    padding_free: bool = field(default=False, metadata={"help": "Concatenate each batch into one row."})
    packing_check: bool = field(
        default=True, metadata={"help": "Check that packing is exact on the model before training (a few ms)."}
    )
    pad_to_multiple_of: int | str | None = field(default=None, metadata={"help": PAD_TO_MULTIPLE_OF_HELP})
    eval_packing: bool | None = field(default=None, metadata={"help": "Pack the eval dataset. None: as packing."})
    shuffle_dataset: bool = field(default=False, metadata={"help": "Shuffle the prepared dataset with seed."})
    dataset_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Dataset preparation options; the only key is skip_prepare_dataset."}
    )
    truncation_mode: str = field(
        default="keep_start", metadata={"help": "keep_start: truncation keeps the start of each example.",
                                        "choices": ["keep_start", "keep_end"]},
    )
    loss_type: str = field(
        default="nll", metadata={"help": "nll, or dft (Dynamic Fine-Tuning).", "choices": ["nll", "dft", "chunked_nll"]}
    )
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "MoE load-balancing loss weight. None: the model config's; 0.0: off."}
    )

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs", "dataset_kwargs"]

    def __post_init__(self):
        check_field_types(self)
        self._resolve_device_defaults()
        self._check_model_options()
        super().__post_init__()  # SFTDataOptions' checks, then TrainingArguments' (JSON dict fields parsed)
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, "SFTConfig")
        if self.packing_strategy == "bfd-requeue":  # TRL's deprecated name
            self.packing_strategy = "bfd_split"
        if self.loss_type == "chunked_nll":  # TRL: a deprecated alias of nll
            self.loss_type = "nll"
        if (self.packing or self.eval_packing) and self.max_length is None:
            raise ValueError("SFTConfig: packing=True needs max_length (the packed row length).")
        if self.truncation_mode != "keep_start":
            raise ValueError("SFTConfig.truncation_mode='keep_end' is deprecated in TRL (removed in v2) and not "
                             "supported here: it cuts the prompt off completion data. Use 'keep_start' (with "
                             "overlong_policy 'truncate', 'drop' or 'error').")
        unknown = set(self.dataset_kwargs or {}) - {"skip_prepare_dataset"}
        if unknown:
            raise ValueError(f"SFTConfig.dataset_kwargs: unknown keys {sorted(unknown)}; the only key is "
                             "'skip_prepare_dataset' (as in TRL).")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"SFTConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}.")

    @property
    def skip_prepare_dataset(self) -> bool:
        """`dataset_kwargs["skip_prepare_dataset"]`: datasets go to the collator as they are."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))



@renamed_options("max_seq_length")
@dataclass
class RewardConfig(PreferenceDataOptions, TrainerModelOptions, NonFiniteOptions, DeviceDefaultsMixin, TrainingArguments):
    """Pairwise reward-model training options (a `TrainingArguments`).

    Data (`PreferenceDataOptions`, read by `hf_rlhf.data.prepare_preference_dataset`):
        max_length: longest tokenized chosen or rejected sequence.
        overlong_policy: a pair with a side longer than `max_length`: `drop` (the default, as TRL filters such
            pairs), `truncate` (keep the start of both; a pair whose truncated sides are identical is dropped, as
            the cut removed every token where they differ), or `error`. The number affected is logged.
        use_margin: use the dataset's `margin` column in the loss. None: when the column is there.
        dataset_num_proc, eos_token, pad_token, chat_template_path, prompt_tokenization: see `DataOptions`
            (`prompt_tokenization='joint'` tokenizes prompt + chosen / rejected as TRL does, where tokens merge
            across the boundary).
    Batches:
        padding_side: `right` or `left` padding of padded batches (rewards are read at each sequence's last real
            token either way).
        padding_free: flatten each batch of pairs into one row (restarted `position_ids`, no padding); rewards are
            gathered at each sequence's own last token. Pays off with flash attention.
        prefix_sharing: run each pair as one row [shared prefix | chosen tail | rejected tail] whose rejected
            tail cannot see the chosen tail (a 4D mask), so the prompt is computed once per pair instead of twice.
            Same rewards as the padded path; needs `sdpa` or `eager` attention.
        packing_check: with `padding_free` or `prefix_sharing`, check before training that two short sequences
            get the same outputs laid out so and apart, and refuse the architecture otherwise (OPT with
            padding_free; sliding-window models with prefix_sharing beyond their window); `hf_rlhf.packing_check`.
            A few milliseconds; False skips it.
        pad_to_multiple_of: round padded lengths (or the packed row) up to a multiple of this.
    Loss:
        center_rewards_coefficient: weight of mean((r_chosen + r_rejected)^2), which pulls rewards towards zero
            mean (Eisenstein et al. 2023, https://huggingface.co/papers/2312.09244, Eq. 2). TRL recommends 0.01.
        disable_dropout: turn dropout off in the model (as TRL does).
    Model (`TrainerModelOptions`): model_init_kwargs, trust_remote_code, activation_offloading.
    For PPO:
        store_reward_stats: after `train()`, compute the mean and std of the rewards of the train set's chosen and
            rejected sequences and store them as `config.reward_mean` / `config.reward_std` (written with the
            model, and to `reward_stats.json`), so that a PPO run can normalise scores.
        reward_stats_num_samples: compute those statistics over this many training pairs drawn at random
            (seeded by `seed`); None: all of them.
    """

    learning_rate: float = field(default=1e-4, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on for CUDA with bf16, off on CPU."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model."})
    padding_side: str = field(
        default="right", metadata={"help": "Padding side of padded batches.", "choices": ["right", "left"]}
    )
    padding_free: bool = field(default=False, metadata={"help": "Flatten each batch of pairs into one row."})
    prefix_sharing: bool = field(
        default=False, metadata={"help": "Compute the prefix chosen and rejected share once per pair (sdpa/eager)."}
    )
    packing_check: bool = field(
        default=True, metadata={"help": "Check that padding_free / prefix_sharing is exact on the model (a few ms)."}
    )
    pad_to_multiple_of: int | str | None = field(default=None, metadata={"help": PAD_TO_MULTIPLE_OF_HELP})
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Weight of mean((r_chosen + r_rejected)^2). Recommended: 0.01."}
    )
    store_reward_stats: bool = field(
        default=False, metadata={"help": "After training, store the train set's reward mean/std in the model config."}
    )
    reward_stats_num_samples: int | None = field(
        default=None, metadata={"help": "Training pairs (a seeded random sample) the reward stats use. None: all."}
    )

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self):
        check_field_types(self)
        self._resolve_device_defaults()
        self._check_model_options()
        super().__post_init__()  # PreferenceDataOptions' checks, then TrainingArguments' (JSON dict fields parsed)
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, "RewardConfig")
        if self.padding_free and self.prefix_sharing:
            raise ValueError("RewardConfig: padding_free and prefix_sharing are two different batch layouts; "
                             "choose one.")
        if self.reward_stats_num_samples is not None and self.reward_stats_num_samples < 1:
            raise ValueError(
                f"RewardConfig.reward_stats_num_samples must be >= 1, got {self.reward_stats_num_samples}.")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ValueError(f"RewardConfig.center_rewards_coefficient must be >= 0, got "
                             f"{self.center_rewards_coefficient}.")


# ---------------------------------------------------------------------------------------------------
# Preference optimisation (DPO family)

# the loss types trl 1.16's DPOTrainer takes, then the reference-free ones this package adds (SimPO, ORPO); the same
# tuple as `hf_rlhf.preference_losses.DPO_LOSS_TYPES` (data layer: no import of the math layer's names needed)
DPO_LOSS_TYPE_CHOICES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                         "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "simpo", "orpo"]
F_DIVERGENCE_CHOICES = ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]


@dataclass
class DPOConfig(DataOptions, TrainerModelOptions, NonFiniteOptions, DeviceDefaultsMixin, TrainingArguments):
    """Direct preference optimisation options (a `TrainingArguments`): every field of trl 1.16's `DPOConfig`, with its
    default, plus SimPO's `simpo_gamma`.

    Data: `max_length` (prompt + completion, per sequence), `truncation_mode` (`keep_start`, `keep_end`),
        `dataset_num_proc`, `pad_to_multiple_of`, `pad_token`, `chat_template_path`, `prompt_tokenization` (see
        `DataOptions`: `joint` is TRL's tokenization where tokens merge across an explicit prompt's end). Batches are
        TRL's padded chosen‖rejected rows; with `padding_free` (which TRL 1.16 has switched off) the 2B sequences end
        to end in one row with restarted `position_ids`, no padding (`keep_start` truncation; pays off with flash
        attention); with `prefix_sharing` one row per pair [prompt | chosen | rejected] whose prompt is computed once
        (sdpa or eager attention). Both give the padded layout's log-probs (`collators.dpo`); `packing_check`
        refuses a model on which the layout is not exact (OPT).
    Forward: `use_logits_to_keep` (default True; TRL <= 0.28's option, deprecated there and absent from trl 1.16): the
        policy and reference forwards compute logits (the LM head, softcapping, the log-softmax) only at the positions
        that predict a completion token, in every layout, through transformers' `logits_to_keep` positions per row;
        the log-probs, loss and gradients equal the full logits' within float rounding (`tests/zoo/
        test_dpo_layouts.py`). Most of a long prompt's positions then cost no vocabulary projection. A model that
        cannot (a forward without transformers' 2D `logits_to_keep`, a prompt-learning peft adapter) computes every
        position, with a log line saying why; False: every position always (as trl 1.16 on CPU, which scores only
        the completion positions on CUDA / XPU with Triton). The logits `prediction_step` returns are always the full ones.
        On sdpa the padded layout's right-padded rows go without their attention mask (causal attention alone: no
        real token sees the padding after it, and sdpa takes its causal kernel) where a self-check on the model and
        the reference agrees (`packing_check.right_padding_needs_no_mask`), except with an MoE router loss, which
        reads the mask.
    Reference: `precompute_ref_log_probs` (computed once before training, stored with the dataset and in
        `output_dir/ref_logps/`, reused on resume), `precompute_ref_batch_size`. Reference-free losses (`simpo`, `orpo`,
        `sft` alone) use no reference model.
    Loss: `loss_type` (a name or a list, see `hf_rlhf.preference_losses`), `loss_weights`, `beta`,
        `label_smoothing`, `ld_alpha`, `f_divergence_type`, `f_alpha_divergence_coef`, `use_weighting` (WPO),
        `discopop_tau`, `simpo_gamma`.
    MoE: `router_aux_loss_coef` (None: the model config's; 0 turns it off), the load-balancing loss added to the
        loss and logged as `aux_loss`, as TRL.
    TR-DPO: `sync_ref_model` (every `ref_model_sync_steps` steps the reference becomes
        `alpha·policy + (1 − alpha)·reference`, alpha = `ref_model_mixup_alpha`; trl's `SyncRefModelCallback`); it
        needs a separate reference model (not a peft policy's adapters-off base) and no `precompute_ref_log_probs`.
    Refused with the reason: `activation_offloading` without CUDA.
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on for CUDA with bf16, off on CPU."}
    )
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "MoE load-balancing loss weight (None: the model config's; 0: off)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model and reference."})
    truncation_mode: str = field(
        default="keep_start", metadata={"help": "Sequences over max_length: keep_start or keep_end.",
                                        "choices": ["keep_start", "keep_end"]})
    padding_free: bool = field(
        default=False, metadata={"help": "The batch's 2B sequences end to end in one row, no padding (keep_start)."})
    prefix_sharing: bool = field(
        default=False, metadata={"help": "One row per pair [prompt | chosen | rejected], the prompt computed once "
                                         "(sdpa/eager; keep_start truncation)."})
    packing_check: bool = field(
        default=True, metadata={"help": "Check that padding_free / prefix_sharing is exact on the model before "
                                        "training (a few ms)."})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": PAD_TO_MULTIPLE_OF_HELP})
    use_logits_to_keep: bool = field(
        default=True, metadata={"help": "Compute logits only at the positions predicting completion tokens (exact; "
                                        "False: at every position)."})
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute the reference log-probs once before training and store them."})
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of that precomputation. None: the train / eval batch size."})
    loss_type: list[str] | str = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": f"Loss type, or a list combined with loss_weights: one of {DPO_LOSS_TYPE_CHOICES}."})
    loss_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each loss_type. None: 1."})
    ld_alpha: float | None = field(default=None, metadata={"help": "LD-DPO weight of tokens past the shorter "
                                                                    "completion. None: plain sums."})
    f_divergence_type: str = field(
        default="reverse_kl", metadata={"help": "f-divergence of the log-ratio scores.",
                                        "choices": F_DIVERGENCE_CHOICES})
    f_alpha_divergence_coef: float = field(default=0.5, metadata={"help": "α of alpha_divergence."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Label noise ε (robust, exo_pair, aot, simpo)."})
    beta: float = field(default=0.1, metadata={"help": "β: deviation from the reference (IPO τ, ORPO λ)."})
    use_weighting: bool = field(default=False, metadata={"help": "WPO weighting of each pair."})
    discopop_tau: float = field(default=0.05, metadata={"help": "DiscoPOP τ."})
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO's target margin γ (loss_type='simpo')."})
    sync_ref_model: bool = field(default=False, metadata={"help": "TR-DPO: mix the policy into the reference."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO mixup α (with sync_ref_model)."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO sync period (with sync_ref_model)."})

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [t.strip() for t in self.loss_type.split(",")] if "," in self.loss_type else [self.loss_type]
        self.loss_type = list(self.loss_type)
        unknown = [t for t in self.loss_type if t not in DPO_LOSS_TYPE_CHOICES]
        if unknown or not self.loss_type:
            raise ValueError(f"DPOConfig.loss_type={self.loss_type!r}; expected one or more of {DPO_LOSS_TYPE_CHOICES}.")
        check_field_types(self)
        self._resolve_device_defaults()
        self._check_model_options()
        super().__post_init__()  # DataOptions' checks, then TrainingArguments'
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, "DPOConfig")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"DPOConfig.loss_weights has {len(self.loss_weights)} weights for {len(self.loss_type)} "
                             "loss types; give one per loss_type.")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"DPOConfig.truncation_mode={self.truncation_mode!r}; expected 'keep_start' or 'keep_end'.")
        if self.f_divergence_type not in F_DIVERGENCE_CHOICES:
            raise ValueError(f"DPOConfig.f_divergence_type={self.f_divergence_type!r}; expected one of "
                             f"{F_DIVERGENCE_CHOICES}.")
        if self.beta <= 0:
            raise ValueError(f"DPOConfig.beta must be > 0, got {self.beta}.")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DPOConfig.label_smoothing must be in [0, 0.5), got {self.label_smoothing}.")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0:
            raise ValueError("DPOConfig: loss_type 'exo_pair' takes log(label_smoothing); set label_smoothing > 0 "
                             "(the EXO paper uses 1e-3).")
        if self.padding_free and self.prefix_sharing:
            raise ValueError("DPOConfig: padding_free and prefix_sharing are different layouts; choose one.")
        if self.padding_free and self.truncation_mode != "keep_start":
            raise ValueError("DPOConfig.padding_free=True truncates with truncation_mode='keep_start' only (the "
                             "default); keep_end is TRL's padded layout.")
        if self.prefix_sharing and self.truncation_mode != "keep_start":
            raise ValueError("DPOConfig.prefix_sharing=True keeps one prompt for both completions, so it truncates "
                             "with truncation_mode='keep_start' only.")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError("DPOConfig: sync_ref_model=True cannot go with precompute_ref_log_probs=True (as in TRL): "
                             "the precomputed reference log-probs would be stale after the first sync.")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"DPOConfig.ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}.")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"DPOConfig.ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}.")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"DPOConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}.")
        if self.precompute_ref_batch_size is not None and self.precompute_ref_batch_size < 1:
            raise ValueError(f"DPOConfig.precompute_ref_batch_size must be >= 1, got {self.precompute_ref_batch_size}.")
