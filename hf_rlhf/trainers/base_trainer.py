"""`BaseTrainer`: what the SFT, reward and PPO trainers share, once.

- the args check (`resolve_args`: the trainer's own config class, or a default one);
- the tokenizer from the model's path when none is given (`resolve_tokenizer`);
- LoRA / QLoRA (any peft config) applied with a seeded adapter init (`add_peft`; a path is loaded with
  `hf_rlhf.models.loading.resolve_model`);
- saving and resuming modules that are not a `PreTrainedModel` (`ValueHeadModel`, PPO's `PolicyAndValue`): they
  save with their own `save_pretrained(dir, state_dict=None)` and load back with `load_checkpoint(dir)`;
- atomic checkpoints and resume from the latest complete one (`hf_rlhf.training.checkpoints.AtomicCheckpointMixin`), and
  a non-finite loss / grad norm caught before the optimizer step (`hf_rlhf.training.nonfinite.NonFiniteGuardMixin`);
- on SIGTERM, a checkpoint at the next step boundary and a clean stop (`hf_rlhf.training.preemption`);
- one on-device metric accumulator per mode (`self.metrics["train"]`, `self.metrics["eval"]`), reduced over ranks
  and merged into the Trainer's logs by `log` (`logged_metrics` turns the sums into what is logged).

Everything else is `transformers.Trainer`'s own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os

import torch
from transformers import AutoTokenizer, PreTrainedModel, Trainer, TrainingArguments, set_seed
from transformers.trainer import TRAINING_ARGS_NAME

from ..data import column_names
from ..data.streaming import is_streamed
from ..models.adapters import unwrap_peft
from ..models.loading import apply_lora, hub_errors, lora_config
from ..models.value_head import ValueHeadModel, reward_config_of
from ..training.checkpoints import AtomicCheckpointMixin
from ..training.nonfinite import NonFiniteGuardMixin
from ..training.preemption import PreemptionMixin
from .config_checks import check_renamed
from .metrics import MetricAccumulator

logger = logging.getLogger("hf_rlhf")


class BaseTrainer(PreemptionMixin, NonFiniteGuardMixin, AtomicCheckpointMixin, Trainer):
    """A `transformers.Trainer` with the setup, saving and metric plumbing the hf_rlhf trainers share.

    Subclasses set `config_class` (their `TrainingArguments` subclass) and `default_output_dir`, build their model
    with the class methods below before calling `Trainer.__init__`, and add to `self.metrics[mode]` while training.
    """

    config_class: type = None
    tag_names: tuple[str, ...] = ("hf_rlhf",)  # added to the model's tags (its model card), with TRL's for the trainer
    default_output_dir: str = "output"
    counts_tokens: bool = False  # log `num_tokens`: the trainer adds each batch's real tokens to metrics["train"]

    # -- setup -----------------------------------------------------------------------------------
    @classmethod
    def resolve_args(cls, args):
        """`args` as a `config_class`: itself; a default `config_class(output_dir=default_output_dir)` for None; or,
        for another `TrainingArguments` (a plain one, or TRL's config), its fields converted as TRL does
        (`config_class(**args.to_dict())`, the masked `*_token` fields kept). A field `config_class` lacks is an error
        when it was set (left at its default, it is dropped)."""
        config_class = cls.config_class
        if args is None:
            return config_class(output_dir=cls.default_output_dir)
        if isinstance(args, config_class):
            return args
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be a {config_class.__name__} or a TrainingArguments, got "
                            f"{type(args).__name__}.")
        values = args.to_dict()
        # to_dict masks every *_token field ("<HUB_TOKEN>"); TRL restores hub_token, and a TRL config's eos_token /
        # pad_token are real tokens
        values.update({k: getattr(args, k) for k in values if k.endswith("_token")})
        ours = {f.name for f in dataclasses.fields(config_class) if f.init}
        defaults = {f.name: f.default for f in dataclasses.fields(args) if f.init}
        foreign = sorted(k for k in values if k not in ours and values[k] != defaults.get(k))
        if foreign:
            raise TypeError(f"args is a {type(args).__name__} whose options {foreign} {config_class.__name__} does not "
                            f"have; pass a {config_class.__name__} (or a plain TrainingArguments).")
        return config_class(**{k: v for k, v in values.items() if k in ours})

    @classmethod
    def check_extra_kwargs(cls, kwargs: dict) -> None:
        """Raise a TypeError for keyword arguments the trainer does not take: an old name (`tokenizer`) names its
        replacement; any other lists the names the trainer takes."""
        if not kwargs:
            return
        check_renamed(kwargs, cls.__name__)
        params = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "kwargs")]
        raise TypeError(f"{cls.__name__} got unexpected arguments {sorted(kwargs)}; it takes {params}.")

    @staticmethod
    def model_init_kwargs(model, args, quantization_config=None) -> dict:
        """Keyword arguments for `from_pretrained` when `model` is a path, as TRL builds them: `args.model_init_kwargs`,
        the trainer's `quantization_config` and `args.trust_remote_code`. For a built model they are ignored with a
        warning (as in TRL) and {} is returned."""
        given = dict(getattr(args, "model_init_kwargs", None) or {})
        if not isinstance(model, str):
            if given or quantization_config is not None:
                logger.warning("model_init_kwargs / quantization_config are ignored: the model is already built.")
            return {}
        if quantization_config is not None:
            if "quantization_config" in given:
                raise ValueError("quantization_config is set both as a trainer argument and in "
                                 "args.model_init_kwargs; set it in one place.")
            given["quantization_config"] = quantization_config
        if getattr(args, "trust_remote_code", False):
            given.setdefault("trust_remote_code", True)
        return given

    @staticmethod
    def require_train_dataset(train_dataset) -> None:
        """TRL's check: a trainer is built to train; evaluation-only use passes the rows to train on all the same."""
        if train_dataset is None:
            raise ValueError("`train_dataset` is required (as in TRL): pass the rows to train on.")

    @staticmethod
    def check_rows_first(datasets, check) -> set[int]:
        """Check the rows of every raw, in-memory dataset before any model is loaded: a bad row fails in seconds.

        Args:
            datasets: datasets, dicts of datasets or None (train, eval).
            check: `dataset -> None`, raising `DataValidationError` (`check_sft_rows`, `check_preference_rows`).

        Returns:
            The `id()` of each dataset checked, so its preparation does not check it again. Streamed and
            already-tokenized datasets are left to their preparation.
        """
        checked = set()
        for item in datasets:
            for dataset in (item.values() if isinstance(item, dict) else [item]):
                if dataset is None or is_streamed(dataset):
                    continue
                if getattr(dataset, "format", {}).get("type") == "custom":  # as TRL refuses it
                    raise ValueError(
                        "a dataset with Dataset.with_transform() cannot be prepared: preparation calls Dataset.map(), "
                        "which reads through the transform and would bake a random or stateful transform into the "
                        "tokenized columns. Pass dataset_kwargs={'skip_prepare_dataset': True} and make the transform "
                        "return trainer-ready rows (tokenized, as TRL), or apply a deterministic transform with "
                        "Dataset.map() first.")
                if {"input_ids", "chosen_ids"} & set(column_names(dataset)):
                    continue
                check(dataset)
                checked.add(id(dataset))
        return checked

    @staticmethod
    def resolve_tokenizer(processing_class, model, args=None):
        """`processing_class`, or the tokenizer saved with `model` (its config's `_name_or_path`), loaded with the
        `revision` of `args.model_init_kwargs` and `args.trust_remote_code` (as TRL)."""
        if processing_class is not None:
            return processing_class
        kwargs = {}
        if getattr(args, "trust_remote_code", False):
            kwargs["trust_remote_code"] = True
        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        if revision is not None:
            kwargs["revision"] = revision
        path = reward_config_of(model)._name_or_path
        with hub_errors(path, "tokenizer", revision=revision, filename="tokenizer_config.json"):
            return AutoTokenizer.from_pretrained(path, **kwargs)

    @staticmethod
    def add_peft(model, model_config, args, peft_config=None, task_type: str | None = None,
                 prompt_learning: bool = True):
        """`model` with LoRA (or any peft config) applied, when asked; else `model` as it is.

        Args:
            model: a `PreTrainedModel` (4/8-bit too: prepared for k-bit training), a `ValueHeadModel` (the adapter
                goes on its causal LM; its head stays outside the adapter and is trained in full) or a `PeftModel`
                (returned as it is).
            model_config: a `ModelConfig` whose `use_peft` builds the LoRA config, or None.
            args: the trainer's config (`seed` for the adapter init, `activation_checkpointing`).
            peft_config: a peft config; None: from `model_config`.
            task_type: the peft task type of a config built from `model_config`.
            prompt_learning: whether prompt-learning configs (prompt tuning, p-tuning, prefix tuning) apply; they
                add virtual tokens before each sequence, which per-token scores and values cannot take.
        """
        if peft_config is None and model_config is not None:
            peft_config = lora_config(model_config, task_type=task_type)
        if peft_config is None:
            return model
        if getattr(peft_config, "is_prompt_learning", False) and not prompt_learning:
            kind = type(peft_config).__name__
            raise ValueError(f"peft_config is a {kind}: prompt learning puts virtual tokens before every sequence, "
                             "and this trainer reads a score or value at each sequence's own tokens. Use an adapter "
                             "on the weights instead (LoraConfig, LoraConfig(use_dora=True), IA3Config, ...).")
        if isinstance(model, ValueHeadModel) and getattr(peft_config, "is_prompt_learning", False):
            raise ValueError("a prompt-learning peft_config cannot be applied to a ValueHeadModel")
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
        self._num_tokens = None  # real tokens trained on so far (`counts_tokens`)
        super().__init__(*args, **kwargs)
        if hasattr(self.model, "add_model_tags"):  # a PreTrainedModel or PeftModel (PPO's wrapper has none)
            self.model.add_model_tags(list(self.tag_names))
        self.activation_offload_context = contextlib.nullcontext()
        if getattr(self.args, "activation_offloading", False):  # the configs refuse it without CUDA
            from trl.models.activation_offloading import get_act_offloading_ctx_manager

            self.activation_offload_context = get_act_offloading_ctx_manager(model=self.model)

    def training_step(self, *args, **kwargs):
        with self.activation_offload_context:  # `activation_offloading`: saved activations go to CPU memory
            return super().training_step(*args, **kwargs)

    def floating_point_ops(self, inputs: dict) -> int:
        """`Trainer.floating_point_ops` (6 x the main input's tokens x the model's non-embedding parameters, the
        `total_flos` estimate), with the parameter count taken once per model instead of every step (a walk over
        every module and parameter: ~0.35 ms a step of the toy SFT, ~0.8 s of its 2,400 steps)."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        model, count = getattr(self, "_flop_parameters", (None, 0))
        if model is not self.model:  # the first step, or a model swapped since
            count = self.model.num_parameters(exclude_embeddings=True)
            self._flop_parameters = (self.model, count)
        return 6 * inputs[main_input].numel() * count

    def logged_metrics(self, mode: str, totals: dict[str, tuple[float, float]]) -> dict[str, float]:
        """What is logged from the accumulated (sum, weight) totals of `mode`: each sum / weight, and for a trainer
        that `counts_tokens`, `num_tokens`: the running total of real tokens trained on (TRL's, in train and eval
        logs), continued from a resumed checkpoint's log history."""
        logs = {name: s / w for name, (s, w) in totals.items() if w > 0 and name != "num_tokens"}
        if self.counts_tokens:
            if self._num_tokens is None:  # the run's first log: go on from a resumed checkpoint's count
                counts = [h["num_tokens"] for h in self.state.log_history if "num_tokens" in h]
                self._num_tokens = counts[-1] if counts else 0
            if mode == "train":
                self._num_tokens += totals.get("num_tokens", (0.0, 0.0))[0]
            logs["num_tokens"] = float(self._num_tokens)
        return logs

    def train(self, *args, **kwargs):
        self._num_tokens = None  # set at the first log, from the log history a resumed checkpoint brings back
        return super().train(*args, **kwargs)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        # a training log, an evaluation, or the run's closing summary (`train_runtime`): the summary gets what
        # accumulated after the last logging step, as TRL's, so a run that ends between logging steps loses nothing
        if mode == "eval" or "loss" in logs or "train_runtime" in logs:
            prefix = "eval_" if mode == "eval" else ""
            totals = self.metrics[mode].totals(self.accelerator)  # every rank calls it: the summary is logged on all
            if mode == "eval" or "loss" in logs or any(weight > 0 for _, weight in totals.values()):
                logs.update({prefix + name: value for name, value in self.logged_metrics(mode, totals).items()})
        super().log(logs, start_time)

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """`Trainer.evaluate`, with a dataset passed here prepared as the eval datasets given at init are (as TRL):
        raw rows are checked, tokenized (and packed where the config packs evaluation); a tokenized dataset is left
        as it is; a `str` names an eval dataset prepared at init."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            if isinstance(eval_dataset, dict):
                eval_dataset = {key: self.prepare_eval_dataset(dataset, f"eval[{key}]")
                                for key, dataset in eval_dataset.items()}
            else:
                eval_dataset = self.prepare_eval_dataset(eval_dataset, "eval")
        return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prepare_eval_dataset(self, dataset, name: str):
        """A dataset passed to `evaluate`, prepared for this trainer's collator; trainers that prepare their
        datasets override it (the base returns it as it is)."""
        return dataset

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
