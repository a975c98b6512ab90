"""KTOTrainer: Kahneman-Tversky optimisation from unpaired desirable / undesirable completions, on `DPOTrainer`'s
machinery.

What it changes in `DPOTrainer` (which it subclasses: model and reference set-up, LoRA / QLoRA, the three kinds of
reference, `precompute_ref_log_probs` stored in `output_dir/ref_logps/`, the log-prob paths with `use_logits_to_keep`
and the chunked LM head, the padding-free layout's self-check, TR-DPO's `sync_ref_model`, the MoE router loss):

- trl 1.16's `KTOTrainer` signature and `KTOConfig` fields; rows unpaired (`prompt`, `completion`, `label`) or TRL
  preference pairs split into them, checked row by row before any model loads and tokenized as TRL does, each row
  given its mismatched completion for the KL estimate (`hf_rlhf.data.kto`);
- batches: TRL's own `DataCollatorForUnpairedPreference`, or padding-free, prompt-cached or prefix-shared rows
  (`collators.kto`); `prefix_sharing` reads each prompt's KV cache for its mismatched completion where the
  self-check at init finds that exact, else runs one 4D-masked forward over both;
- `compute_loss`: the policy's summed log-probs of the mismatched completions without gradients and the reference's
  (or the precomputed ones), the KL reference point z0 averaged over ranks (`losses.kto.kl_reference_point`), then
  one policy forward with gradients over the matched sequences and `losses.kto.kto_loss` (`kto`,
  `apo_zero_unpaired`; `desirable_weight`, `undesirable_weight`). Logs TRL 1.16's metrics: `kl`,
  `rewards/{chosen,rejected,margins}`, `logps/{chosen,rejected}`, `logits/{chosen,rejected}`, `entropy`,
  `num_tokens` (and `aux_loss` for an MoE).
"""

from __future__ import annotations

import logging

import torch
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

from ..collators.kto import (
    PaddingFreeUnpairedCollator,
    PrefixSharedUnpairedCollator,
    PromptCachedUnpairedCollator,
    split_unpaired_batch,
    stack_padded_batches,
)
from ..data import main_process_first_if_cached
from ..data.kto import check_kto_rows, prepare_kto_dataset, weight_balance_warning
from ..data.streaming import check_streamed_training, is_streamed
from ..losses.kto import kl_reference_point, kto_loss, uses_kl_reference_point
from ..models.adapters import adapter_scope
from ..models.packing_check import HALF_TOLERANCE, TOLERANCE
from ..models.prompt_cache import read_only_cache
from .dpo_trainer import DPOTrainer
from .kto_config import KTOConfig

logger = logging.getLogger("hf_rlhf")


