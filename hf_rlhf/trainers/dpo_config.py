"""`DPOConfig`: DPO-family options, a `transformers.TrainingArguments` (trl 1.16's `DPOConfig` names)."""

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

# the loss types trl 1.16's DPOTrainer takes, then the reference-free ones this package adds (SimPO, ORPO); the same
# tuple as `hf_rlhf.losses.dpo.DPO_LOSS_TYPES` (data layer: no import of the math layer's names needed)
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
        the completion positions on CUDA / XPU with Triton). The logits `prediction_step` returns are always the full
        ones.
        `chunked_lm_head`: the policy's and reference's completion log-probs and TRL's token metrics from the last
        hidden states, the LM head applied to a chunk of completion tokens at a time and recomputed in the backward,
        never the logits (`hf_rlhf.models.lm_head`). None: for each model with a vocabulary over 4,096 whose head
        splits off (checked once), else `use_logits_to_keep`'s logits (with a warning naming a model that does not
        split); True: an error instead; False: the logits. The logits
        anyway with FSDP / DeepSpeed ZeRO-3 and for `prediction_step`.
        On sdpa the padded layout's right-padded rows go without their attention mask (causal attention alone: no
        real token sees the padding after it, and sdpa takes its causal kernel) where a self-check on the model and
        the reference agrees (`packing_check.right_padding_needs_no_mask`), except with an MoE router loss, which
        reads the mask.
    Reference: `precompute_ref_log_probs` (computed once before training, stored with the dataset and in
        `output_dir/ref_logps/`, reused on resume), `precompute_ref_batch_size`. Reference-free losses (`simpo`, `orpo`,
        `sft` alone) use no reference model.
    Loss: `loss_type` (a name or a list, see `hf_rlhf.losses.dpo`), `loss_weights`, `beta`,
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
    chunked_lm_head: bool | None = field(
        default=None, metadata={"help": "Log-probs from the LM head in chunks of tokens, not the full logits. None: "
                                        "where the vocabulary is over 4,096 and the head splits off; True: or an "
                                        "error; False: the full logits."}
    )
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
            text = self.loss_type
            self.loss_type = [t.strip() for t in text.split(",")] if "," in text else [text]
        self.loss_type = list(self.loss_type)
        unknown = [t for t in self.loss_type if t not in DPO_LOSS_TYPE_CHOICES]
        if unknown or not self.loss_type:
            raise ValueError(f"DPOConfig.loss_type={self.loss_type!r}; expected one or more of "
                             f"{DPO_LOSS_TYPE_CHOICES}.")
        check_field_types(self)
        self._resolve_device_defaults()
        self._check_model_options()
        super().__post_init__()  # DataOptions' checks, then TrainingArguments'
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of, "DPOConfig")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"DPOConfig.loss_weights has {len(self.loss_weights)} weights for {len(self.loss_type)} "
                             "loss types; give one per loss_type.")
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"DPOConfig.truncation_mode={self.truncation_mode!r}; expected 'keep_start' or "
                             "'keep_end'.")
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
