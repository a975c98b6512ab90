"""Reward models and reading their rewards.

Two kinds of reward model, both scoring every token and read at each sequence's last real token:

- (a) `AutoModelForSequenceClassification(num_labels=1)` with `config.pad_token_id` set; its head is `score`.
  Its own pooling finds the last token from `pad_token_id`, which fails when pad == eos and cannot pool packed
  rows, so the per-token scores are taken from the head's output and gathered here instead.
- (b) `ValueHeadModel`: any causal LM backbone with a linear head initialised N(0, 1/(hidden+1)).

Where the last token is (`last_token_columns`, `gather_last_token_scores`):

    right padding   [a b c 0 0]  ->  column 2          left padding   [0 0 a b c]  ->  column 4
    packed row      [a b c|d e|f]   (lengths 3, 2, 1)  ->  flat positions 2, 4, 5

Reward statistics for PPO live in the model config as `config.reward_mean` / `config.reward_std` (written to
`config.json` by `save_pretrained`) and in `<output_dir>/reward_stats.json` (also for LoRA adapters, whose
directory has no `config.json`); `load_reward_stats` reads either.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..tensors import last_true_indices
from .adapters import unwrap_peft
from .loading import hub_errors, load_weights

REWARD_STATS_FILE = "reward_stats.json"
VALUE_HEAD_FILE = "value_head.safetensors"


# ---------------------------------------------------------------------------------------------------
# Where each sequence ends


def last_token_columns(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Column of each row's last real token, for right or left padding (or none).

    Args:
        attention_mask: (B, T) 1 on tokens, 0 on padding.

    Returns:
        LongTensor (B,).

    Raises:
        ValueError: a row has no real token.

    >>> last_token_columns(torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]]))
    tensor([2, 4])
    """
    if not attention_mask.bool().any(-1).all():
        raise ValueError("a row of attention_mask has no real token: there is no last token to read a reward at")
    return last_true_indices(attention_mask)


def gather_last_token_scores(
    token_scores: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    last_token_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's score at its last real token.

    Args:
        token_scores: (B, T) a score per token.
        attention_mask: (B, T) for padded batches (left or right); one sequence per row.
        last_token_index: (S,) positions in the flattened (B * T) scores, for layouts with several sequences per
            row (packed, prefix-shared). Takes precedence over `attention_mask`.

    Returns:
        (S,) with S = B for padded batches.

    >>> scores = torch.tensor([[1., 2., 3., 0.], [0., 5., 6., 7.]])
    >>> gather_last_token_scores(scores, attention_mask=torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]))
    tensor([3., 7.])
    >>> gather_last_token_scores(scores, last_token_index=torch.tensor([1, 3, 7]))
    tensor([2., 0., 7.])
    """
    if last_token_index is not None:
        return token_scores.reshape(-1)[last_token_index.to(token_scores.device)]
    if attention_mask is None:
        return token_scores[:, -1]
    columns = last_token_columns(attention_mask).to(token_scores.device)
    return token_scores[torch.arange(token_scores.shape[0], device=token_scores.device), columns]


# ---------------------------------------------------------------------------------------------------
# (b) a value head on a causal LM


@dataclass
class ValueHeadOutput(ModelOutput):
    """values: (B, T) one scalar per token."""

    values: torch.Tensor | None = None


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (`model.model` for Llama), through a peft wrapper.

    With LoRA the adapters are injected into the body's layers, so calling it runs them.
    """
    model = unwrap_peft(model)
    prefix = getattr(model, "base_model_prefix", "model")
    body = getattr(model, prefix, None)
    if body is None:
        raise ValueError(f"{type(model).__name__} has no backbone attribute {prefix!r} (its base_model_prefix)")
    return body


def new_value_head(hidden_size: int, init_std: float | None = None, device=None) -> nn.Linear:
    """A scalar head `Linear(hidden, 1)` with weights N(0, std^2) and a zero bias.

    The default std is 1/sqrt(hidden + 1), the reward head of Ziegler et al. 2019 ("Fine-Tuning Language Models
    from Human Preferences", lm-human-preferences). The one builder of the value / reward heads: `ValueHeadModel`
    and PPO's value head on the policy both use it.

    Args:
        hidden_size: width of the hidden states the head reads.
        init_std: std of the initial weights; None: 1/sqrt(hidden_size + 1).
        device: where to put the head.
    """
    head = nn.Linear(hidden_size, 1, device=device)
    std = init_std if init_std is not None else 1.0 / math.sqrt(hidden_size + 1)
    with torch.no_grad():
        head.weight.normal_(0.0, std)
        head.bias.zero_()
    return head


