"""`OnlineEvalMixin`: `evaluate()`, `eval_strategy` and `load_best_model_at_end` for `PPOTrainer` (GRPO, RLOO).

The Trainer's own `evaluate` runs as it is (datasets by name, speed metrics, `log`, `on_evaluate`, the best
checkpoint); what it calls is replaced: `get_eval_dataloader` gives this process's batches of prepared prompt rows,
and `evaluation_loop` runs `hf_rlhf.rollout.evaluation.PromptEvaluator` on them instead of a forward per batch.
The eval rows are checked as the training rows are, before any model loads (`check_eval_prompts`); the trainer keeps
the datasets as given (`trainer.eval_dataset is eval_dataset`, as TRL) and tokenizes each once, at its first use.
"""

from __future__ import annotations

import logging

from transformers.trainer_utils import EvalLoopOutput

from ..data import as_dataset
from ..data.streaming import is_streamed
from ..data.validation import DataValidationError
from ..rollout.evaluation import PromptEvaluator, eval_loader
from ..rollout.loader import prepare_prompt_dataset, validate_prompt_dataset

logger = logging.getLogger("hf_rlhf")


def _materialised(dataset):
    """A `Dataset` of the rows: an `IterableDataset` (a finite evaluation stream) is read whole."""
    from datasets import IterableDataset

    return as_dataset(list(dataset) if isinstance(dataset, IterableDataset) else dataset)


def check_eval_prompts(eval_dataset) -> dict[int, tuple]:
    """Check every eval row as a training prompt row (`validate_prompt_dataset`), before any model loads.

    Args:
        eval_dataset: None, a dataset (a `Dataset`, an `IterableDataset` or a list of rows) or a dict of them.

    Returns:
        {id(dataset as given): (checked `Dataset`, conversational)}.

    Raises:
        DataValidationError: naming the eval dataset (its key in a dict), the row and the field.
    """
    if eval_dataset is None:
        return {}
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    checked = {}
    for name, dataset in named:
        try:
            checked[id(dataset)] = validate_prompt_dataset(_materialised(dataset))
        except DataValidationError as err:  # the same error, saying which dataset
            where = "eval_dataset" if name is None else f"eval_dataset[{name!r}]"
            raise DataValidationError(err.row, err.field, err.expected, err.got, source=where) from None
    return checked


def check_eval_setup(args, eval_dataset, multi_turn: bool) -> dict[int, tuple]:
    """The evaluation options and rows of a PPOTrainer, checked before any model loads; returns
    `check_eval_prompts(eval_dataset)`."""
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(f"eval_strategy={args.eval_strategy.value!r} needs an eval_dataset of prompt rows "
                         "(or leave eval_strategy='no' and call trainer.evaluate(eval_dataset=...)).")
    if eval_dataset is not None and multi_turn:
        raise NotImplementedError("evaluation of multi-turn rollouts (tools, environment_factory, rollout_func) is "
                                  "not implemented: leave eval_dataset None (see docs/grpo.md, Evaluation).")
    best = args.metric_for_best_model
    if args.load_best_model_at_end and not args.critic_free and best in ("loss", "eval_loss"):
        raise ValueError("load_best_model_at_end: PPO with a value function (advantage_estimator='gae') logs no "
                         "eval_loss; set metric_for_best_model='eval_reward' (and greater_is_better=True).")
    return check_eval_prompts(eval_dataset)


class OnlineEvalMixin:
    """Evaluation for a trainer with a `rollout_maker`; the class sets `self._eval_checked` (from
    `check_eval_prompts`), `self._eval_positions` (the policy's positions) and `self.compute_metrics_fn`."""

    def score_completions(self, prompts: list, completions: list, **columns):
        """The scores of evaluated completions: (names, (K, B) per reward source, (K,) weights). Default: one
        source, `compute_rewards`; `GRPOTrainer` reports each reward function."""
        import torch

        from ..rewards.base import check_scores

        scores = check_scores(self.compute_rewards(prompts, completions, **columns), len(completions),
                              "compute_rewards", prompts, completions)
        return ["reward"], scores.float().cpu()[None], torch.ones(1)

    def _eval_rows(self, dataset):
        """`dataset` (as given to `__init__` or `evaluate`) as prepared prompt rows, tokenized once."""
        key = id(dataset)
        prepared = self._eval_prepared.get(key)
        if prepared is None or prepared[0] is not dataset:
            checked = self._eval_checked.get(key) or check_eval_prompts(dataset)[key]
            rows, conversational = checked
            prepared = (dataset, prepare_prompt_dataset(rows, self.processing_class, self.args,
                                                        max_positions=self._eval_positions,
                                                        conversational=conversational, tools=self.tools))
            self._eval_prepared[key] = prepared
        return prepared[1]

    def get_eval_dataloader(self, eval_dataset=None):
        """This process's batches of the prepared prompt rows of `eval_dataset` (a dataset, the name of one given at
        init, or None: the one given at init), read by `dataloader_num_workers` workers; a streamed eval set by this
        process alone (TRL: its rows would interleave), `args` unchanged."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        workers = 0 if is_streamed(dataset) else self.args.dataloader_num_workers
        return eval_loader(self._eval_rows(dataset), self.args, self.accelerator, workers)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        wrapped = self.model_wrapped
        model = wrapped if wrapped is self.model else self.accelerator.unwrap_model(wrapped)
        evaluator = PromptEvaluator(self.args, self.rollout_maker, self.accelerator, self._score_for_eval,
                                    self.compute_metrics_fn)
        self._evaluating = True
        try:
            metrics, count = evaluator.run(model, dataloader, self.args.seed)
        finally:
            self._evaluating = False
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in metrics.items()}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=count)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's weights back into the policy (and value) module, which
        saves in its own layout (`PolicyAndValue.save_pretrained`), as resume loads them; DeepSpeed: the Trainer's."""
        if self.is_deepspeed_enabled:
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint,
                    self.state.best_metric)
        self.accelerator.unwrap_model(self.model).load_checkpoint(self.state.best_model_checkpoint)

    def _score_for_eval(self, prompts, completions, **columns):
        return self.score_completions(prompts, completions, **columns)
