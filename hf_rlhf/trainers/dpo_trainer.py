"""DPOTrainer: direct preference optimisation (the DPO family, SimPO, ORPO) as a thin `transformers.Trainer` subclass.

What it adds to `Trainer` (through `BaseTrainer`): trl 1.16's `DPOTrainer` signature and `DPOConfig` fields; TRL's
preference formats checked row by row before any model loads and tokenized as TRL does (`hf_rlhf.data.dpo`); TRL's
padded chosen‖rejected batches (`trl`'s own `DataCollatorForPreference`), or padding-free / prefix-shared ones
(`collators.dpo`); and

- `compute_loss`: one policy forward over the 2B sequences, summed completion log-probs (`losses.dpo.
  completion_logps`; logits only at the positions predicting a completion token, `use_logits_to_keep`; on sdpa the
  padded rows without their right-padding mask, so that attention takes its causal kernel), the reference's (below),
  then `losses.dpo.combined_loss` (every TRL `loss_type`, `loss_weights`, WPO weights, f-divergences, LD-DPO;
  SimPO and ORPO reference-free). Logs TRL 1.16's metrics:
  `rewards/{chosen,rejected,accuracies,margins}`, `logps/{chosen,rejected}`, `logits/{chosen,rejected}`, `entropy`,
  `mean_token_accuracy`, `num_tokens`.
- The reference: a given `ref_model` (frozen); else, for a LoRA / QLoRA policy, the same model with its adapters off
  (`hf_rlhf.models.adapters.adapter_scope`; no second model); else a frozen copy of the policy taken before training;
  none for reference-free losses. `precompute_ref_log_probs`: computed once, stored as dataset columns and in
  `output_dir/ref_logps/<split>-<fingerprint>.pt`, so a resumed run reads them back instead of recomputing them.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from accelerate.utils import is_peft_model
from transformers import AutoModelForCausalLM, TrainingArguments
from trl.trainer.dpo_trainer import DataCollatorForPreference

from ..collators.dpo import PaddingFreePreferenceCollator, PrefixSharedPreferenceCollator
from ..data import ensure_pad_token, main_process_first_if_cached
from ..data.dpo import check_dpo_rows, prepare_dpo_dataset
from ..data.streaming import check_streamed_training, is_streamed
from ..losses.dpo import (
    REFERENCE_FREE_LOSS_TYPES,
    combined_loss,
    completion_logps,
    gathered_completion_logps,
    logits_to_keep_per_row,
    needs_reference,
    padded_gather_index,
    scored_token_statistics,
    token_statistics,
    wpo_weights,
)
from ..models.adapters import adapter_scope
from ..models.lm_head import LMHead, last_hidden_states, resolve_lm_head
from ..models.loading import (
    check_model_path,
    check_trainable,
    disable_dropout,
    logits_to_keep_unsupported,
    resolve_model,
    router_aux_loss_coef,
    set_router_aux_loss,
)
from ..models.packing_check import check_packing_exact, right_padding_needs_no_mask
from ..models.value_head import reward_config_of
from ..tensors import additive_mask, is_right_padded
from .base_trainer import BaseTrainer
from .dpo_config import DPOConfig
from .model_config import ModelConfig

logger = logging.getLogger("hf_rlhf")

def check_precompute_not_streamed(args, dataset) -> None:
    """TRL's check: reference log-probs are stored per row, which a stream (no random access) cannot hold."""
    if args.precompute_ref_log_probs and is_streamed(dataset):
        raise ValueError("`precompute_ref_log_probs=True` is not supported with IterableDataset (the reference "
                         "log-probs are stored per row): use a map-style Dataset or set "
                         "precompute_ref_log_probs=False.")


_NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps", "row_index", "logit_index",
                   "target_ids", "gather_mask", "sequence_lengths")


