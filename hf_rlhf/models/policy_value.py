"""The one module PPO trains: the policy (a causal LM or a `PeftModel` of one) and its value function.

The value function is either
  (a) a value head, `Linear(hidden, 1)` initialised N(0, 1/(hidden + 1)), on the policy's last hidden state (default:
      one backbone, one forward for logits and values), or
  (b) a separate value model: a sequence-classification model with one label (its `score` head read at every
      token), or a `hf_rlhf.models.value_head.ValueHeadModel`, e.g. initialised from the reward model, or
  (c) a value adapter: a second LoRA adapter ("value") of the policy's `PeftModel` with a value head on its last
      hidden state: one frozen base for both (see `hf_rlhf.models.value_adapter`); two forwards, one per adapter; or
  (d) none at all (`with_value=False`) for the critic-free estimators (GRPO, RLOO, REINFORCE++): no head, no
      hidden states kept for it, no `value/` directory saved; the module's parameter names are the policy's own
      (no `policy.` prefix), as `trl.GRPOTrainer.model`'s.

One `nn.Module` means one optimizer (the value parameters may get their own learning rate) and one thing for
DDP / DeepSpeed / FSDP to wrap. A plain wrapper around a model with tied embeddings fails the Trainer's safetensors
save, so `save_policy_and_value` writes the policy with its own `save_pretrained` into the output directory (a full
model or a LoRA adapter, loadable as is) and the value head / value model into `<output_dir>/value/` (for (c): the
value adapter and `value_head.safetensors`, which `ValueHeadModel.from_pretrained` reads back). Only the policy
adapter is saved as the policy: a reward adapter loaded on the same base is not written into checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel, is_peft_model
from torch import nn
from transformers.utils import ModelOutput

from ..rollout.shared_prompts import shared_prompt_layout
from ..tensors import additive_mask, entropy_from_logits, logprobs_from_logits
from .adapters import adapter_parameter_names, adapter_scope, set_adapter_requires_grad, unwrap_peft
from .lm_head import LMHead, last_hidden_states
from .loading import load_weights
from .value_head import VALUE_HEAD_FILE, ValueHeadModel, backbone_of, find_score_head, new_value_head, token_scores

VALUE_DIR = "value"


@dataclass
class PolicyValueOutput(ModelOutput):
    """logits: (B, T', V) with T' = `logits_to_keep` (or T); token_values: (B, T) float32.

    Not named `values`: a ModelOutput is a dict, and DDP walks outputs with `.values()`.
    """

    logits: torch.Tensor | None = None
    token_values: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # (B, T', H) the policy's last hidden states, with `return_hidden`


class PolicyAndValue(nn.Module):
    """Policy + value function as one module; `forward` gives per-token logits and values.

    Args:
        policy: a causal LM `PreTrainedModel` or a `PeftModel` of one.
        value_model: None for a value head on the policy backbone (a); else a sequence-classification model with
            one label or a `ValueHeadModel` (b).
        head_init_std: std of the value head's initial weights. None: 1/sqrt(hidden + 1) (Ziegler et al. 2019).
        value_adapter: the name of a trainable adapter of the policy `PeftModel` that the value head reads (c);
            None: the head reads the policy's own hidden states (a).
        with_value: False for no value function at all (d); `forward` then returns `token_values=None`.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None = None, head_init_std: float | None = None,
                 value_adapter: str | None = None, with_value: bool = True):
        super().__init__()
        if value_adapter is not None and (value_model is not None or value_adapter not in policy.peft_config):
            raise ValueError(f"value_adapter={value_adapter!r} needs a PeftModel policy with that adapter and no "
                             "value_model")
        if not with_value and (value_model is not None or value_adapter is not None):
            raise ValueError("with_value=False (a critic-free estimator) takes no value_model and no value_adapter")
        if with_value:
            self.policy = policy
        else:  # not registered: the policy's own children are this module's (see `_share_policy_tree`)
            object.__setattr__(self, "policy", policy)
        self.value_model = value_model
        self.value_adapter = value_adapter
        self.with_value = with_value
        self.value_head = None
        if value_model is None and with_value:
            self.value_head = new_value_head(unwrap_peft(policy).config.get_text_config().hidden_size, head_init_std,
                                             device=next(policy.parameters()).device)
        self._value_score_head = None if value_model is None else find_score_head(value_model)
        # the Trainer reads these from the model it trains; its batches are experience, whose tokens to count
        # (include_num_input_tokens_seen) are the responses
        self.config = unwrap_peft(policy).config
        self.main_input_name = "response_ids"
        self.supports_gradient_checkpointing = getattr(unwrap_peft(policy), "supports_gradient_checkpointing", False)
        if not with_value:
            self._share_policy_tree()

    def _share_policy_tree(self) -> None:
        """(d): this module's parameters, buffers and children are the policy's own, under the policy's names.

        With nothing besides the policy to train, `named_parameters()`, `state_dict()` and `get_parameter(name)`
        read as the policy's (`model.embed_tokens.weight`, `base_model.model....lora_A.default.weight`), as
        `trl.GRPOTrainer.model` does, and a TRL reference model's names match the trained model's
        (`sync_ref_model`). The three registries are the policy's dicts themselves: one set of modules, never a
        copy. Called last in `__init__`: after it, a module assigned to this one would join the policy's children.
        """
        for registry in ("_parameters", "_buffers", "_modules"):
            self.__dict__[registry] = getattr(self.policy, registry)

    def train(self, mode: bool = True):
        super().train(mode)
        if not self.with_value:  # the policy object itself is no child of this module in (d): its own flag too
            self.policy.training = mode
        return self

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep: int = 0,
                return_hidden: bool = False) -> PolicyValueOutput:
        """Per-token logits (the last `logits_to_keep` positions; 0: all) and values (all positions), float32.

        return_hidden: the policy's last hidden states (those positions) instead of the logits, for the LM head in
        chunks of tokens (`hf_rlhf.models.lm_head`)."""
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        shared = self.reads_policy_hidden
        if return_hidden:
            last, out = last_hidden_states(self.policy, **inputs)
        else:
            out = self.policy(**inputs, logits_to_keep=logits_to_keep, output_hidden_states=shared)
            last = out.hidden_states[-1] if shared else None  # after the final norm, as the LM head sees it
        if self.value_head is not None:
            if shared:
                hidden = last
            else:  # (c): the same base under the value adapter; the LM head is skipped
                if torch.is_grad_enabled():
                    self.require_value_grads()  # before the scope, which restores the flags it finds on entry
                with adapter_scope(self.policy, self.value_adapter):
                    hidden = backbone_of(self.policy)(**inputs).last_hidden_state
            values = self.head_values(hidden)
        elif self.value_model is not None:
            values = token_scores(self.value_model, self._value_score_head, inputs)
        else:
            values = None
        if return_hidden:
            # the forward's empty (B, 0, V) logits go out too: DDP (find_unused_parameters) finds the LM head used
            # through them, the head applied to the hidden states after this forward returns
            return PolicyValueOutput(logits=getattr(out, "logits", None), token_values=values,
                                     hidden=last[:, -logits_to_keep:] if logits_to_keep else last)
        return PolicyValueOutput(logits=out.logits, token_values=values)

    @property
    def lm_head(self) -> nn.Module:
        """The policy's LM head (TRL's tests read `trainer.model.lm_head`)."""
        return self.policy.get_output_embeddings()

    @property
    def reads_policy_hidden(self) -> bool:
        """True for (a): the value head reads the policy's own last hidden state (the one the LM head reads)."""
        return self.value_head is not None and self.value_adapter is None

    def head_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head on hidden states (..., H): values (...) in float32."""
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def require_value_grads(self) -> None:
        """Make the value adapter's parameters require grad again (nothing to do without a value adapter).

        peft's own switches (`PeftModel.disable_adapter`, `set_adapter`) leave only the active adapter requiring
        grad, so one run outside `adapter_scope` (a user's callback, a helper of another library) freezes the value
        adapter; `adapter_scope` would then restore that frozen flag before the backward, and the Trainer would build
        its optimizer without the value adapter: the value function would silently stop training. Called before
        every value forward that records a graph and before the optimizer is built.
        """
        if self.value_adapter is not None:
            set_adapter_requires_grad(self.policy, self.value_adapter, True)

    def value_parameter_names(self) -> set[str]:
        """Names (as in `named_parameters()`) of the value function's own parameters."""
        prefixes = ("value_head.", "value_model.")
        names = {name for name, _ in self.named_parameters() if name.startswith(prefixes)}
        if self.value_adapter is not None:
            names |= set(adapter_parameter_names(self, self.value_adapter))
        return names

    # Trainer hooks, delegated to the models inside
    def activation_checkpointing_enable(self, **kwargs):
        for model in (self.policy, self.value_model):
            if model is not None:
                model.activation_checkpointing_enable(**kwargs)

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(getattr(unwrap_peft(self.policy), "is_activation_checkpointing", False))

    def enable_input_require_grads(self):
        self.policy.enable_input_require_grads()

    # what `BaseTrainer` saves and resumes for a module that is not a PreTrainedModel
    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        save_policy_and_value(self, save_directory, state_dict)

    def load_checkpoint(self, directory: str) -> None:
        load_policy_and_value(self, directory)


# ---------------------------------------------------------------------------------------------------
# Prompt + response as one sequence


def sequence_inputs(query_ids, query_mask, response_ids, response_mask) -> dict[str, torch.Tensor]:
    """Model inputs for left-padded prompts followed by right-padded responses.

    `position_ids` count real tokens only (as `generate` does for left padding), so a row's logits do not depend
    on how much padding its batch has.

    Returns:
        {"input_ids", "attention_mask", "position_ids"}: each (B, Q + R).
    """
    attention_mask = torch.cat([query_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": torch.cat([query_ids, response_ids], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids}


def _attention_of(model: nn.Module) -> str | None:
    """The attention implementation of `model` (a DDP / DeepSpeed wrapper, `PolicyAndValue`, peft or causal LM).

    Read from `model.config` when it has one (every forward of a rollout and the loss asks): accelerate's unwrap
    checks whether DeepSpeed is installed through package metadata, ~3 ms a call."""
    config = getattr(model, "config", None)
    if config is None:  # a DDP / DeepSpeed wrapper has no config of its own
        config = getattr(extract_model_from_parallel(model), "config", None)
    return getattr(config, "_attn_implementation", None)


def _values_of(output) -> torch.Tensor | None:
    return output.get("token_values")  # None for a plain causal LM (the reference)


def response_logits(model: nn.Module, query_ids, query_mask, response_ids, response_mask, temperature: float = 1.0,
                    extra_rows: tuple[torch.Tensor, torch.Tensor] | None = None, share_prompts: bool = False):
    """Run `model` on prompt + response and keep what predicts each response token.

    Args:
        model: a `PolicyAndValue` (possibly DDP-wrapped) or a causal LM (the reference).
        query_ids, query_mask: (B, Q). response_ids, response_mask: (B, R).
        temperature: response logits are divided by it (the distribution that sampled the responses).
        extra_rows: (input_ids, attention_mask), (B2, L) right-padded rows run in the same forward (the ptx
            batch: one forward, so DDP sees each parameter used once per backward).
        share_prompts: rows with the same prompt run as one row, the prompt computed once
            (`hf_rlhf.rollout.shared_prompts`; not with `extra_rows`); the same outputs to float rounding.

    Returns:
        (logits (B, R, V), values (B, R) or None for a plain causal LM, extra logits (B2, L, V) or None):
        position t is what the model predicts for response token t, i.e. its output at the token before it.
    """
    logits, values, extra = _response_outputs(model, query_ids, query_mask, response_ids, response_mask, extra_rows,
                                              share_prompts, hidden=False)
    return logits / temperature, values, extra


def response_hidden(model: nn.Module, query_ids, query_mask, response_ids, response_mask,
                    share_prompts: bool = False) -> torch.Tensor:
    """The last hidden states (B, R, H) that predict each response token: the LM head's inputs, no logits.

    Args: as `response_logits` (`model` a `PolicyAndValue`, possibly wrapped, or a causal LM / `PeftModel`).
    """
    hidden, _, _ = _response_outputs(model, query_ids, query_mask, response_ids, response_mask, None, share_prompts,
                                     hidden=True)
    return hidden


def response_scores(model: nn.Module, head: LMHead | None, query_ids, query_mask, response_ids, response_mask,
                    temperature: float = 1.0, share_prompts: bool = False, entropy_grad: bool = False,
                    extra_rows: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Log-probs and entropy of the response tokens: `response_logits` reduced per token.

    With an `LMHead` (`hf_rlhf.models.lm_head`) the model returns its last hidden states and the head runs in chunks
    of the response tokens where `response_mask` is 1, never the (B, R, V) logits; those tokens' log-probs and
    entropies equal the full logits' (to float rounding), every other position is 0. Without one (or with
    `extra_rows`, whose loss reads their logits) the full logits.

    Args:
        head: the model's split LM head (its policy's for a `PolicyAndValue`), or None.
        entropy_grad: the entropy keeps its graph (an entropy bonus); else it is detached.
        Others: as `response_logits`.

    Returns:
        (logprobs (B, R), entropy (B, R), values (B, R) or None, extra logits (B2, L, V) or None).
    """
    if head is None or extra_rows is not None:
        logits, values, extra = response_logits(model, query_ids, query_mask, response_ids, response_mask,
                                                temperature, extra_rows, share_prompts)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
        return logprobs_from_logits(logits, response_ids), entropy, values, extra
    hidden, values, _ = _response_outputs(model, query_ids, query_mask, response_ids, response_mask, None,
                                          share_prompts, hidden=True)
    keep = response_mask.bool()
    logprobs, entropy, *_ = head.token_logprobs(hidden[keep], response_ids[keep], temperature, with_entropy=True)
    if not entropy_grad:
        entropy = entropy.detach()
    zeros = torch.zeros(keep.shape, dtype=logprobs.dtype, device=keep.device)
    return (zeros.masked_scatter(keep, logprobs.to(keep.device)), zeros.masked_scatter(keep, entropy.to(keep.device)),
            values, None)


def _run(model: nn.Module, inputs: dict, keep: int, hidden: bool):
    """(the last `keep` positions' logits or last hidden states (0: all), values or None) of one forward."""
    if not hidden:
        out = model(**inputs, logits_to_keep=keep)
        return out.logits, _values_of(out)
    if isinstance(getattr(model, "module", model), PolicyAndValue):  # through a DDP / DeepSpeed wrapper's forward
        out = model(**inputs, logits_to_keep=keep, return_hidden=True)
        return out.hidden, _values_of(out)
    last, _ = last_hidden_states(model, **inputs, use_cache=False)
    return (last[:, -keep:] if keep else last), None


def _response_outputs(model, query_ids, query_mask, response_ids, response_mask, extra_rows, share_prompts,
                      hidden: bool):
    """`response_logits` before the temperature, or with `hidden` the last hidden states in place of the logits."""
    layout = shared_prompt_layout(query_ids, query_mask, response_ids, response_mask) if (
        share_prompts and extra_rows is None) else None
    if layout is not None:
        inputs = dict(layout.inputs)
        if _attention_of(model) == "eager":  # eager adds the mask to its scores
            inputs["attention_mask"] = additive_mask(inputs["attention_mask"])
        outputs, values = _run(model, inputs, layout.keep, hidden)
        if values is not None:
            values = layout.gather(values[:, -layout.keep:])
        return layout.gather(outputs), values, None
    inputs = sequence_inputs(query_ids, query_mask, response_ids, response_mask)
    length = response_ids.shape[1]
    if extra_rows is None:
        outputs, values = _run(model, inputs, length + 1, hidden)
        outputs, extra = outputs[:, :-1], None
    else:
        extra_ids, extra_mask = extra_rows
        width = max(inputs["input_ids"].shape[1], extra_ids.shape[1])
        extra_inputs = {"input_ids": extra_ids, "attention_mask": extra_mask,
                        "position_ids": (extra_mask.cumsum(-1) - 1).clamp(min=0)}
        # pad both parts on the right to one width; padding is masked and never read back
        stacked = {key: torch.cat([F.pad(inputs[key], (0, width - inputs[key].shape[1])),
                                   F.pad(extra_inputs[key], (0, width - extra_ids.shape[1]))])
                   for key in inputs}
        out = model(**stacked)
        end, rows = inputs["input_ids"].shape[1], query_ids.shape[0]
        outputs, extra = out.logits[:rows, end - length - 1:end - 1], out.logits[rows:, :extra_ids.shape[1]]
        values = _values_of(out)
        values = None if values is None else values[:rows, :end]
    if values is not None:
        values = values[:, -length - 1:-1]
    return outputs, values, extra


# ---------------------------------------------------------------------------------------------------
# Saving and loading


def _split_state_dict(state_dict: dict | None, prefix: str) -> dict | None:
    if state_dict is None:
        return None
    return {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}


def save_policy_and_value(module: PolicyAndValue, output_dir: str, state_dict: dict | None = None,
                          is_main_process: bool = True) -> None:
    """Policy into `output_dir` (save_pretrained: full weights or LoRA adapter), value into `output_dir/value/`.

    Args:
        state_dict: the full module's state dict when the Trainer gathered it (DeepSpeed); None: each part's own.
    """
    from safetensors.torch import save_file

    value_dir = os.path.join(output_dir, VALUE_DIR)
    policy_state = _split_state_dict(state_dict, "policy." if module.with_value else "")
    # a PeftModel saves every adapter by default; the policy is its active one (never the frozen reward adapter)
    only = {"selected_adapters": [module.policy.active_adapter]} if is_peft_model(module.policy) else {}
    module.policy.save_pretrained(output_dir, state_dict=policy_state, is_main_process=is_main_process, **only)
    if module.value_adapter is not None:  # peft writes an adapter not named "default" to <dir>/<its name>: value/
        module.policy.save_pretrained(output_dir, state_dict=policy_state, is_main_process=is_main_process,
                                      selected_adapters=[module.value_adapter])
    if not is_main_process or not module.with_value:
        return
    os.makedirs(value_dir, exist_ok=True)
    if module.value_head is not None:
        head = _split_state_dict(state_dict, "value_head.") or module.value_head.state_dict()
        save_file({k: v.detach().contiguous().cpu() for k, v in head.items()}, os.path.join(value_dir, VALUE_HEAD_FILE))
    else:
        module.value_model.save_pretrained(value_dir, state_dict=_split_state_dict(state_dict, "value_model."))


def load_policy_and_value(module: PolicyAndValue, directory: str) -> None:
    """Load what `save_policy_and_value` wrote back into `module`, in place (parameters keep their identity)."""
    from safetensors.torch import load_file

    load_weights(module.policy, directory)
    value_dir = os.path.join(directory, VALUE_DIR)
    if module.value_adapter is not None:
        load_weights(module.policy, os.path.join(directory, module.value_adapter), adapter_name=module.value_adapter)
    if module.value_head is not None:
        path = os.path.join(value_dir, VALUE_HEAD_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: {directory} is not a PPO checkpoint with a value head")
        module.value_head.load_state_dict(load_file(path, device=str(module.value_head.weight.device)))
    elif not module.with_value:
        return
    elif isinstance(module.value_model, ValueHeadModel):
        module.value_model.load_checkpoint(value_dir)
    else:
        load_weights(module.value_model, value_dir)
