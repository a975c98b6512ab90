"""`BaseTrainer`: what the SFT, reward and PPO trainers share, once.

- the args check (`resolve_args`: the trainer's own config class, or a default one);
- the tokenizer from the model's path when none is given (`resolve_tokenizer`);
- LoRA / QLoRA (any peft config) applied with a seeded adapter init (`add_peft`; a path is loaded with
  `hf_rlhf.models.resolve_model`);
- saving and resuming modules that are not a `PreTrainedModel` (`ValueHeadModel`, PPO's `PolicyAndValue`): they
  save with their own `save_pretrained(dir, state_dict=None)` and load back with `load_checkpoint(dir)`;
- atomic checkpoints and resume from the latest complete one (`hf_rlhf.checkpoints.AtomicCheckpointMixin`), and
  a non-finite loss / grad norm caught before the optimizer step (`hf_rlhf.nonfinite.NonFiniteGuardMixin`);
- one on-device metric accumulator per mode (`self.metrics["train"]`, `self.metrics["eval"]`), reduced over ranks
  and merged into the Trainer's logs by `log` (`logged_metrics` turns the sums into what is logged).

Everything else is `transformers.Trainer`'s own.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoTokenizer, PreTrainedModel, Trainer, set_seed
from transformers.trainer import TRAINING_ARGS_NAME

from ..checkpoints import AtomicCheckpointMixin
from ..models import apply_lora, lora_config
from ..nonfinite import NonFiniteGuardMixin
from ..reward_models import ValueHeadModel, reward_config_of, unwrap_peft
from .metrics import MetricAccumulator


class BaseTrainer(NonFiniteGuardMixin, AtomicCheckpointMixin, Trainer):
    """A `transformers.Trainer` with the setup, saving and metric plumbing the hf_rlhf trainers share.

    Subclasses set `config_class` (their `TrainingArguments` subclass) and `default_output_dir`, build their model
    with the class methods below before calling `Trainer.__init__`, and add to `self.metrics[mode]` while training.
    """

    config_class: type = None
    default_output_dir: str = "output"

    # -- setup -----------------------------------------------------------------------------------
    @classmethod
    def resolve_args(cls, args):
        """`args`, or a default `config_class(output_dir=default_output_dir)`; a TypeError for another class."""
        if args is None:
            return cls.config_class(output_dir=cls.default_output_dir)
        if not isinstance(args, cls.config_class):
            raise TypeError(f"args must be a {cls.config_class.__name__}, got {type(args).__name__}.")
        return args

    @staticmethod
    def resolve_tokenizer(processing_class, model):
        """`processing_class`, or the tokenizer saved with `model` (its config's `_name_or_path`)."""
        if processing_class is not None:
            return processing_class
        return AutoTokenizer.from_pretrained(reward_config_of(model)._name_or_path)

    @staticmethod
    def add_peft(model, model_config, args, peft_config=None, task_type: str | None = None):
        """`model` with LoRA (or any peft config) applied, when asked; else `model` as it is.

        Args:
            model: a `PreTrainedModel` (4/8-bit too: prepared for k-bit training), a `ValueHeadModel` (the adapter
                goes on its causal LM; its head stays outside the adapter and is trained in full) or a `PeftModel`
                (returned as it is).
            model_config: a `ModelConfig` whose `use_peft` builds the LoRA config, or None.
            args: the trainer's config (`seed` for the adapter init, `activation_checkpointing`).
            peft_config: a peft config; None: from `model_config`.
            task_type: the peft task type of a config built from `model_config`.
        """
        if peft_config is None and model_config is not None:
            peft_config = lora_config(model_config, task_type=task_type)
        if peft_config is None:
            return model
        set_seed(args.seed)  # the adapter init: the same on every rank and in every run (the Trainer seeds later)
        checkpointing = bool(args.activation_checkpointing)
        if isinstance(model, ValueHeadModel):
            model.pretrained_model = apply_lora(model.pretrained_model, peft_config, checkpointing)
            return model
        return apply_lora(model, peft_config, checkpointing)

    def _set_signature_columns_if_needed(self):
        # the collators read exactly these columns; the Trainer's remove_unused_columns must keep them
        if self._signature_columns is None and getattr(self, "feature_columns", None) is not None:
            self._signature_columns = list(self.feature_columns)
        super()._set_signature_columns_if_needed()

    # -- metrics ---------------------------------------------------------------------------------
    def __init__(self, *args, **kwargs):
        # {"train": ..., "eval": ...}: what `log` adds to the Trainer's logs of that mode
        self.metrics = {"train": MetricAccumulator(), "eval": MetricAccumulator()}
        super().__init__(*args, **kwargs)

    def logged_metrics(self, mode: str, totals: dict[str, tuple[float, float]]) -> dict[str, float]:
        """What is logged from the accumulated (sum, weight) totals of `mode`; default: each sum / weight."""
        return {name: s / w for name, (s, w) in totals.items() if w > 0}

    def log(self, logs: dict, start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        if mode == "eval" or "loss" in logs:  # a training log, not the run's closing summary
            prefix = "eval_" if mode == "eval" else ""
            totals = self.metrics[mode].totals(self.accelerator)
            logs.update({prefix + name: value for name, value in self.logged_metrics(mode, totals).items()})
        super().log(logs, start_time)

    # -- saving and resuming modules that are not a PreTrainedModel ---------------------------------
    @staticmethod
    def _is_pretrained(model) -> bool:
        return isinstance(unwrap_peft(model), PreTrainedModel)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if self._is_pretrained(model):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model.save_pretrained(output_dir, state_dict=state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        if self._is_pretrained(target):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target.load_checkpoint(resume_from_checkpoint)
