"""RewardTrainer: pairwise reward modelling as a thin `transformers.Trainer` subclass.

What it adds to `Trainer`: model setup (a path loaded as `AutoModelForSequenceClassification(num_labels=1)`,
a ready sequence-classification model or `ValueHeadModel`, LoRA / QLoRA through peft with the head trained
and saved with the adapter), preference-pair validation and tokenization (`hf_rlhf.data.preference`), the
`PairwiseCollator` (padded, padding-free or prefix-shared), and:

- `compute_loss`: one forward over chosen‖rejected (2B sequences), each reward read at its sequence's last
  real token, then `losses.pairwise_reward_loss` (margin, centering); logs TRL 1.16's metrics in train and
  eval logs: `accuracy`, `margin` (means over pairs), `min_reward` / `mean_reward` / `max_reward` (over every
  chosen and rejected reward) and `num_tokens` (real tokens trained on so far, chosen and rejected).
- `prediction_step`: returns the rewards as TRL's does: (2B, 1) predictions, each batch's chosen rewards then its
  rejected ones, and no labels (`label_ids == ()`), so a `compute_metrics` written for TRL reads the same arrays.
- `compute_reward_stats`: mean / std of the rewards over a dataset, stored in the model config for PPO.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForSequenceClassification, TrainingArguments

from ..collators import PairwiseCollator
from ..data import check_preference_rows, ensure_pad_token, main_process_first_if_cached, prepare_preference_dataset
from ..data.chatml import to_chatml
from ..data.preference import rename_legacy_pair_columns
from ..data.streaming import check_streamed_training, is_streamed
from ..losses.reward import pairwise_metric_sums, pairwise_reward_loss
from ..models.loading import check_trainable, disable_dropout, resolve_model
from ..models.packing_check import check_packing_exact
from ..models.value_head import (
    ValueHeadModel,
    find_score_head,
    gather_last_token_scores,
    load_reward_stats,
    reward_config_of,
    save_reward_stats,
    set_reward_stats,
    token_scores,
)
from ..tensors import additive_mask
from .base_trainer import BaseTrainer
from .metrics import real_token_count
from .model_config import ModelConfig
from .reward_config import RewardConfig

logger = logging.getLogger("hf_rlhf")

_LOSS_ONLY_KEYS = ("margin", "last_token_index")  # batch keys the model does not take


class RewardTrainer(BaseTrainer):
    """Train a reward model on preference pairs (`chosen` / `rejected`, optional `prompt` and `margin`).

    Takes `trl.RewardTrainer`'s (1.16) arguments, in its order and with its names, plus `model_config` (by keyword).

    Args:
        model: a hub id or local path (loaded as a sequence-classification model with one label, through
            `model_config` and `args.model_init_kwargs`), a sequence-classification `PreTrainedModel`, a
            `ValueHeadModel`, or a `PeftModel`.
        args: a `RewardConfig`, or any `TrainingArguments` (converted to a `RewardConfig` as TRL does).
        data_collator: default: `PairwiseCollator` (padded, padding-free or prefix-shared).
        train_dataset / eval_dataset: preference rows in any supported format (see `hf_rlhf.data.preference`),
            or tokenized rows (`chosen_ids`, `rejected_ids`), as a `datasets.Dataset` or a streamed
            `datasets.IterableDataset` (validated and tokenized row by row as it streams; training on a stream
            needs `max_steps`); eval: also a dict of them.
        processing_class: the tokenizer. Default: loaded from the model's path.
        compute_metrics: extra evaluation metrics from an `EvalPrediction` shaped as TRL 1.16 gives it:
            `predictions` (2N, 1), per eval batch of B pairs its B chosen rewards then its B rejected ones;
            `label_ids` an empty tuple. Accuracy, margin and min / mean / max reward are always reported. As in TRL,
            when the eval set's size is not a multiple of the eval batch size, accelerate's `gather_for_metrics`
            keeps only the first rows of the last batch's predictions (it counts pairs, the batch holds 2 rows
            per pair): the logged eval metrics are exact, `predictions` then lack that batch's last rejected ones.
        callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics: as for `Trainer`.
        quantization_config: a `BitsAndBytesConfig` for a model given as a path (needs a peft adapter to train).
        peft_config: a peft config that adapts weights (LoRA, DoRA, IA3, ...; prompt learning is refused: the
            reward is read at each sequence's own last token); default: LoRA from `model_config.use_peft`.
        model_config: how to load `model` when it is a string, and the LoRA / QLoRA options.

    Example:
        >>> trainer = RewardTrainer("path/to/sft-model", args=RewardConfig(output_dir="rm"),
        ...                         train_dataset=pairs, model_config=ModelConfig(use_peft=True))
        >>> trainer.train()
    """

    config_class = RewardConfig
    tag_names = ("hf_rlhf", "trl", "reward-trainer")  # TRL's tags too
    default_output_dir = "reward-output"
    counts_tokens = True
    feature_columns = ("chosen_ids", "rejected_ids", "margin")  # what PairwiseCollator reads
    loss_is_scaled_for_ga = False  # the loss is a mean over the batch's pairs; the Trainer divides by GA steps

    def __init__(self, model, args: RewardConfig | TrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None, *, model_config: ModelConfig | None = None, **kwargs):
        self.check_extra_kwargs(kwargs)
        self.require_train_dataset(train_dataset)
        # ShareGPT rows and TRL's legacy tokenized columns, converted as TRL does
        train_dataset = rename_legacy_pair_columns(to_chatml(train_dataset))
        eval_dataset = rename_legacy_pair_columns(to_chatml(eval_dataset))
        args = self.resolve_args(args)
        init_kwargs = {"num_labels": 1, **self.model_init_kwargs(model, args, quantization_config)}
        checked = self.check_rows_first((train_dataset, eval_dataset), lambda d: check_preference_rows(d, args))
        model, model_config = resolve_model(model, model_config, AutoModelForSequenceClassification, **init_kwargs)
        find_score_head(model)  # a model that cannot give one reward per sequence fails here, not mid-training
        processing_class = self.resolve_tokenizer(processing_class, model, args)
        if args.pad_token is not None or not args.padding_free:
            ensure_pad_token(processing_class, args.pad_token)
        reward_config_of(model).pad_token_id = processing_class.pad_token_id
        self._check_layout(model, args)
        # SEQ_CLS: peft trains and saves `score` with the adapter; a ValueHeadModel's head stays outside it
        model = self.add_peft(model, model_config, args, peft_config,
                              task_type="CAUSAL_LM" if isinstance(model, ValueHeadModel) else "SEQ_CLS",
                              prompt_learning=False)
        check_trainable(model)
        if args.disable_dropout:
            disable_dropout(model)
        if args.packing_check and (args.padding_free or args.prefix_sharing):  # refuse a layout the model breaks
            check_packing_exact(model, "padding_free" if args.padding_free else "prefix_sharing", args.max_length)

        train_dataset = self._prepare(train_dataset, processing_class, args, "train", id(train_dataset) in checked)
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._prepare(v, processing_class, args, f"eval[{k}]", id(v) in checked)
                            for k, v in eval_dataset.items()}
        else:
            eval_dataset = self._prepare(eval_dataset, processing_class, args, "eval", id(eval_dataset) in checked)
        if data_collator is None:
            attn = getattr(reward_config_of(model), "_attn_implementation", None) or ""
            data_collator = PairwiseCollator(
                processing_class.pad_token_id if processing_class.pad_token_id is not None else 0,
                padding_side=args.padding_side, padding_free=args.padding_free, prefix_sharing=args.prefix_sharing,
                pad_to_multiple_of=args.pad_to_multiple_of,
                return_flash_attention_kwargs=args.padding_free and attn.startswith("flash_attention"))

        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self.label_names = []  # no labels: prediction_step makes its own
        self._score_head = find_score_head(self.model)  # after peft: the wrapped head
        self._eager = getattr(reward_config_of(self.model), "_attn_implementation", None) == "eager"

    # -- setup ---------------------------------------------------------------------------------
    @staticmethod
    def _check_layout(model, args):
        attn = getattr(reward_config_of(model), "_attn_implementation", None)
        if args.prefix_sharing and attn not in ("sdpa", "eager"):
            raise ValueError(f"prefix_sharing needs a custom attention mask, which {attn!r} attention does not "
                             "take; use attn_implementation='sdpa' or 'eager', or padding_free=True")

    def prepare_eval_dataset(self, dataset, name: str):
        """A dataset passed to `evaluate`: preference rows checked and tokenized like the eval sets of `__init__`
        (already tokenized pairs are taken as they are)."""
        return self._prepare(rename_legacy_pair_columns(to_chatml(dataset)), self.processing_class, self.args, name)

    @staticmethod
    def _prepare(dataset, tokenizer, args, name, rows_checked: bool = False):
        if dataset is None:
            return None
        if name == "train":
            check_streamed_training(args, dataset)
        with main_process_first_if_cached(args, dataset, f"{name} dataset tokenization"):
            prepared, stats = prepare_preference_dataset(dataset, tokenizer, args, return_stats=True,
                                                         rows_checked=rows_checked)
        if stats is None:  # streamed: prepared lazily, nothing counted yet
            return prepared
        logger.info("%s dataset: %d pairs (%d over max_length truncated, %d dropped)", name, len(prepared),
                    stats["n_truncated"], stats["n_dropped"])
        return prepared

    # -- loss, evaluation and metrics --------------------------------------------------------------
    def _rewards(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen (B,), rejected (B,)) rewards of a collated batch, in one forward over its 2B sequences."""
        model_inputs = {k: v for k, v in inputs.items() if k not in _LOSS_ONLY_KEYS}
        model_inputs["use_cache"] = False  # with a cache, transformers does not keep packed sequences apart
        mask = inputs.get("attention_mask")
        if mask is not None and mask.ndim == 4 and self._eager:
            # eager attention adds the mask to its scores: a prefix-sharing boolean mask becomes 0 / -inf-like
            model_inputs["attention_mask"] = additive_mask(mask)
        scores = token_scores(model, self._score_head, model_inputs)
        rewards = gather_last_token_scores(scores, attention_mask=mask if mask is not None and mask.ndim == 2 else None,
                                           last_token_index=inputs.get("last_token_index"))
        chosen, rejected = rewards.chunk(2)
        return chosen, rejected

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen, rejected = self._rewards(model, inputs)
        loss = pairwise_reward_loss(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient)
        self._add_metrics("train" if model.training else "eval", chosen, rejected, inputs)
        outputs = {"rewards_chosen": chosen, "rewards_rejected": rejected}
        return (loss, outputs) if return_outputs else loss

    def _add_metrics(self, mode: str, chosen: torch.Tensor, rejected: torch.Tensor, inputs: dict) -> None:
        """TRL's reward metrics of one batch: chosen (B,) and rejected (B,) rewards, the collated batch."""
        metrics = self.metrics[mode]
        correct, margin, chosen_sum, rejected_sum, count = pairwise_metric_sums(chosen, rejected)
        metrics.add("accuracy", correct, count)
        metrics.add("margin", margin, count)
        metrics.add("mean_reward", chosen_sum + rejected_sum, 2 * count)
        rewards = torch.cat([chosen, rejected])
        metrics.add_min("min_reward", rewards)
        metrics.add_max("max_reward", rewards)
        if mode == "train":
            metrics.add("num_tokens", real_token_count(inputs), 0)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        # TRL 1.16's shapes: the model's (2B, 1) logits [chosen; rejected], and no labels (the order is the label)
        rewards = torch.cat([outputs["rewards_chosen"], outputs["rewards_rejected"]]).unsqueeze(-1)
        return loss, rewards, ()

    # -- reward statistics for PPO -----------------------------------------------------------------
    def compute_reward_stats(self, dataset=None) -> dict[str, float]:
        """Mean and std (population) of the rewards of every chosen and rejected sequence in `dataset`
        (default: the train set, or `reward_stats_num_samples` pairs of it drawn with `seed`), stored in the
        model config as `reward_mean` / `reward_std`.

        The next `save_model` writes them to `config.json` (full models) and `reward_stats.json` (any model,
        LoRA adapters included); `hf_rlhf.models.value_head.load_reward_stats(path)` reads them back.
        """
        if dataset is None:
            dataset, n = self.train_dataset, self.args.reward_stats_num_samples
            if is_streamed(dataset):  # the first n pairs of the stream (all of it when n is None)
                dataset = dataset.take(n) if n is not None else dataset
            elif n is not None and n < len(dataset):
                dataset = dataset.shuffle(seed=self.args.seed).select(range(n))
        else:
            dataset = self._prepare(dataset, self.processing_class, self.args, "reward_stats")
        rewards = self._all_rewards(dataset).double().reshape(-1)
        return set_reward_stats(self.accelerator.unwrap_model(self.model), rewards.mean(), rewards.std(correction=0))

    @torch.no_grad()
    def _all_rewards(self, dataset) -> torch.Tensor:
        """(N, 2) [chosen, rejected] rewards of every pair of a prepared `dataset`, gathered over ranks.

        Its own loop, not `predict()`: the (2B, 1) predictions TRL's layout asks for lose the last batch's
        rejected rows in `gather_for_metrics` (it trims by pairs), where (B, 2) rows are trimmed right.
        """
        model, was_training = self.model_wrapped, self.model.training
        model.eval()
        rows = []
        for batch in self.get_test_dataloader(dataset):
            chosen, rejected = self._rewards(model, self._prepare_inputs(batch))
            rows.append(self.accelerator.gather_for_metrics(torch.stack([chosen, rejected], dim=1)).cpu())
        model.train(was_training)
        return torch.cat(rows)

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.args.store_reward_stats:
            stats = self.compute_reward_stats()
            output.metrics.update(stats)
            logger.info("reward stats over the train set: mean %.4f, std %.4f", stats["reward_mean"],
                        stats["reward_std"])
        return output

    # -- saving --------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        super()._save(output_dir, state_dict)
        stats = load_reward_stats(self.accelerator.unwrap_model(self.model))
        if stats is not None and self.args.should_save:
            save_reward_stats(output_dir if output_dir is not None else self.args.output_dir, stats)
