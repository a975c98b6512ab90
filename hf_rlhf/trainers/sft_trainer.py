"""SFTTrainer: supervised fine-tuning as a thin `transformers.Trainer` subclass.

What it adds to `Trainer`: model setup (a hub id / path, a ready model, LoRA or QLoRA through peft and
bitsandbytes, or a ready `PeftModel`), dataset validation and tokenization (`hf_rlhf.data`), the right
collator (padded, packed rows, or padding-free), `use_cache=False` for packed batches, and TRL 1.16's logged
metrics, in train and eval logs: `entropy` (mean entropy of the predicted next-token distribution over the loss
tokens), `mean_token_accuracy` and `num_tokens` (real, non-pad input tokens trained on so far). The loss and those
metrics come from the last hidden states, the LM head applied to a chunk of the loss tokens at a time, never the
(B, T, V) logits (`SFTConfig.chunked_lm_head`, `hf_rlhf.models.lm_head`; TRL 1.16's fused LM head does the same).
Everything else — optimizers, schedulers, accumulation, checkpoints, DeepSpeed — is the Trainer's own.
"""

from __future__ import annotations

import logging
from dataclasses import fields

import torch
from transformers import TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..collators import PackingCollator, PaddingCollator
from ..data import (
    apply_formatting_func,
    check_sft_rows,
    ensure_pad_token,
    main_process_first_if_cached,
    prepare_sft_dataset,
    resolve_chat_template,
)
from ..data.chatml import to_chatml
from ..data.options import SFTDataOptions
from ..data.sft import build_labels
from ..data.streaming import check_streamed_training, first_rows, is_streamed, stream_columns
from ..losses.sft import dft_compute_loss_func, dft_token_losses
from ..models.adapters import unwrap_peft
from ..models.lm_head import last_hidden_states, resolve_lm_head
from ..models.loading import check_trainable, resolve_model, set_router_aux_loss
from ..models.packing_check import check_packing_exact
from .base_trainer import BaseTrainer
from .metrics import real_token_count
from .model_config import ModelConfig
from .sft_config import SFTConfig

logger = logging.getLogger("hf_rlhf")


