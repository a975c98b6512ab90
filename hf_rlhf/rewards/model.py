"""A reward model with its own tokenizer as a reward source, and a reward model given by path loaded as what it is.

A path (or hub id) is inspected BEFORE anything is loaded, and loaded as the kind its files say it is:

    SEQUENCE_CLASSIFICATION          config.json whose architectures end in ForSequenceClassification (or that has
                                     no architectures and one label)
                                     -> AutoModelForSequenceClassification(num_labels=1)
    VALUE_HEAD                       value_head.safetensors next to config.json (full model) or adapter_config.json
                                     (LoRA) -> ValueHeadModel.from_pretrained
    SEQUENCE_CLASSIFICATION_ADAPTER  adapter_config.json + adapter_model.safetensors holding the `score` head (peft's
                                     modules_to_save) -> PeftModel of AutoModelForSequenceClassification on its base

Anything else is a ValueError that lists what was found. A LoRA reward adapter passed by path runs on its OWN copy
of its base; to run it on the policy's base instead, pass `RewardAdapter(path)` (`hf_rlhf.rewards.adapter`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch
from peft import PeftConfig, PeftModel
from peft.utils import CONFIG_NAME as ADAPTER_CONFIG_FILE
from peft.utils import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS_FILE
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForSequenceClassification
from transformers.utils import CONFIG_NAME, cached_file

from ..models.loading import hub_errors, load_model, resolve_dtype
from ..models.value_head import (
    VALUE_HEAD_FILE,
    ValueHeadModel,
    find_score_head,
    get_rewards,
    load_reward_stats,
    reward_config_of,
)
from ..trainers.model_config import ModelConfig
from .adapter import score_head_key
from .base import TokenizedReward

SEQUENCE_CLASSIFICATION = "sequence_classification"
VALUE_HEAD = "value_head"
SEQUENCE_CLASSIFICATION_ADAPTER = "sequence_classification_adapter"


class ModelReward(TokenizedReward):
    """A reward model with its own tokenizer; scores at the last real token of left-padded batches.

    Args:
        model: `AutoModelForSequenceClassification` (num_labels=1), a `ValueHeadModel`, or a `PeftModel` of either.
        tokenizer: the reward model's tokenizer (needs a pad token; a chat template for conversational prompts).
        batch_size: rows per forward.
        reward_stats: {"reward_mean", "reward_std"} (default: those stored in the model's config, if any).
    """

    def __init__(self, model: nn.Module, tokenizer, batch_size: int = 64, reward_stats: dict | None = None):
        find_score_head(model)  # fails now, not mid-training, for a model that gives no scalar per sequence
        super().__init__(tokenizer, batch_size)
        self.model = model.eval().requires_grad_(False)
        self.reward_stats = reward_stats if reward_stats is not None else load_reward_stats(model)
        self.name = type(reward_config_of(model)).__name__.removesuffix("Config") + " reward model"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score_batch(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        return get_rewards(self.model, input_ids, attention_mask, position_ids)


# ---------------------------------------------------------------------------------------------------
# A reward model by path


def find_file(path: str, name: str) -> str | None:
    """The local path of file `name` of the directory or hub repo `path`, or None when it has none."""
    if os.path.isdir(path):
        file = os.path.join(path, name)
        return file if os.path.isfile(file) else None
    try:
        return cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except OSError:  # not a valid repo id either
        return None


def reward_model_kind(path: str) -> str:
    """What the reward model saved at `path` is, read from its files (nothing is loaded).

    Returns:
        `SEQUENCE_CLASSIFICATION`, `VALUE_HEAD` (a full model or a LoRA adapter, plus `value_head.safetensors`) or
        `SEQUENCE_CLASSIFICATION_ADAPTER` (a LoRA adapter with its `score` head saved through modules_to_save).

    Raises:
        ValueError: none of these; the message says what was found and what was expected.
    """
    config_file, adapter_file = find_file(path, CONFIG_NAME), find_file(path, ADAPTER_CONFIG_FILE)
    if find_file(path, VALUE_HEAD_FILE) is not None and (config_file or adapter_file):
        return VALUE_HEAD
    if adapter_file is not None:
        weights = find_file(path, ADAPTER_WEIGHTS_FILE)
        keys = []
        if weights is not None:
            with safe_open(weights, framework="pt") as f:
                keys = list(f.keys())
        if any(score_head_key(key) is not None for key in keys):
            return SEQUENCE_CLASSIFICATION_ADAPTER
        task = PeftConfig.from_pretrained(path).task_type
        raise ValueError(_not_a_reward_model(path, f"a LoRA adapter (task_type {task}) with no reward head: no "
                                                   f"`score` / `classifier` in {ADAPTER_WEIGHTS_FILE} and no "
                                                   f"{VALUE_HEAD_FILE}"))
    if config_file is not None:
        with open(config_file) as f:
            config = json.load(f)
        architectures = config.get("architectures") or []
        labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels")
        is_classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
        if is_classifier and labels not in (None, 1):
            raise ValueError(_not_a_reward_model(path, f"a sequence-classification model with {labels} labels "
                                                       "(a reward model has num_labels=1)"))
        if is_classifier or (not architectures and labels == 1):
            return SEQUENCE_CLASSIFICATION
        raise ValueError(_not_a_reward_model(path, f"{CONFIG_NAME} of a {', '.join(architectures) or 'model'} "
                                                   f"with no {VALUE_HEAD_FILE}"))
    raise ValueError(_not_a_reward_model(path, f"no {CONFIG_NAME} and no {ADAPTER_CONFIG_FILE}"))


def _not_a_reward_model(path: str, found: str) -> str:
    files = sorted(os.listdir(path))[:12] if os.path.isdir(path) else "(not a local directory)"
    return (f"{path} is not a reward model: found {found}; files: {files}. Expected a sequence-classification "
            f"model with one label ({CONFIG_NAME} whose architectures end in ForSequenceClassification), a "
            f"ValueHeadModel ({VALUE_HEAD_FILE} next to {CONFIG_NAME} or {ADAPTER_CONFIG_FILE}), or a LoRA reward "
            f"adapter ({ADAPTER_CONFIG_FILE} + {ADAPTER_WEIGHTS_FILE} with its `score` head), as RewardTrainer saves "
            "them")


def load_reward_model(path: str, model_config: ModelConfig | None = None) -> nn.Module:
    """Load the reward model at `path` as what its files say it is (see `reward_model_kind`).

    Args:
        path: a directory or hub id.
        model_config: dtype, attention implementation and remote-code settings (its LoRA and quantization
            settings are ignored: a reward model is loaded for inference as saved).

    Returns:
        A sequence-classification model (num_labels=1), a `ValueHeadModel`, or a `PeftModel` of a
        sequence-classification model on its base, in eval mode.

    Raises:
        ModelUnavailableError: `path` (or the base of an adapter) cannot be loaded: one line (`hub_errors`).
    """
    config = replace(model_config or ModelConfig(), model_name_or_path=path, use_peft=False, load_in_4bit=False,
                     load_in_8bit=False)
    # checked before its files are looked for: `find_file` takes a Hub that cannot be reached for a missing file
    with hub_errors(path, "reward model", revision=config.model_revision):
        kind = reward_model_kind(path)
        if kind == VALUE_HEAD:
            model = ValueHeadModel.from_pretrained(path, dtype=resolve_dtype(config.dtype),
                                                   attn_implementation=config.attn_implementation,
                                                   trust_remote_code=config.trust_remote_code)
        elif kind == SEQUENCE_CLASSIFICATION_ADAPTER:
            base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
            base = load_model(replace(config, model_name_or_path=base_path), AutoModelForSequenceClassification,
                              num_labels=1)
            model = PeftModel.from_pretrained(base, path)
        else:
            model = load_model(config, AutoModelForSequenceClassification, num_labels=1)
    return model.eval()
