"""`SFTConfig`: supervised fine-tuning options, a `transformers.TrainingArguments` (TRL's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..data.options import SFTDataOptions
from .base_config import (
    PAD_TO_MULTIPLE_OF_HELP,
    DeviceDefaultsMixin,
    NonFiniteOptions,
    TrainerModelOptions,
    resolve_pad_to_multiple_of,
)
from .config_checks import check_field_types, renamed_options


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
            `position_ids`); `hf_rlhf.models.packing_check`. A few milliseconds; False skips it.
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
        chunked_lm_head: compute the loss and the `entropy` / `mean_token_accuracy` metrics from the last hidden
            states, the LM head applied to a chunk of the loss tokens at a time and recomputed in the backward, never
            the (B, T, V) logits (`hf_rlhf.models.lm_head`; TRL 1.16 always does so). None: where the vocabulary
            is over 4,096 and the model's head splits off (checked once), else the full logits (with a warning naming
            a model that does not split); True: an error instead; False: the full logits. The full logits are used
            anyway with a `compute_loss_func`, label smoothing, FSDP / DeepSpeed ZeRO-3 (which shard the head) and
            an eval with `compute_metrics`.
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
    chunked_lm_head: bool | None = field(
        default=None, metadata={"help": "Loss from the LM head in chunks of tokens, not the full logits. None: where "
                                        "the model's head splits off; True: or an error; False: the full logits."}
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
