"""SFTTrainer: supervised fine-tuning as a thin `transformers.Trainer` subclass.

What it adds to `Trainer`: model setup (a hub id / path, a ready model, LoRA or QLoRA through peft and
bitsandbytes, or a ready `PeftModel`), dataset validation and tokenization (`hf_rlhf.data`), the right
collator (padded, packed rows, or padding-free), `use_cache=False` for packed batches, and two logged
metrics: `mean_token_accuracy` and real (non-pad) `tokens_per_second`. Everything else — optimizers,
schedulers, accumulation, checkpoints, DeepSpeed — is the Trainer's own.
"""

from __future__ import annotations

import logging
import time

import torch

from ..collators import PackingCollator, PaddingCollator
from ..configs import ModelConfig, SFTConfig
from ..data import ensure_pad_token, main_process_first_if_cached, prepare_sft_dataset, resolve_chat_template
from ..models import resolve_model
from ..packing_check import check_packing_exact
from .base import BaseTrainer

logger = logging.getLogger("hf_rlhf")


def token_accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct next-token predictions and predicted tokens.

    Args:
        logits: (B, T, V) causal LM logits.
        labels: (B, T) with -100 where no loss is taken.
    Returns:
        (correct, total): 0-dim long tensors, over positions whose shifted label is not -100.
    """
    pred = logits[..., :-1, :].argmax(dim=-1)
    target = labels[..., 1:]
    mask = target != -100
    return ((pred == target) & mask).sum(), mask.sum()


def is_packed_batch(inputs: dict) -> bool:
    """A padding-free batch: restarted `position_ids` and no attention mask."""
    return "position_ids" in inputs and "attention_mask" not in inputs


class SFTTrainer(BaseTrainer):
    """Supervised fine-tuning on `text`, `prompt`/`completion` or conversational (`messages`) data.

    Args:
        model: a hub id or local path (loaded with `model_config`), a `PreTrainedModel`, or a `PeftModel`.
        args: an `SFTConfig`.
        train_dataset / eval_dataset: raw rows in any supported format, or already tokenized rows
            (with `input_ids`), as a `datasets.Dataset` (eval: also a dict of them).
        processing_class: the tokenizer. Default: loaded from the model's path.
        peft_config: a `peft.LoraConfig`; default: built from `model_config` when `use_peft` is set.
        model_config: how to load `model` when it is a string, and the LoRA / QLoRA options.

    Example:
        >>> trainer = SFTTrainer("path/to/model", args=SFTConfig(output_dir="out", packing=True),
        ...                      train_dataset=dataset, model_config=ModelConfig(use_peft=True))
        >>> trainer.train()
    """

    config_class = SFTConfig
    default_output_dir = "sft-output"
    # columns the collators read; the Trainer's remove_unused_columns must keep them
    feature_columns = ("input_ids", "labels", "completion_mask", "assistant_masks", "seq_lengths", "position_ids")

    def __init__(self, model, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, data_collator=None, peft_config=None,
                 model_config: ModelConfig | None = None, callbacks=None, **kwargs):
        args = self.resolve_args(args)
        model, model_config = resolve_model(model, model_config)
        processing_class = self.resolve_tokenizer(processing_class, model)
        resolve_chat_template(processing_class, args.chat_template_path)
        if args.pad_token is not None or not (args.packing or args.padding_free):
            ensure_pad_token(processing_class, args.pad_token)
        model = self.add_peft(model, model_config, args, peft_config)

        train_dataset = self._prepare(train_dataset, processing_class, args, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._prepare(v, processing_class, args, f"eval[{k}]") for k, v in eval_dataset.items()}
        else:
            eval_dataset = self._prepare(eval_dataset, processing_class, args, "eval")

        self.packed = args.packing or args.padding_free
        if self.packed and args.packing_check:  # refuse an architecture whose packed sequences would see each other
            check_packing_exact(model, "packing" if args.packing else "padding_free")
        if data_collator is None:
            data_collator = self._default_collator(model, processing_class, args)
        if self.packed:
            # with the KV cache on, transformers skips packed-sequence detection and examples attend across
            # each other silently; compute_loss also passes use_cache=False per batch
            model.config.use_cache = False

        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, data_collator=data_collator, callbacks=callbacks,
                         **kwargs)
        self._num_tokens = 0
        self._last_log = time.perf_counter()

    # -- setup ---------------------------------------------------------------------------------
    @staticmethod
    def _prepare(dataset, tokenizer, args, name):
        if dataset is None:
            return None
        if "input_ids" in dataset.column_names:
            prepared = dataset
        else:
            with main_process_first_if_cached(args, dataset, f"{name} dataset tokenization"):
                prepared = prepare_sft_dataset(dataset, tokenizer, args)
            logger.info("%s dataset: %d rows tokenized", name, len(prepared))
        if args.packing:
            from trl.data_utils import pack_dataset

            n_before = len(prepared)
            prepared = pack_dataset(prepared, args.max_length, strategy=args.packing_strategy)
            logger.info("%s dataset: %d examples packed into %d rows of <= %d tokens",
                        name, n_before, len(prepared), args.max_length)
        return prepared

    @staticmethod
    def _default_collator(model, tokenizer, args):
        completion_only = args.completion_only_loss is not False
        if args.packing or args.padding_free:
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

    # -- loss and metrics ----------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if is_packed_batch(inputs):
            inputs = {**inputs, "use_cache": False}
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if "labels" in inputs and getattr(outputs, "logits", None) is not None:
            with torch.no_grad():
                correct, total = token_accuracy_counts(outputs.logits, inputs["labels"])
            metrics = self.metrics["train" if model.training else "eval"]
            metrics.add("mean_token_accuracy", correct, total)
            real = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
            metrics.add("num_tokens", real, 0)
        return (loss, outputs) if return_outputs else loss

    def logged_metrics(self, mode: str, totals: dict[str, tuple[float, float]]) -> dict[str, float]:
        """Token accuracy; for training also the real (non-pad) tokens seen so far and their rate since the last log."""
        logs = super().logged_metrics(mode, {k: v for k, v in totals.items() if k != "num_tokens"})
        tokens = totals.get("num_tokens", (0.0, 0.0))[0]
        if mode == "train" and tokens > 0:
            now = time.perf_counter()
            if self._num_tokens is None:  # the run's first log: go on from a resumed checkpoint's count
                counts = [h["num_tokens"] for h in self.state.log_history if "num_tokens" in h]
                self._num_tokens = counts[-1] if counts else 0
            self._num_tokens += tokens
            logs["num_tokens"] = self._num_tokens
            logs["tokens_per_second"] = tokens / max(now - self._last_log, 1e-9)
            self._last_log = now
        return logs

    def train(self, *args, **kwargs):
        self._last_log = time.perf_counter()
        self._num_tokens = None  # set at the first log, from the log history a resumed checkpoint brings back
        return super().train(*args, **kwargs)
