"""`KTOConfig`: KTO options, a `transformers.TrainingArguments` (trl 1.16's `KTOConfig` names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..data.options import DataOptions
from .base_config import (
    PAD_TO_MULTIPLE_OF_HELP,
    DeviceDefaultsMixin,
    NonFiniteOptions,
    TrainerModelOptions,
    resolve_pad_to_multiple_of,
)
from .config_checks import check_field_types

# as `hf_rlhf.losses.kto.KTO_LOSS_TYPES` (the data layer does not import the math layer's names)
KTO_LOSS_TYPE_CHOICES = ["kto", "apo_zero_unpaired"]


@dataclass
class KTOConfig(DataOptions, TrainerModelOptions, NonFiniteOptions, DeviceDefaultsMixin, TrainingArguments):
    """Kahneman-Tversky optimisation options (a `TrainingArguments`): every field of trl 1.16's `KTOConfig`, with its
    default, and the layout / forward options `DPOConfig` has.

    Data: `max_length` (prompt + completion, per sequence; truncated keeping the start, as TRL), `dataset_num_proc`,
        `pad_to_multiple_of`, `pad_token`, `chat_template_path`, `prompt_tokenization` (see `DataOptions`).
        `train_sampling_strategy` defaults to `sequential` (TRL's): each row's mismatched KL completion is its
        neighbour's in a block of `per_device_train_batch_size` rows, so the `kto` loss refuses any other sampler
        and a per-device batch of one (the KL term would be the reward itself). Batches are TRL's padded rows
        (`DataCollatorForUnpairedPreference`); with `padding_free` the B sequences end to end in one row, the B
        mismatched ones in another; with `prefix_sharing` (the `kto` loss; sdpa or eager attention) one row per row
        of data, [prompt | completion | mismatched completion], the prompt computed once for the policy and the
        reference, the mismatched log-probs read off the same forward without their gradient (`collators.kto`). Both
        give the padded layout's log-probs; `packing_check` refuses a model on which the layout is not exact.
    Forward: `use_logits_to_keep`, `chunked_lm_head` as `DPOConfig`'s (logits only at completion positions; the LM
        head over chunks of completion tokens for a vocabulary over 4,096).
    Reference: a frozen copy, a peft policy's base with adapters off, or `precompute_ref_log_probs` (computed once,
        stored with the dataset and in `output_dir/ref_logps/`, reused on resume), `precompute_ref_batch_size`.
    Loss: `loss_type` (`kto`, `apo_zero_unpaired`), `beta`, `desirable_weight`, `undesirable_weight`.
    MoE: `router_aux_loss_coef` (None: the model config's; 0 turns it off). TR-DPO: `sync_ref_model`,
        `ref_model_mixup_alpha`, `ref_model_sync_steps` (a separate reference model, no precomputation).
    Refused with the reason: `activation_offloading` without CUDA; `prefix_sharing` with `apo_zero_unpaired`.
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X updates steps."})
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision. None: on for CUDA with bf16, off on CPU."})
    train_sampling_strategy: str = field(
        default="sequential", metadata={"help": "Training sampler; the kto loss needs sequential (its mismatched KL "
                                                "completions pair each row with its batch neighbour).",
                                        "choices": ["random", "sequential", "group_by_length"]})
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "MoE load-balancing loss weight (None: the model config's; 0: off)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in the model and reference."})
    padding_free: bool = field(
        default=False, metadata={"help": "The batch's B sequences end to end in one row, no padding (and the B "
                                         "mismatched ones in another)."})
    prefix_sharing: bool = field(
        default=False, metadata={"help": "One row per row of data [prompt | completion | mismatched completion], the "
                                         "prompt computed once (sdpa/eager; the kto loss)."})
    packing_check: bool = field(
        default=True, metadata={"help": "Check that padding_free is exact on the model before training."})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": PAD_TO_MULTIPLE_OF_HELP})
    use_logits_to_keep: bool = field(
        default=True, metadata={"help": "Compute logits only at the positions predicting completion tokens."})
    chunked_lm_head: bool | None = field(
        default=None, metadata={"help": "Log-probs from the LM head in chunks of tokens, not the full logits. None: "
                                        "where the vocabulary is over 4,096 and the head splits off; True: or an "
                                        "error; False: the full logits."})
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute the reference log-probs once before training and store them."})
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of that precomputation. None: the train / eval batch size."})
    loss_type: str = field(default="kto", metadata={"help": "Loss type.", "choices": KTO_LOSS_TYPE_CHOICES})
    beta: float = field(default=0.1, metadata={"help": "β: deviation from the reference."})
    desirable_weight: float = field(default=1.0, metadata={"help": "Weight of the desirable completions' losses."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of the undesirable completions' losses."})
    sync_ref_model: bool = field(default=False, metadata={"help": "TR-DPO: mix the policy into the reference."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO mixup α (with sync_ref_model)."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO sync period (with sync_ref_model)."})

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs"]

    def __post_init__(self):
        check_field_types(self)
        self._resolve_device_defaults()
        self._check_model_options()
        super().__post_init__()  # DataOptions' checks, then TrainingArguments'
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, "KTOConfig")
        if self.beta <= 0:
            raise ValueError(f"KTOConfig.beta must be > 0, got {self.beta}.")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"KTOConfig.{name} must be >= 0, got {getattr(self, name)}.")
        if self.prefix_sharing and self.padding_free:
            raise ValueError("KTOConfig: padding_free and prefix_sharing are different layouts; choose one.")
        if self.prefix_sharing and self.loss_type != "kto":
            raise ValueError(f"KTOConfig.prefix_sharing=True shares each prompt between its completion and its "
                             f"mismatched (KL) completion; loss_type {self.loss_type!r} has no mismatched completion. "
                             "Use the padded layout or padding_free.")
        if self.loss_type == "kto" and self.train_sampling_strategy != "sequential":
            raise ValueError(f"KTOConfig: loss_type 'kto' estimates the KL term from each row's neighbour in a "
                             f"fixed-order batch, so it needs train_sampling_strategy='sequential' (as TRL), got "
                             f"{self.train_sampling_strategy!r}. Shuffle the dataset beforehand instead.")
        if self.loss_type == "kto" and self.per_device_train_batch_size <= 1:
            raise ValueError("KTOConfig: loss_type 'kto' needs per_device_train_batch_size > 1 (as TRL): with one row "
                             "its mismatched completion is its own, and the KL term equals the implied reward.")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError("KTOConfig: sync_ref_model=True cannot go with precompute_ref_log_probs=True (as in TRL): "
                             "the precomputed reference log-probs would be stale after the first sync.")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"KTOConfig.ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}.")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"KTOConfig.ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}.")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"KTOConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}.")
        if self.precompute_ref_batch_size is not None and self.precompute_ref_batch_size < 1:
            raise ValueError(f"KTOConfig.precompute_ref_batch_size must be >= 1, got {self.precompute_ref_batch_size}.")