class KTOTrainer(DPOTrainer):
    """Train a causal LM on completions labelled desirable or undesirable with KTO (or unpaired APO-zero).

    Takes `trl.KTOTrainer`'s (1.16) arguments, in its order and with its names, plus `model_config` (by keyword).

    Args:
        model: a hub id or local path (loaded as a causal LM through `model_config` / `args.model_init_kwargs`), a
            `PreTrainedModel`, or a `PeftModel`.
        ref_model: the reference (a model or a path); None: adapters off for a peft policy, else a frozen copy of
            `model`.
        args: a `KTOConfig`, or a `TrainingArguments` (converted as TRL does).
        data_collator: default: TRL's `DataCollatorForUnpairedPreference` (`padding_free`: `collators.kto`).
        train_dataset / eval_dataset: unpaired rows (`prompt`, `completion`, `label`), pairs in a TRL preference
            format (split into unpaired rows), or tokenized `prompt_ids` / `completion_ids` / `label`; eval: also a
            dict of them.
        processing_class: the tokenizer. Default: loaded from the model's path.
        compute_metrics, callbacks, optimizers: as for `Trainer`.
        quantization_config: a `BitsAndBytesConfig` for a model given as a path (needs a peft adapter).
        peft_config: a peft config; default: LoRA from `model_config.use_peft`.
        model_config: how to load `model` when it is a string, and the LoRA / QLoRA options.

    Example:
        >>> trainer = KTOTrainer("path/to/sft-model", args=KTOConfig(output_dir="kto", beta=0.1),
        ...                      train_dataset=rows, model_config=ModelConfig(use_peft=True))
        >>> trainer.train()
    """

    config_class = KTOConfig
    tag_names = ("hf_rlhf", "trl", "kto")  # TRL's tags too
    default_output_dir = "kto-output"
    feature_columns = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")

    def __init__(self, model, ref_model=None, args: KTOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, *, model_config=None,
                 **kwargs):
        self.check_extra_kwargs(kwargs)
        args = self.resolve_args(args)
        self.calculate_kl = uses_kl_reference_point(args.loss_type)  # TRL's name: calculate_KL
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, quantization_config, peft_config,
                         model_config=model_config)
        # prefix_sharing: the mismatched completions read the prompt from the matched forward's KV cache where the
        # self-check finds that exact (else the one 4D-masked forward over both, checked in DPOTrainer.__init__)
        if (args.prefix_sharing and self.calculate_kl and data_collator is None and args.packing_check
                and self._prompt_cache_exact()):
            self.data_collator = PromptCachedUnpairedCollator(self.processing_class.pad_token_id, args.max_length,
                                                              args.pad_to_multiple_of)

    # -- data (DPOTrainer's hooks) ------------------------------------------------------------------
    @staticmethod
    def _check_rows(dataset, args) -> None:
        check_kto_rows(dataset, args)

    @staticmethod
    def _needs_reference(args) -> bool:
        return True

    @staticmethod
    def _default_collator(args, pad_token_id: int, attn: str | None):
        if args.padding_free:
            return PaddingFreeUnpairedCollator(pad_token_id, args.max_length, args.pad_to_multiple_of,
                                               return_flash_attention_kwargs=str(attn).startswith("flash_attention"))
        if args.prefix_sharing:
            return PrefixSharedUnpairedCollator(pad_token_id, args.max_length, args.pad_to_multiple_of)
        return DataCollatorForUnpairedPreference(pad_token_id=pad_token_id, max_length=args.max_length,
                                                 pad_to_multiple_of=args.pad_to_multiple_of)

    @staticmethod
    def _prepare(dataset, tokenizer, args, name, rows_checked):
        if dataset is None:
            return None
        if name == "train":
            check_streamed_training(args, dataset)
        with main_process_first_if_cached(args, dataset, f"{name} dataset tokenization"):
            prepared = prepare_kto_dataset(dataset, tokenizer, args, args.per_device_train_batch_size,
                                           uses_kl_reference_point(args.loss_type), rows_checked=rows_checked)
        if is_streamed(prepared):  # prepared lazily, as it is read
            return prepared
        logger.info("%s dataset: %d rows", name, len(prepared))
        if name == "train":
            warning = weight_balance_warning(prepared["label"], args.desirable_weight, args.undesirable_weight)
            if warning:
                logger.warning(warning)
        return prepared

    @property
    def ref_columns(self) -> dict:
        columns = {"completion": "ref_logps"}
        return {**columns, "KL": "ref_KL_logps"} if self.calculate_kl else columns

    def _batch_ref_logps(self, batch: dict) -> dict:
        matched, mismatched = split_unpaired_batch(batch)
        if "KL_position_ids" in batch and self.args.prefix_sharing:  # the mismatched rows read the prompt's cache
            logps, kl_logps = self._reference_prompt_cached(matched, mismatched)
            return {"completion": logps, "KL": kl_logps}
        if self.args.prefix_sharing:  # one row per row of data: the matched sequences, then the mismatched ones
            logps = self._reference_stats(self._model_inputs(matched), matched)["logps"]
            n = batch["label"].shape[0]
            return {"completion": logps[:n], "KL": logps[n:]}
        logps, kl_logps = self._reference_logps_of(matched, mismatched if self.calculate_kl else None)
        return {"completion": logps} if kl_logps is None else {"completion": logps, "KL": kl_logps}

    def _reference_logps_of(self, matched: dict, mismatched: dict | None) -> tuple:
        """(matched (B,), mismatched (B,) or None) summed reference log-probs; in the padded layout one forward over
        both (`stack_padded_batches`), else one each."""
        both = None if mismatched is None else stack_padded_batches(matched, mismatched,
                                                                    self.processing_class.pad_token_id)
        if both is not None:
            n = matched["input_ids"].shape[0]
            logps = self._reference_stats(self._model_inputs(both), both)["logps"]
            return logps[:n], logps[n:]
        logps = self._reference_stats(self._model_inputs(matched), matched)["logps"]
        if mismatched is None:
            return logps, None
        return logps, self._reference_stats(self._model_inputs(mismatched), mismatched)["logps"]

    # -- loss and metrics ----------------------------------------------------------------------
    def _policy_mismatched_logps(self, model, mismatched: dict) -> torch.Tensor:
        """(B,) summed log-probs of the mismatched completions under the policy, without gradients."""
        keep, head = self._keeps_logits["policy"], self.lm_heads["policy"]
        with torch.no_grad():
            _, stats = self._forward(model, self._model_inputs(mismatched), mismatched, keep, None, head)
        return stats["logps"]

    def _separate_forwards(self, model, inputs: dict, return_outputs: bool) -> tuple:
        """Padded and padding-free layouts: (outputs, matched stats, policy mismatched logps or None, reference
        logps, reference mismatched logps or None); the mismatched sequences in a forward of their own without
        gradients (TRL's order of work), the reference over both in one forward where they stack."""
        matched, mismatched = split_unpaired_batch(inputs)
        mismatched = mismatched if self.calculate_kl else None
        if "ref_logps" in inputs:
            ref_logps, ref_kl_logps = inputs["ref_logps"], inputs.get("ref_KL_logps")
        else:
            ref_logps, ref_kl_logps = self._reference_logps_of(matched, mismatched)
        kl_logps = None if mismatched is None else self._policy_mismatched_logps(model, mismatched)
        # the policy's matched log-probs with gradients (the full logits when the caller reads them)
        model_inputs = self._model_inputs(matched, full_logits=return_outputs)
        keep = self._keeps_logits["policy"] and not return_outputs
        head = None if return_outputs else self.lm_heads["policy"]
        outputs, stats = self._forward(model, model_inputs, matched, keep, None, head)
        return outputs, stats, kl_logps, ref_logps, ref_kl_logps

    def _shared_forwards(self, model, inputs: dict, return_outputs: bool) -> tuple:
        """`prefix_sharing`: the same, from one policy forward and one reference forward over [prompt | completion |
        mismatched completion] rows; the mismatched log-probs are detached (no gradient flows from them, as TRL's
        no-grad forward), the prompt is computed once."""
        shared, _ = split_unpaired_batch(inputs)
        n = inputs["label"].shape[0]
        model_inputs = self._model_inputs(shared, full_logits=return_outputs)
        if "ref_logps" in inputs:
            ref_logps, ref_kl_logps = inputs["ref_logps"], inputs["ref_KL_logps"]
        else:  # before the policy's forward: its peak memory is not added to the policy's saved activations
            ref = self._reference_stats(model_inputs, shared)["logps"]
            ref_logps, ref_kl_logps = ref[:n], ref[n:]
        keep = self._keeps_logits["policy"] and not return_outputs
        head = None if return_outputs else self.lm_heads["policy"]
        outputs, both = self._forward(model, model_inputs, shared, keep, None, head)
        stats = {key: value[:n] for key, value in both.items()}
        return outputs, stats, both["logps"][n:].detach(), ref_logps, ref_kl_logps

    # -- prefix_sharing through the prompt's KV cache -----------------------------------------------------------
    def _prompt_cached_pair(self, model, matched: dict, mismatched: dict, keep: bool, head, reference: bool = False,
                            full_logits: bool = False) -> tuple:
        """(outputs, matched stats, mismatched logps (B,)): one forward over the [prompt | completion] rows (with
        gradients where enabled) keeping the KV cache, then the mismatched completions without gradients over that
        cache made read-only (`PromptCachedUnpairedCollator`'s rows: each reads its prompt's columns and itself), so
        the prompt is computed once and no activation of a mismatched token is kept for the backward."""
        model_inputs = {**self._model_inputs(matched, full_logits=full_logits), "use_cache": True}
        outputs, stats = self._forward(model, model_inputs, matched, keep, None, head, reference=reference)
        cache = read_only_cache(outputs.past_key_values)
        if cache is None:
            raise RuntimeError(f"prefix_sharing: the model returned a {type(outputs.past_key_values).__name__}, not "
                               "a DynamicCache of full-attention layers, for the mismatched completions to read.")
        outputs.past_key_values = None
        kl_inputs = {"input_ids": mismatched["input_ids"], "attention_mask": mismatched["attention_mask"],
                     "position_ids": mismatched["position_ids"], "past_key_values": cache, "use_cache": True}
        targets = {"input_ids": mismatched["input_ids"], "completion_mask": mismatched["completion_mask"]}
        with torch.no_grad():
            _, kl_stats = self._forward(model, kl_inputs, targets, keep, None, head, reference=reference)
        del cache, kl_inputs
        return outputs, stats, kl_stats["logps"]

    @torch.no_grad()
    def _reference_prompt_cached(self, matched: dict, mismatched: dict) -> tuple:
        """(matched, mismatched) (B,) summed reference log-probs, the prompt computed once (`_prompt_cached_pair`)."""
        keep, head = self._keeps_logits["reference"], self.lm_heads["reference"]
        if self.ref_model is not None:
            _, stats, kl_logps = self._prompt_cached_pair(self.ref_model, matched, mismatched, keep, head, True)
        else:  # a peft policy: the base with every adapter off
            with adapter_scope(self.accelerator.unwrap_model(self.model), None):
                _, stats, kl_logps = self._prompt_cached_pair(self.model, matched, mismatched, keep, head, True)
        return stats["logps"], kl_logps

    def _cached_forwards(self, model, inputs: dict, return_outputs: bool) -> tuple:
        """`prefix_sharing` through the prompt's KV cache: the reference's two forwards (or the precomputed log-probs)
        first, then the policy's matched forward with gradients and its mismatched one without."""
        matched, mismatched = split_unpaired_batch(inputs)
        if "ref_logps" in inputs:
            ref_logps, ref_kl_logps = inputs["ref_logps"], inputs["ref_KL_logps"]
        else:  # before the policy's forward: its peak memory is not added to the policy's saved activations
            ref_logps, ref_kl_logps = self._reference_prompt_cached(matched, mismatched)
        keep = self._keeps_logits["policy"] and not return_outputs
        head = None if return_outputs else self.lm_heads["policy"]
        outputs, stats, kl_logps = self._prompt_cached_pair(model, matched, mismatched, keep, head,
                                                            full_logits=return_outputs)
        return outputs, stats, kl_logps, ref_logps, ref_kl_logps

    def _prompt_cache_exact(self) -> bool:
        """Whether the mismatched completions' log-probs read through the prompt's cache (`_prompt_cached_pair`)
        equal those of the padded [prompt | mismatched completion] rows, on two short random rows, for the policy
        and the reference; False (with an info line) where they do not or the cache is not one it reads."""
        model = self.accelerator.unwrap_model(self.model)
        config = model.config.get_text_config()
        generator = torch.Generator().manual_seed(0)
        ids = lambda n: torch.randint(3, config.vocab_size, (n,), generator=generator).tolist()  # noqa: E731
        features = [{"prompt_ids": ids(5), "completion_ids": ids(3), "KL_completion_ids": ids(4), "label": True},
                    {"prompt_ids": ids(2), "completion_ids": ids(5), "KL_completion_ids": ids(2), "label": False}]
        pad = self.processing_class.pad_token_id
        device = next(model.parameters()).device
        to = lambda b: {k: v.to(device) for k, v in b.items()}  # noqa: E731
        cached = split_unpaired_batch(to(PromptCachedUnpairedCollator(pad)(features)))
        padded = split_unpaired_batch(to(DataCollatorForUnpairedPreference(pad_token_id=pad)(features)))
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                roles = [("policy", self.model)] + ([("reference", self.ref_model)] if self.ref_model is not None
                                                    else [])
                for role, net in roles:
                    keep, head = self._keeps_logits[role], self.lm_heads[role]
                    _, stats, got = self._prompt_cached_pair(net, *cached, keep, head, role == "reference")
                    want = [self._forward(net, self._model_inputs(side), side, keep, None, head,
                                          reference=role == "reference")[1]["logps"] for side in padded]
                    got, want = torch.cat([stats["logps"], got]).float(), torch.cat(want).float()
                    relative = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
                    dtype = next(net.parameters()).dtype
                    if not relative <= TOLERANCE.get(dtype, HALF_TOLERANCE):
                        logger.info("prefix_sharing: the %s's prompt cache is %.2g off the padded rows; the 4D-masked "
                                    "layout is used", role, relative)
                        return False
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            logger.info("prefix_sharing: the prompt cache is not read on this model (%s); the 4D-masked layout is "
                        "used", err)
            return False
        finally:
            model.train(was_training)
        return True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        mode = "train" if self.model.training else "eval"
        forwards = self._separate_forwards
        if args.prefix_sharing:
            forwards = self._cached_forwards if "KL_position_ids" in inputs else self._shared_forwards
        outputs, stats, kl_logps, ref_logps, ref_kl_logps = forwards(model, inputs, return_outputs)
        kl = None  # the reference point z0 from the mismatched pairs, averaged over ranks
        if kl_logps is not None:
            kl = kl_reference_point(kl_logps, ref_kl_logps, gather=self.accelerator.gather)
        labels = inputs["label"].bool()
        loss, _, rewards = kto_loss(stats["logps"], ref_logps, labels, kl, beta=args.beta, loss_type=args.loss_type,
                                    desirable_weight=args.desirable_weight,
                                    undesirable_weight=args.undesirable_weight)
        if self.aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss  # TRL's: the MoE load-balancing loss
            self.metrics[mode].add("aux_loss", outputs.aux_loss.detach().float(), 1)
        self._add_kto_metrics(mode, stats, rewards, labels, kl, inputs)
        return (loss, outputs) if return_outputs else loss

    def _add_kto_metrics(self, mode, stats, rewards, labels, kl, inputs) -> None:
        """TRL 1.16's KTO metrics of one batch (kto_trainer.py:1462-1522), as (sum, count) pairs."""
        metrics = self.metrics[mode]
        mask = stats["mask"]
        metrics.add("kl", kl if kl is not None else torch.zeros((), device=mask.device), 1)  # TRL logs 0 without
        metrics.add("entropy", (stats["entropy"] * mask).sum(), mask.sum())
        if mode == "train":
            # the matched sequences' real tokens (TRL's: their attention mask), in every layout
            lengths = inputs["sequence_lengths"][: labels.shape[0]] if "sequence_lengths" in inputs else \
                inputs["attention_mask"]
            metrics.add("num_tokens", lengths.sum(), 0)
        logps = stats["logps"].detach()
        for name, rows in (("chosen", labels), ("rejected", ~labels)):
            tokens = mask * rows[:, None]
            metrics.add(f"logits/{name}", (stats["mean_logits"] * tokens).sum(), tokens.sum())
            metrics.add(f"rewards/{name}", rewards[rows].sum(), rows.sum())
            metrics.add(f"logps/{name}", logps[rows].sum(), rows.sum())
        # TRL's margin: per batch with both labels, chosen mean − rejected mean (weight 0 otherwise: every rank
        # adds the same names)
        both = bool(labels.any() and (~labels).any())
        margin = rewards[labels].mean() - rewards[~labels].mean() if both else rewards.new_zeros(())
        metrics.add("rewards/margins", margin, float(both))