def token_accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct next-token predictions and predicted tokens.

    Args:
        logits: (B, T', V) causal LM logits, T' >= T (virtual tokens of prompt learning first, skipped).
        labels: (B, T) with -100 where no loss is taken.
    Returns:
        (correct, total): 0-dim long tensors, over positions whose shifted label is not -100.
    """
    logits = logits[..., -labels.shape[-1]:, :]  # prompt-learning adapters put virtual tokens first
    pred = logits[..., :-1, :].argmax(dim=-1)
    target = labels[..., 1:]
    mask = target != -100
    return ((pred == target) & mask).sum(), mask.sum()


def token_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed entropy of the predicted next-token distributions at the positions that take a loss.

    As `trl.SFTTrainer` 1.16's `entropy` metric (its fused LM head's per-token entropy, summed over the tokens
    whose shifted label is not -100); divide by `token_accuracy_counts`'s total for the mean.

    Args:
        logits: (B, T', V) causal LM logits, T' >= T (virtual tokens of prompt learning first, skipped).
        labels: (B, T) with -100 where no loss is taken.
    Returns:
        0-dim float tensor: Σ over those positions of H(softmax(logits)) = logsumexp(l) − Σ softmax(l)·l.
    """
    logits = logits[..., -labels.shape[-1]:, :]  # prompt-learning adapters put virtual tokens first
    picked = logits[..., :-1, :][labels[..., 1:] != -100].float()  # (N, V)
    log_probs = torch.log_softmax(picked, dim=-1)
    return -(log_probs.exp() * log_probs).sum()


def packed_real_token_count(input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                            pad_token_id: int | None) -> torch.Tensor:
    """Real tokens of a packed batch: every token but the dummy sequence `PackingCollator` pads each row with.

    The padding is each row's last sequence (from its last `position_ids == 0`) when that sequence is all pad
    tokens with label -100; a real document always has a label past its first token (untrainable rows are dropped
    when the dataset is prepared).

    Args:
        input_ids, position_ids, labels: (B, T) packed rows (a flattened row is (1, N)).
        pad_token_id: the collator's pad id (None: 0, as `PackingCollator`).
    Returns:
        0-dim long tensor.
    """
    pad_token_id = 0 if pad_token_id is None else pad_token_id
    width = input_ids.shape[-1]
    columns = torch.arange(width, device=input_ids.device)
    last_start = torch.where(position_ids == 0, columns, -1).max(dim=-1, keepdim=True).values  # (B, 1)
    in_last = columns >= last_start
    is_padding = (((input_ids == pad_token_id) & (labels == -100)) | ~in_last).all(dim=-1)  # (B,)
    return input_ids.numel() - ((width - last_start.squeeze(-1)) * is_padding).sum()


def is_packed_batch(inputs: dict) -> bool:
    """A padding-free batch: restarted `position_ids` and no attention mask."""
    return "position_ids" in inputs and "attention_mask" not in inputs


class SFTTrainer(BaseTrainer):
    """Supervised fine-tuning on `text`, `prompt`/`completion` or conversational (`messages`) data.

    Takes `trl.SFTTrainer`'s (1.16) arguments, in its order and with its names, plus `model_config` (by keyword).

    Args:
        model: a hub id or local path (loaded with `model_config` and `args.model_init_kwargs`), a
            `PreTrainedModel`, or a `PeftModel`.
        args: an `SFTConfig`, or any `TrainingArguments` (converted to an `SFTConfig` as TRL does).
        data_collator: default: padded batches, or padding-free / packed rows (`PaddingCollator`,
            `PackingCollator`).
        train_dataset / eval_dataset: raw rows in any supported format, or already tokenized rows
            (with `input_ids`), as a `datasets.Dataset` or a streamed `datasets.IterableDataset` (eval: also a dict
            of them). A streamed train set needs `max_steps`; it is tokenized, validated row by row and (with
            `packing`) packed on the fly as it streams (`hf_rlhf.data.streaming`).
        processing_class: the tokenizer. Default: loaded from the model's path.
        compute_loss_func, compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics: as for `transformers.Trainer`.
        quantization_config: a `BitsAndBytesConfig` for a model given as a path (needs a peft adapter to train).
        peft_config: any peft config (LoRA, DoRA, IA3, prompt tuning, p-tuning, prefix tuning, ...); default: a
            LoRA config built from `model_config` when `use_peft` is set.
        formatting_func: `row -> str`, applied to each row before tokenization (as TRL): the text to train on.
        model_config: how to load `model` when it is a string, and the LoRA / QLoRA options.

    Example:
        >>> trainer = SFTTrainer("path/to/model", args=SFTConfig(output_dir="out", packing=True),
        ...                      train_dataset=dataset, model_config=ModelConfig(use_peft=True))
        >>> trainer.train()
    """

    config_class = SFTConfig
    tag_names = ("hf_rlhf", "trl", "sft")  # TRL's tags too: scripts and hub searches look for them
    default_output_dir = "sft-output"
    counts_tokens = True
    # columns the collators read; the Trainer's remove_unused_columns must keep them
    feature_columns = ("input_ids", "labels", "completion_mask", "assistant_masks", "seq_lengths", "position_ids")

    def __init__(self, model, args: SFTConfig | TrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_loss_func=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, quantization_config=None, peft_config=None, formatting_func=None,
                 *, model_config: ModelConfig | None = None, **kwargs):
        self.check_extra_kwargs(kwargs)
        self.require_train_dataset(train_dataset)
        args = self.resolve_args(args)
        if formatting_func is None and not args.skip_prepare_dataset:
            train_dataset, eval_dataset = to_chatml(train_dataset), to_chatml(eval_dataset)  # ShareGPT rows, as TRL
            checked = self.check_rows_first((train_dataset, eval_dataset), lambda d: check_sft_rows(d, args))
        else:  # rows become text only once formatted; skipped datasets go to the collator as they are
            checked = set()
        model, model_config = resolve_model(model, model_config,
                                            **self.model_init_kwargs(model, args, quantization_config))
        processing_class = self.resolve_tokenizer(processing_class, model, args)
        resolve_chat_template(processing_class, args.chat_template_path)
        packs = args.packing or args.padding_free or bool(args.eval_packing)
        if args.pad_token is not None or not packs:
            ensure_pad_token(processing_class, args.pad_token)
        model = self.add_peft(model, model_config, args, peft_config)
        check_trainable(model)
        # TRL's attribute: the MoE load-balancing loss is on (the model adds it to its loss)
        self.aux_loss_enabled = set_router_aux_loss(model, args.router_aux_loss_coef)
        if args.loss_type == "dft":
            if compute_loss_func is not None:
                raise ValueError("loss_type='dft' sets the loss; a compute_loss_func cannot be given with it "
                                 "(as in TRL).")
            compute_loss_func = dft_compute_loss_func
        if formatting_func is not None and args.completion_only_loss:
            raise ValueError("formatting_func makes plain text, which has no completion to restrict the loss to; "
                             "set completion_only_loss to None or False, or format the dataset yourself (as TRL).")

        def prepare(dataset, name, packing):
            if dataset is not None and formatting_func is not None and not args.skip_prepare_dataset:
                dataset = apply_formatting_func(dataset, formatting_func, args.dataset_text_field)
            if args.skip_prepare_dataset:
                return self._check_skipped(dataset, name, data_collator)
            return self._prepare(dataset, processing_class, args, name, packing=packing,
                                 rows_checked=id(dataset) in checked)

        train_dataset = prepare(train_dataset, "train", args.packing)
        eval_packing = args.packing if args.eval_packing is None else args.eval_packing
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: prepare(v, f"eval[{k}]", eval_packing) for k, v in eval_dataset.items()}
        else:
            eval_dataset = prepare(eval_dataset, "eval", eval_packing)

        self.formatting_func = formatting_func
        self.packed = packs
        if self.packed and args.packing_check:  # refuse an architecture whose packed sequences would see each other
            check_packing_exact(model, "packing" if args.packing or args.eval_packing else "padding_free")
        if data_collator is None:
            data_collator = self._default_collator(model, processing_class, args)
        if self.packed:
            # with the KV cache on, transformers skips packed-sequence detection and examples attend across
            # each other silently; compute_loss also passes use_cache=False per batch
            model.config.use_cache = False

        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self.lm_head = self._resolve_lm_head(args)

    def prepare_eval_dataset(self, dataset, name: str):
        """A dataset passed to `evaluate`: raw rows formatted, checked and tokenized like the eval sets of
        `__init__` (packed with `eval_packing`); a tokenized one is left as it is; one that `skip_prepare_dataset`
        skips goes to the collator as it is."""
        args = self.args
        if args.skip_prepare_dataset:
            return dataset
        columns = stream_columns(dataset, first_rows(dataset)[0]) if is_streamed(dataset) else dataset.column_names
        if "input_ids" in columns:
            return dataset
        if self.formatting_func is not None:
            dataset = apply_formatting_func(dataset, self.formatting_func, args.dataset_text_field)
        else:
            dataset = to_chatml(dataset)
        packing = args.packing if args.eval_packing is None else args.eval_packing
        return self._prepare(dataset, self.processing_class, args, name, packing=packing)

    # -- setup ---------------------------------------------------------------------------------
    @staticmethod
    def _check_skipped(dataset, name, data_collator):
        # dataset_kwargs={"skip_prepare_dataset": True}: rows reach the collator as they are
        if dataset is not None and data_collator is None and "input_ids" not in (dataset.column_names or []):
            raise ValueError(f"dataset_kwargs skip_prepare_dataset=True: the {name} dataset goes to the collator "
                             "untokenized, so it needs an input_ids column (or pass a data_collator that tokenizes).")
        return dataset

    @staticmethod
    def _prepare(dataset, tokenizer, args, name, packing: bool | None = None, rows_checked: bool = False):
        if dataset is None:
            return None
        if name == "train":
            check_streamed_training(args, dataset)
        packing = args.packing if packing is None else packing
        streamed = is_streamed(dataset)
        columns = stream_columns(dataset, first_rows(dataset)[0]) if streamed else dataset.column_names
        pretokenized = "input_ids" in columns
        if pretokenized:
            prepared = dataset
        else:
            options = args
            if packing and args.packing_strategy != "bfd":
                # bfd_split / wrapped pack the overflow of a long example instead of cutting it (as TRL)
                options = SFTDataOptions(**{**{f.name: getattr(args, f.name) for f in fields(SFTDataOptions)},
                                            "max_length": None})
            with main_process_first_if_cached(args, dataset, f"{name} dataset tokenization"):
                prepared = prepare_sft_dataset(dataset, tokenizer, options, rows_checked=rows_checked)
            if not streamed:
                logger.info("%s dataset: %d rows tokenized", name, len(prepared))
        # TRL's `labels` column, from the masks (which it replaces); pre-tokenized rows also get the over-long policy
        # here, as TRL truncates them (packing cuts rows itself)
        prepared = build_labels(prepared, args.completion_only_loss,
                                args.max_length if pretokenized and not packing else None, args.overlong_policy,
                                None if streamed else args.dataset_num_proc)
        if args.shuffle_dataset:  # before packing too, as TRL: which examples share a row is then random
            prepared = prepared.shuffle(seed=args.seed)
        if packing:
            from trl.data_utils import pack_dataset

            # a stream is packed on the fly, as TRL's: best-fit decreasing within each window of 1000 examples
            packed = pack_dataset(prepared, args.max_length, strategy=args.packing_strategy)
            if not streamed:
                logger.info("%s dataset: %d examples packed into %d rows of <= %d tokens",
                            name, len(prepared), len(packed), args.max_length)
            prepared = packed.shuffle(seed=args.seed) if args.shuffle_dataset else packed
        return prepared

    @staticmethod
    def _default_collator(model, tokenizer, args):
        completion_only = args.completion_only_loss is not False
        if args.packing or args.padding_free or args.eval_packing:
            attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
            flash = attn.startswith("flash_attention")
            return PackingCollator(completion_only_loss=completion_only,
                                   assistant_only_loss=args.assistant_only_loss,
                                   return_flash_attention_kwargs=flash,
                                   pad_to_multiple_of=args.pad_to_multiple_of,
                                   pad_token_id=tokenizer.pad_token_id,
                                   # pre-packed rows stay B rows on sdpa/eager: their dense mask per row costs
                                   # B·T² where one flattened row costs (B·T)²; flash's varlen kernels want one row
                                   flatten=flash or not args.packing)
        return PaddingCollator(pad_token_id=tokenizer.pad_token_id, completion_only_loss=completion_only,
                               assistant_only_loss=args.assistant_only_loss,
                               pad_to_multiple_of=args.pad_to_multiple_of)

    def _resolve_lm_head(self, args):
        """The LM head the loss runs over in chunks of tokens (`SFTConfig.chunked_lm_head`), or None: full logits."""
        parallel = getattr(self.accelerator, "parallelism_config", None)
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        why = None
        if self.compute_loss_func not in (None, dft_compute_loss_func):
            why = "a compute_loss_func reads the logits"
        elif args.label_smoothing_factor:
            why = "label smoothing reads the logits"
        elif self.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3):
            why = "FSDP / DeepSpeed ZeRO-3 shard the LM head outside the model's forward"
        elif parallel is not None and (parallel.sp_enabled or parallel.cp_enabled):
            why = "sequence / context parallelism shard the sequence"
        if why is None:
            return resolve_lm_head(self.model, args.chunked_lm_head, type(self).__name__)
        if args.chunked_lm_head:
            raise ValueError(f"chunked_lm_head=True, but {why}; leave chunked_lm_head None or False.")
        return None

    # -- loss and metrics ----------------------------------------------------------------------
    def _chunked_loss(self, model, inputs, num_items_in_batch, mode):
        """(loss, outputs) as `Trainer.compute_loss` gives them with labels (nll: transformers' `ForCausalLMLoss`,
        dft: `dft_loss`), and TRL's `entropy` / `mean_token_accuracy`, from the last hidden states of the loss
        tokens only, the LM head applied in chunks (`hf_rlhf.models.lm_head`)."""
        labels = inputs["labels"]
        # the model's own forward, eval included: an MoE's aux_loss is part of the loss
        hidden, outputs = last_hidden_states(model, False, **{k: v for k, v in inputs.items() if k != "labels"})
        target = labels[:, 1:]
        mask = target != -100
        hidden = hidden[:, -labels.shape[1]:-1][mask]  # (N, H): the positions that predict a label
        logprobs, entropy, top1, *_ = self.lm_head.token_logprobs(hidden, target[mask], with_entropy=True,
                                                                  with_top1=True)
        tokens = mask.sum()
        if self.compute_loss_func is dft_compute_loss_func:  # called without labels: no MoE aux loss (as the Trainer)
            count = tokens if num_items_in_batch is None else num_items_in_batch
            loss = dft_token_losses(logprobs).sum() / torch.as_tensor(count, device=tokens.device).clamp(min=1)
        else:  # ForCausalLMLoss: the sum over num_items_in_batch when the model takes it, else the mean
            items = num_items_in_batch if self.model_accepts_loss_kwargs else None
            loss = -logprobs.sum() / (tokens if items is None else torch.as_tensor(items, device=tokens.device))
            aux = getattr(outputs, "aux_loss", None)
            if aux is not None:  # the MoE model adds its weighted load-balancing loss when given labels
                base = unwrap_peft(self.model)
                coef = getattr(base, "router_aux_loss_coef", None)
                coef = base.config.get_text_config().router_aux_loss_coef if coef is None else coef
                loss = loss + coef * aux.to(loss.device)
        if (self.args.average_tokens_across_devices and num_items_in_batch is not None
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
            loss = loss * (self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1
                           else self.args.n_gpu)  # as `Trainer.compute_loss`
        metrics = self.metrics[mode]
        metrics.add("entropy", entropy.detach().sum(), tokens)
        metrics.add("mean_token_accuracy", top1.sum(), tokens)
        return loss, CausalLMOutputWithPast(loss=loss), getattr(outputs, "aux_loss", None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if is_packed_batch(inputs):
            inputs = {**inputs, "use_cache": False}
        mode = "train" if model.training else "eval"
        # an eval with compute_metrics needs the logits themselves
        if self.lm_head is not None and "labels" in inputs and not (return_outputs and self.compute_metrics):
            loss, outputs, aux_loss = self._chunked_loss(model, inputs, num_items_in_batch, mode)
        else:
            loss, outputs = self._logits_loss(model, inputs, num_items_in_batch, mode)
            aux_loss = getattr(outputs, "aux_loss", None)
        if self.aux_loss_enabled and aux_loss is not None:
            # TRL's `aux_loss`: the MoE load-balancing loss (unweighted), a mean over the steps of the log
            self.metrics[mode].add("aux_loss", aux_loss.detach().float(), 1)
        if mode == "train":
            if is_packed_batch(inputs) and "labels" in inputs:
                real = packed_real_token_count(inputs["input_ids"], inputs["position_ids"], inputs["labels"],
                                               getattr(self.data_collator, "pad_token_id", None))
            else:
                real = real_token_count(inputs)
            self.metrics[mode].add("num_tokens", real, 0)
        return (loss, outputs) if return_outputs else loss

    def _logits_loss(self, model, inputs, num_items_in_batch, mode):
        """(loss, outputs) of `Trainer.compute_loss` (the full logits), and TRL's metrics from the logits."""
        # a copy: with a compute_loss_func (dft) the Trainer pops the labels, which the metrics read after
        loss, outputs = super().compute_loss(model, dict(inputs), return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if "labels" in inputs and getattr(outputs, "logits", None) is not None:
            with torch.no_grad():
                correct, total = token_accuracy_counts(outputs.logits, inputs["labels"])
                entropy = token_entropy_sum(outputs.logits, inputs["labels"])
            metrics = self.metrics[mode]
            metrics.add("entropy", entropy, total)
            metrics.add("mean_token_accuracy", correct, total)
        return loss, outputs