class ValueHeadModel(nn.Module):
    """A causal LM backbone with a linear scalar head on every token (reward model (b), PPO value model).

    The head is initialised N(0, 1/(hidden + 1)) (variance; std = 1/sqrt(hidden + 1)), as the reward head of
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (lm-human-preferences), with a
    zero bias. Only the backbone runs (the LM head is skipped), so scoring costs no vocabulary projection.

    Args:
        model: a causal LM `PreTrainedModel`, or a `PeftModel` of one (its LoRA adapters are trained; the head,
            outside the adapter, is trained in full and saved next to it).
        head_init_std: std of the head's initial weights. None: 1/sqrt(hidden + 1).

    `forward(input_ids, attention_mask=None, position_ids=None, **kwargs)` returns `ValueHeadOutput(values=(B, T))`.
    `save_pretrained(dir)` writes the causal LM (or its adapter) with its own `save_pretrained`, and the head to
    `value_head.safetensors`; `ValueHeadModel.from_pretrained(dir)` reads both back.
    """

    def __init__(self, model: nn.Module, head_init_std: float | None = None):
        super().__init__()
        self.pretrained_model = model
        self.v_head = new_value_head(model.config.get_text_config().hidden_size, head_init_std,
                                     device=next(model.parameters()).device)
        self.config = model.config
        self.main_input_name = "input_ids"
        self.supports_gradient_checkpointing = getattr(model, "supports_gradient_checkpointing", False)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs) -> ValueHeadOutput:
        kwargs.setdefault("use_cache", False)
        hidden = backbone_of(self.pretrained_model)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        return ValueHeadOutput(values=self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1))

    # Trainer hooks, delegated to the causal LM
    def activation_checkpointing_enable(self, **kwargs):
        self.pretrained_model.activation_checkpointing_enable(**kwargs)

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(getattr(unwrap_peft(self.pretrained_model), "is_activation_checkpointing", False))

    def enable_input_require_grads(self):
        self.pretrained_model.enable_input_require_grads()

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        from safetensors.torch import save_file

        os.makedirs(save_directory, exist_ok=True)
        kwargs.pop("state_dict", None)  # the Trainer's state dict has our prefixes; each part saves its own
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        state = {k: v.detach().contiguous().cpu() for k, v in self.v_head.state_dict().items()}
        save_file(state, os.path.join(save_directory, VALUE_HEAD_FILE))

    def load_checkpoint(self, directory: str) -> None:
        """Load what `save_pretrained` wrote into this model, in place (how `BaseTrainer` resumes it)."""
        load_weights(self.pretrained_model, directory)
        self.load_value_head(directory)

    def load_value_head(self, directory: str) -> None:
        from safetensors.torch import load_file

        path = os.path.join(directory, VALUE_HEAD_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: not a ValueHeadModel directory")
        self.v_head.load_state_dict(load_file(path, device=str(self.v_head.weight.device)))

    @classmethod
    def from_pretrained(cls, directory: str, **kwargs) -> ValueHeadModel:
        """Load a directory written by `save_pretrained` (a full causal LM or a LoRA adapter, plus the head).

        Keyword arguments go to the causal LM's `from_pretrained` (dtype, quantization_config, ...).
        """
        from transformers import AutoModelForCausalLM

        if os.path.isfile(os.path.join(directory, "adapter_config.json")):
            from peft import PeftConfig, PeftModel

            base_path = PeftConfig.from_pretrained(directory).base_model_name_or_path
            with hub_errors(base_path, "base model", revision=kwargs.get("revision")):
                base = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
            model = PeftModel.from_pretrained(base, directory)
        else:
            with hub_errors(directory, revision=kwargs.get("revision")):
                model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        value_model = cls(model)
        value_model.load_value_head(directory)
        return value_model


# ---------------------------------------------------------------------------------------------------
# Per-token scores of either kind


def find_score_head(model: nn.Module) -> nn.Module | None:
    """The per-token head of a sequence-classification reward model (None for a `ValueHeadModel`).

    Raises:
        ValueError: the model has no `score` / `classifier` head with one output (num_labels must be 1).
    """
    if isinstance(model, ValueHeadModel):
        return None
    base = unwrap_peft(model)
    for name in ("score", "classifier"):
        head = getattr(base, name, None)
        if head is not None:
            inner = getattr(head, "modules_to_save", None)  # peft's ModulesToSaveWrapper
            linear = inner[next(iter(inner))] if inner else getattr(head, "original_module", head)
            if getattr(linear, "out_features", 1) != 1:
                raise ValueError(f"{type(base).__name__}.{name} has {linear.out_features} outputs (num_labels="
                                 f"{linear.out_features}), but reward models require `num_labels=1` (one scalar "
                                 "reward per sequence): load it with num_labels=1, or pass its path as a string")
            return head
    raise ValueError(
        f"{type(base).__name__} is not a reward model: use AutoModelForSequenceClassification.from_pretrained(..., "
        "num_labels=1) or hf_rlhf.models.value_head.ValueHeadModel(causal_lm)")


@contextmanager
def _captured_output(module: nn.Module):
    captured = {}
    handle = module.register_forward_hook(lambda _module, _args, output: captured.__setitem__("output", output))
    try:
        yield captured
    finally:
        handle.remove()


def token_scores(model: nn.Module, head: nn.Module | None, inputs: dict) -> torch.Tensor:
    """Run `model(**inputs)` and return a score for every token, as float32.

    The forward goes through `model` as given (a DDP / DeepSpeed wrapper included, so gradients are synced);
    for a sequence-classification model the per-token scores are the output of its `head`, taken with a
    forward hook (the model's own output is pooled with `pad_token_id`).

    Args:
        model: the (possibly wrapped) reward model.
        head: `find_score_head(unwrapped model)`; None for a `ValueHeadModel`.
        inputs: model inputs with `input_ids` (B, T).

    Returns:
        (B, T) float32.
    """
    if head is None:
        return model(**inputs).values.float()
    with _captured_output(head) as captured:
        model(**inputs)
    return captured["output"].squeeze(-1).float()


@torch.no_grad()
def get_rewards(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rewards of a padded batch (left or right padding) read at each row's last real token.

    Args:
        model: a sequence-classification reward model, a `ValueHeadModel`, or a `PeftModel` of either.
        input_ids: (B, T).
        attention_mask: (B, T).
        position_ids: (B, T). None: counted over real tokens only (`position_ids_from_mask`), so that a row's
            reward does not depend on its batch's padding with absolute position embeddings (GPT-2).

    Returns:
        (B,) float32.
    """
    from ..collators.padding import position_ids_from_mask

    head = find_score_head(model)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    return gather_last_token_scores(token_scores(model, head, inputs), attention_mask=attention_mask)


# ---------------------------------------------------------------------------------------------------
# Reward statistics for PPO


def reward_config_of(model: nn.Module):
    """The config that is saved with the model (the base model's, for peft and value-head models)."""
    if isinstance(model, ValueHeadModel):
        model = model.pretrained_model
    return unwrap_peft(model).config


def set_reward_stats(model: nn.Module, mean: float, std: float) -> dict[str, float]:
    """Store `reward_mean` / `reward_std` in the model's config; returns them."""
    stats = {"reward_mean": float(mean), "reward_std": float(std)}
    config = reward_config_of(model)
    for key, value in stats.items():
        setattr(config, key, value)
    return stats


def save_reward_stats(directory: str, stats: dict[str, float]) -> str:
    path = os.path.join(directory, REWARD_STATS_FILE)
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(stats, f, indent=2)
    return path


def load_reward_stats(source) -> dict[str, float] | None:
    """{"reward_mean", "reward_std"} from a model (its config) or a saved directory; None when not stored."""
    if isinstance(source, nn.Module):
        config = reward_config_of(source)
        values = {k: getattr(config, k, None) for k in ("reward_mean", "reward_std")}
        return values if None not in values.values() else None
    for name in (REWARD_STATS_FILE, "config.json"):
        path = os.path.join(source, name)
        if os.path.isfile(path):
            with open(path) as f:
                data = json.load(f)
            if "reward_mean" in data and "reward_std" in data:
                return {"reward_mean": float(data["reward_mean"]), "reward_std": float(data["reward_std"])}
    return None