class DPOTrainer(BaseTrainer):
    """Train a causal LM on preference pairs with DPO or one of its variants.

    Takes `trl.DPOTrainer`'s (1.16) arguments, in its order and with its names, plus `model_config` (by keyword).

    Args:
        model: a hub id or local path (loaded as a causal LM through `model_config` / `args.model_init_kwargs`), a
            `PreTrainedModel`, or a `PeftModel`.
        ref_model: the reference (a model or a path); None: adapters off for a peft policy, else a frozen copy of
            `model`. Unused (and not built) for reference-free losses (`simpo`, `orpo`, `sft`).
        args: a `DPOConfig`, or a `TrainingArguments` (converted as TRL does).
        data_collator: default: TRL's `DataCollatorForPreference` (padded [chosen; rejected], `completion_mask`).
        train_dataset / eval_dataset: rows in a TRL preference format (explicit / implicit prompt, plain text or
            conversational; extra columns such as `tools` are read), or tokenized `prompt_ids` / `chosen_ids` /
            `rejected_ids`; eval: also a dict of them.
        processing_class: the tokenizer. Default: loaded from the model's path.
        compute_metrics, callbacks, optimizers: as for `Trainer`.
        quantization_config: a `BitsAndBytesConfig` for a model given as a path (needs a peft adapter).
        peft_config: a peft config; default: LoRA from `model_config.use_peft`.
        model_config: how to load `model` when it is a string, and the LoRA / QLoRA options.

    Example:
        >>> trainer = DPOTrainer("path/to/sft-model", args=DPOConfig(output_dir="dpo", beta=0.1),
        ...                      train_dataset=pairs, model_config=ModelConfig(use_peft=True))
        >>> trainer.train()
    """

    config_class = DPOConfig
    tag_names = ("hf_rlhf", "trl", "dpo")  # TRL's tags too
    default_output_dir = "dpo-output"
    counts_tokens = True
    feature_columns = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")
    loss_is_scaled_for_ga = False  # the loss is a mean over the batch's pairs; the Trainer divides by GA steps

    def __init__(self, model, ref_model=None, args: DPOConfig | TrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, *,
                 model_config: ModelConfig | None = None, **kwargs):
        self.check_extra_kwargs(kwargs)
        self.require_train_dataset(train_dataset)
        args = self.resolve_args(args)
        for dataset in (train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset])):
            check_precompute_not_streamed(args, dataset)
        init_kwargs = self.model_init_kwargs(model, args, quantization_config)
        checked = self.check_rows_first((train_dataset, eval_dataset), lambda d: self._check_rows(d, args))
        if isinstance(ref_model, str) and self._needs_reference(args):  # one line now, not after the policy loads
            check_model_path(ref_model, "reference model", revision=init_kwargs.get("revision"))
        model, model_config = resolve_model(model, model_config, AutoModelForCausalLM, **init_kwargs)
        processing_class = self.resolve_tokenizer(processing_class, model, args)
        ensure_pad_token(processing_class, args.pad_token)

        uses_reference = self._needs_reference(args)
        adapts = is_peft_model(model) or peft_config is not None or bool(model_config and model_config.use_peft)
        if not uses_reference:
            if ref_model is not None:
                logger.warning("ref_model is unused: loss_type %s needs no reference", args.loss_type)
            ref_model = None
        elif isinstance(ref_model, str):
            ref_model, _ = resolve_model(ref_model, None, AutoModelForCausalLM,
                                         **{k: v for k, v in init_kwargs.items() if k != "quantization_config"})
        elif ref_model is None and not adapts:
            ref_model = copy.deepcopy(model)  # the policy as it starts: frozen below
        if ref_model is model:
            raise ValueError("ref_model is the policy model itself; pass a separate copy, or None for a frozen copy.")

        attn = getattr(reward_config_of(model), "_attn_implementation", None)
        if args.prefix_sharing and attn not in ("sdpa", "eager"):
            raise ValueError(f"prefix_sharing needs a custom attention mask, which {attn!r} attention does not take; "
                             "use attn_implementation='sdpa' or 'eager'.")
        model = self.add_peft(model, model_config, args, peft_config, task_type="CAUSAL_LM")
        check_trainable(model)
        # TRL's: an MoE policy's load-balancing loss is added to the loss (the model config's coefficient); the
        # prefix-sharing layout's 4D mask is not one the routers' loss reads, so it is off there (with a warning)
        if args.prefix_sharing and args.router_aux_loss_coef is None and set_router_aux_loss(model, None):
            logger.warning("prefix_sharing: the MoE load-balancing loss is not added (router_aux_loss_coef=0)")
            set_router_aux_loss(model, 0.0)
        self.aux_loss_enabled = set_router_aux_loss(model, args.router_aux_loss_coef)
        self.router_aux_loss_coef = router_aux_loss_coef(model) if self.aux_loss_enabled else 0.0
        layout = "padding_free" if args.padding_free else "prefix_sharing" if args.prefix_sharing else None
        if layout and args.packing_check:  # refuse a model on which the layout is not exact
            check_packing_exact(model, layout, args.max_length)
        if args.disable_dropout:
            disable_dropout(model)
        if ref_model is not None:
            if args.disable_dropout:
                disable_dropout(ref_model)
            ref_model.eval().requires_grad_(False)
            if set_router_aux_loss(ref_model, None):  # an MoE reference: only its logits are used, no router loss
                set_router_aux_loss(ref_model, 0.0)  # (its 4D prefix-sharing mask is not one the router loss reads)
        # padded rows are right-padded: under causal attention no real token sees a pad, so sdpa can drop the mask and
        # take its causal kernel (exact where the model's self-check agrees; an MoE router loss reads the mask)
        self._drop_padding_mask = (layout is None and attn == "sdpa" and not self.aux_loss_enabled and all(
            right_padding_needs_no_mask(m) for m in (model, ref_model) if m is not None))

        prepare = lambda d, name: self._prepare(d, processing_class, args, name, id(d) in checked)  # noqa: E731
        train_dataset = prepare(train_dataset, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: prepare(v, f"eval_{k}") for k, v in eval_dataset.items()}
        else:
            eval_dataset = prepare(eval_dataset, "eval")
        if data_collator is None:
            data_collator = self._default_collator(args, processing_class.pad_token_id, attn)

        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self.label_names = []  # no labels: the loss is the model's own
        self._keeps_logits = {"policy": self._can_keep_logits(model, "policy"),
                              "reference": self._can_keep_logits(ref_model if ref_model is not None else model,
                                                                 "reference") if uses_reference else False}
        self.uses_reference = uses_reference
        self._eager = attn == "eager"
        self.lm_heads = self._resolve_lm_heads(args, model, ref_model)
        self.ref_model = None
        if ref_model is not None:
            if self.is_deepspeed_enabled:
                from trl.models import prepare_deepspeed

                self.ref_model = prepare_deepspeed(ref_model, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        if args.sync_ref_model:  # TR-DPO, with trl's own callback
            if self.ref_model is None:
                raise ValueError(f"{type(args).__name__}.sync_ref_model=True needs a separate reference model to mix "
                                 "the policy into; " + ("the loss uses no reference" if not uses_reference else
                                 "a peft policy's reference is its base with the adapters off (as TRL, not "
                                 "supported)") +
                                 ". Set sync_ref_model=False" + (" or train without peft." if uses_reference else "."))
            from trl.trainer.callbacks import SyncRefModelCallback

            self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        if args.precompute_ref_log_probs and uses_reference:
            self.train_dataset = self._with_ref_logps(self.train_dataset, "train", args.per_device_train_batch_size)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self._with_ref_logps(v, f"eval_{k}", args.per_device_eval_batch_size)
                                     for k, v in self.eval_dataset.items()}
            else:
                self.eval_dataset = self._with_ref_logps(self.eval_dataset, "eval", args.per_device_eval_batch_size)

    # -- data ----------------------------------------------------------------------------------
    @staticmethod
    def _check_rows(dataset, args) -> None:
        """Check every row of a raw in-memory dataset before any model loads (`DataValidationError`)."""
        check_dpo_rows(dataset, args)

    @staticmethod
    def _needs_reference(args) -> bool:
        return needs_reference(args.loss_type)

    @staticmethod
    def _default_collator(args, pad_token_id: int, attn: str | None):
        """The collator of the configured layout: TRL's padded pairs, padding-free or prefix-shared ones."""
        if args.padding_free:
            return PaddingFreePreferenceCollator(pad_token_id, args.max_length, args.pad_to_multiple_of,
                                                 return_flash_attention_kwargs=str(attn).startswith("flash_attention"))
        if args.prefix_sharing:
            return PrefixSharedPreferenceCollator(pad_token_id, args.max_length, args.pad_to_multiple_of)
        return DataCollatorForPreference(pad_token_id=pad_token_id, max_length=args.max_length,
                                         truncation_mode=args.truncation_mode,
                                         pad_to_multiple_of=args.pad_to_multiple_of)

    @property
    def ld_alpha(self) -> float | None:
        """LD-DPO's weight of tokens past the shorter completion (None: plain sums; a config without it: None)."""
        return getattr(self.args, "ld_alpha", None)

    def prepare_eval_dataset(self, dataset, name: str):
        """A dataset passed to `evaluate`: preference rows checked and tokenized like the eval sets of `__init__`,
        with their reference log-probs when `precompute_ref_log_probs` (the reference is kept, so they are right
        after training too)."""
        check_precompute_not_streamed(self.args, dataset)
        prepared = self._prepare(dataset, self.processing_class, self.args, name, False)
        if self.args.precompute_ref_log_probs and self.uses_reference:
            prepared = self._with_ref_logps(prepared, name, self.args.per_device_eval_batch_size)
        return prepared

    @staticmethod
    def _prepare(dataset, tokenizer, args, name, rows_checked):
        if dataset is None:
            return None
        if name == "train":
            check_streamed_training(args, dataset)
        with main_process_first_if_cached(args, dataset, f"{name} dataset tokenization"):
            prepared = prepare_dpo_dataset(dataset, tokenizer, args, rows_checked=rows_checked)
        if not is_streamed(prepared):  # a stream is prepared lazily, as it is read
            logger.info("%s dataset: %d pairs", name, len(prepared))
        return prepared

    # -- forwards ------------------------------------------------------------------------------
    def _can_keep_logits(self, model, role: str) -> bool:
        if not self.args.use_logits_to_keep:
            return False
        reason = logits_to_keep_unsupported(model)
        if reason:
            logger.info("use_logits_to_keep: the %s computes every position's logits (%s)", role, reason)
        return reason is None

    def _model_inputs(self, inputs: dict, full_logits: bool = False) -> dict:
        """The model's keyword arguments; `full_logits`: every position's logits are read (the padding ones too), so
        the padding mask stays."""
        model_inputs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_inputs["use_cache"] = False
        mask = model_inputs.get("attention_mask")
        drop_mask = self._drop_padding_mask and not full_logits
        if mask is not None and mask.ndim == 2 and drop_mask and is_right_padded(mask):
            del model_inputs["attention_mask"]  # causal attention alone: see __init__
        elif mask is not None and mask.ndim == 4 and self._eager:
            # eager attention adds the mask to its scores: the prefix-sharing boolean mask becomes 0 / -inf-like
            model_inputs["attention_mask"] = additive_mask(mask)
        return model_inputs

    def _statistics(self, logits: torch.Tensor, inputs: dict) -> dict:
        """Per-sequence completion log-probs (chosen rows, then rejected) and token statistics of either layout."""
        if "logit_index" in inputs:  # prefix sharing, padding-free
            return gathered_completion_logps(logits, inputs["row_index"], inputs["logit_index"],
                                             inputs["target_ids"], inputs["gather_mask"], self.ld_alpha)
        return completion_logps(logits, inputs["input_ids"], inputs["completion_mask"], self.ld_alpha)

    @staticmethod
    def _gather_index(inputs: dict) -> dict:
        """Where each completion token's logit is, in any layout (row_index, logit_index, target_ids, gather_mask)."""
        if "logit_index" in inputs:
            return inputs
        return padded_gather_index(inputs["input_ids"], inputs["completion_mask"])

    def _resolve_lm_heads(self, args, model, ref_model) -> dict:
        """{"policy", "reference"}: the `LMHead` the log-probs run over in chunks of tokens (`chunked_lm_head`), or
        None for the logits; the reference of a peft policy (adapters off) is the policy's head."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3):
            if args.chunked_lm_head:
                raise ValueError("chunked_lm_head=True, but FSDP / DeepSpeed ZeRO-3 shard the LM head outside the "
                                 "model's forward; leave it None or False.")
            return {"policy": None, "reference": None}
        policy = resolve_lm_head(model, args.chunked_lm_head, type(self).__name__)
        reference = None
        if self.uses_reference:
            reference = policy if ref_model is None else resolve_lm_head(ref_model, args.chunked_lm_head,
                                                                         type(self).__name__)
        return {"policy": policy, "reference": reference}

    def _forward(self, model, model_inputs: dict, inputs: dict, keep_logits: bool, gather: dict | None = None,
                 head: LMHead | None = None, reference: bool = False):
        """(outputs, `_statistics`) of one forward; with `keep_logits`, logits only where a completion token is
        predicted (`outputs.logits` is then (R, K, V), see `losses.dpo.logits_to_keep_per_row`); with `head`, no
        logits: the last hidden states at those positions, the head in chunks of them (`hf_rlhf.models.lm_head`)."""
        if head is not None:
            gather = gather or self._gather_index(inputs)
            # the policy through its own forward (DDP, an MoE's aux_loss); the reference through its body alone
            hidden, outputs = last_hidden_states(model, None if reference else False, **model_inputs)
            mask = gather["gather_mask"].bool()
            selected = hidden[gather["row_index"].unsqueeze(1), gather["logit_index"]][mask]  # (M, H)
            scores = head.token_logprobs(selected, gather["target_ids"][mask], with_entropy=True, with_top1=True,
                                         with_moments=True)
            return outputs, scored_token_statistics(gather["gather_mask"], *scores, ld_alpha=self.ld_alpha)
        if not keep_logits:
            outputs = model(**model_inputs)
            return outputs, self._statistics(outputs.logits, inputs)
        gather = gather or self._gather_index(inputs)
        rows = gather["row_index"].unsqueeze(1)
        keep, column = logits_to_keep_per_row(gather["row_index"], gather["logit_index"],
                                              model_inputs["input_ids"].shape[0])
        outputs = model(**model_inputs, logits_to_keep=keep)
        if outputs.logits.shape[:2] != keep.shape:
            raise RuntimeError(f"use_logits_to_keep: the forward returned logits of shape {tuple(outputs.logits.shape)}"
                               f" for positions {tuple(keep.shape)}; set {type(self.args).__name__}."
                               "use_logits_to_keep=False.")
        return outputs, token_statistics(outputs.logits[rows, column], gather["target_ids"], gather["gather_mask"],
                                         self.ld_alpha)

    # -- reference log-probs -------------------------------------------------------------------

    @torch.no_grad()
    def _reference_stats(self, model_inputs: dict, inputs: dict, gather: dict | None = None) -> dict:
        """`_statistics` of the batch's sequences under the reference (a frozen model, or the adapters off)."""
        keep, head = self._keeps_logits["reference"], self.lm_heads["reference"]
        if self.ref_model is not None:
            _, stats = self._forward(self.ref_model, model_inputs, inputs, keep, gather, head, reference=True)
        else:  # a peft policy: the base with every adapter off
            with adapter_scope(self.accelerator.unwrap_model(self.model), None):
                _, stats = self._forward(self.model, model_inputs, inputs, keep, gather, head, reference=True)
        return stats

    def _reference_logps(self, model_inputs: dict, inputs: dict, gather: dict | None = None):
        """(chosen (B,), rejected (B,)) summed completion log-probs under the reference."""
        return self._reference_stats(model_inputs, inputs, gather)["logps"].chunk(2)

    # the precomputed reference log-probs: {key in the stored file: dataset column}
    ref_columns = {"chosen": "ref_chosen_logps", "rejected": "ref_rejected_logps"}

    def _batch_ref_logps(self, batch: dict) -> dict:
        """{key of `ref_columns`: (B,) reference log-probs} of one collated batch."""
        chosen, rejected = self._reference_logps(self._model_inputs(batch), batch)
        return {"chosen": chosen, "rejected": rejected}

    def _with_ref_logps(self, dataset, name: str, batch_size: int):
        """`dataset` with the `ref_columns` (DPO: `ref_chosen_logps` / `ref_rejected_logps`), read from
        `output_dir/ref_logps/` when a previous run (or the run being resumed) stored them, else computed once and
        stored there."""
        columns = self.ref_columns
        if dataset is None or set(columns.values()) <= set(dataset.column_names):
            return dataset
        path = os.path.join(self.args.output_dir, "ref_logps", f"{name}-{dataset._fingerprint}.pt")
        if os.path.exists(path):
            stored = torch.load(path)
            logger.info("reference log-probs of the %s set read from %s", name, path)
        else:
            size = self.args.precompute_ref_batch_size or batch_size
            inputs = [c for c in self.feature_columns if c in dataset.column_names and c not in columns.values()]
            loader = torch.utils.data.DataLoader(dataset.select_columns(inputs), batch_size=size,
                                                 collate_fn=self.data_collator, shuffle=False)
            was_training = self.model.training
            self.model.eval()
            parts = {key: [] for key in columns}
            for batch in loader:
                batch = self._prepare_inputs(batch)
                for key, logps in self._batch_ref_logps(batch).items():
                    parts[key].append(logps.float().cpu())
            self.model.train(was_training)
            stored = {key: torch.cat(values) for key, values in parts.items()}
            if self.args.should_save:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(stored, path + ".tmp")
                os.replace(path + ".tmp", path)  # atomic: a kill mid-write leaves no half file
            logger.info("reference log-probs of the %s set computed and stored in %s", name, path)
        for key, column in columns.items():
            dataset = dataset.add_column(column, stored[key].tolist())
        return dataset

    # -- loss and metrics ----------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        mode = "train" if self.model.training else "eval"
        model_inputs = self._model_inputs(inputs, full_logits=return_outputs)
        # the full logits when the caller reads them (prediction_step), else only those the loss needs
        keep = self._keeps_logits["policy"] and not return_outputs
        head = None if return_outputs else self.lm_heads["policy"]
        gather = self._gather_index(inputs) if keep or head or self._keeps_logits["reference"] else None
        outputs, stats = self._forward(model, model_inputs, inputs, keep, gather, head)
        chosen, rejected = stats["logps"].chunk(2)
        chosen_len, rejected_len = stats["lengths"].chunk(2)
        ref_chosen = ref_rejected = None
        if self.uses_reference:
            if "ref_chosen_logps" in inputs:
                ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            else:
                ref_chosen, ref_rejected = self._reference_logps(model_inputs, inputs, gather)
        pair_weights = None
        if args.use_weighting:
            w_chosen, w_rejected = wpo_weights(stats["token_logps"], stats["log_sum_sq_probs"], stats["mask"]).chunk(2)
            pair_weights = w_chosen * w_rejected
        loss = combined_loss(args.loss_type, args.loss_weights, chosen, rejected, ref_chosen, ref_rejected,
                             beta=args.beta, label_smoothing=args.label_smoothing, chosen_lengths=chosen_len,
                             rejected_lengths=rejected_len, discopop_tau=args.discopop_tau,
                             f_divergence_type=args.f_divergence_type,
                             f_alpha_divergence_coef=args.f_alpha_divergence_coef, simpo_gamma=args.simpo_gamma,
                             pair_weights=pair_weights)
        if self.aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss  # TRL's: the MoE load-balancing loss
            self.metrics[mode].add("aux_loss", outputs.aux_loss.detach().float(), 1)
        self._add_metrics(mode, stats, chosen, rejected, ref_chosen, ref_rejected, inputs)
        return (loss, outputs) if return_outputs else loss

    def _add_metrics(self, mode, stats, chosen, rejected, ref_chosen, ref_rejected, inputs) -> None:
        """TRL 1.16's DPO metrics of one batch (dpo_trainer.py:1536-1601), as (sum, count) pairs."""
        metrics, beta = self.metrics[mode], self.args.beta
        mask = stats["mask"]
        chosen_mask, rejected_mask = mask.chunk(2)
        n_pairs = chosen.shape[0]
        metrics.add("entropy", (stats["entropy"] * mask).sum(), mask.sum())
        if mode == "train":
            lengths = inputs["sequence_lengths"] if "sequence_lengths" in inputs else inputs["attention_mask"]
            tokens = lengths.sum()
            metrics.add("num_tokens", tokens, 0)  # each sequence's real tokens, as in TRL's padded layout
        chosen_mean_logits, rejected_mean_logits = stats["mean_logits"].chunk(2)
        metrics.add("logits/chosen", (chosen_mean_logits * chosen_mask).sum(), chosen_mask.sum())
        metrics.add("logits/rejected", (rejected_mean_logits * rejected_mask).sum(), rejected_mask.sum())
        chosen_top1, _ = stats["is_top1"].chunk(2)
        metrics.add("mean_token_accuracy", (chosen_top1 * chosen_mask).sum(), chosen_mask.sum())
        if ref_chosen is not None:
            chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        else:  # reference-free: the policy's own log-probs (per token for SimPO / ORPO), as TRL's CPO / ORPO log
            per_token = any(t in REFERENCE_FREE_LOSS_TYPES for t in self.args.loss_type)
            chosen_len, rejected_len = stats["lengths"].chunk(2)
            chosen_rewards = beta * (chosen / chosen_len.clamp(min=1) if per_token else chosen)
            rejected_rewards = beta * (rejected / rejected_len.clamp(min=1) if per_token else rejected)
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        metrics.add("rewards/chosen", chosen_rewards.sum(), n_pairs)
        metrics.add("rewards/rejected", rejected_rewards.sum(), n_pairs)
        metrics.add("rewards/accuracies", (chosen_rewards > rejected_rewards).float().sum(), n_pairs)
        metrics.add("rewards/margins", (chosen_rewards - rejected_rewards).sum(), n_pairs)
        metrics.add("logps/chosen", chosen.detach().sum(), n_pairs)
        metrics.add("logps/rejected", rejected.detach().sum(), n_pairs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            if prediction_loss_only:
                return self.compute_loss(model, inputs).detach(), None, None
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        return loss.detach(), outputs.logits, inputs["input_ids"]  # TRL's: the policy's logits and the input ids
