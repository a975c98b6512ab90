"""A causal LM split at its LM head: the last hidden states from the model, the head applied in chunks of tokens.

`split_lm_head(model)` reads the head (`get_output_embeddings()`: a plain `nn.Linear`, tied or not, or any module,
e.g. a peft LoRA layer wrapping it) and what the model does to its output (Cohere's `logit_scale` multiplies,
Granite's `logits_scaling` divides, Gemma 2's `final_logit_softcapping` caps), then checks once, on a few tokens, that
the model's own logits equal that head on its last hidden state. A model where they differ (another transform, a
last hidden state that is not the head's input, no `logits_to_keep` / `output_hidden_states`) is refused by name:
`HeadSplitError` says which class and why. `LMHead.token_logprobs` then gives per-token log-probs (and entropy)
through `hf_rlhf.losses.chunked_head`, never the (N, V) logits.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..losses.chunked_head import TokenScores, chunked_token_logprobs, final_logits, module_token_logprobs
from .adapters import unwrap_peft

logger = logging.getLogger("hf_rlhf")


class HeadSplitError(ValueError):
    """The model's logits are not its LM head applied to its last hidden state (as far as hf_rlhf can tell)."""


@dataclass(frozen=True)
class LMHead:
    """The output head of a causal LM and what turns its output into the model's logits.

    module: `get_output_embeddings()` (the input embeddings' module when tied). scale: multiplies the logits.
    softcap: logits = softcap * tanh(logits / softcap) after the scale (None: no cap).
    """

    module: nn.Module
    vocab_size: int
    scale: float = 1.0
    softcap: float | None = None

    def token_logprobs(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                       with_entropy: bool = False, with_top1: bool = False, with_moments: bool = False,
                       chunk_size: int | None = None) -> TokenScores:
        """`TokenScores` (log-probs (N,), entropy, top1, mean logit, log Σ p²; None where not asked for) of `labels`
        (N,) from hidden states (N, H).

        A plain `nn.Linear` head runs `chunked_token_logprobs` on its weight and bias; any other module (a LoRA layer,
        a quantized linear) runs itself per chunk under activation checkpointing (`module_token_logprobs`).
        """
        options = dict(scale=self.scale, softcap=self.softcap, temperature=temperature, chunk_size=chunk_size,
                       with_entropy=with_entropy, with_top1=with_top1, with_moments=with_moments)
        hidden = hidden.to(_device_of(self.module))
        labels = labels.to(hidden.device)
        if type(self.module) is nn.Linear:
            return chunked_token_logprobs(hidden, self.module.weight, self.module.bias, labels, **options)
        return module_token_logprobs(hidden, self.module, labels, self.vocab_size, **options)


    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits (c, V), float32, of hidden states (c, H): the head, then its scale and soft cap (for a
        chunk of tokens at a time: `hf_rlhf.losses.distillation.chunked_divergence`)."""
        z = self.module(hidden.to(_device_of(self.module)))
        return final_logits(z.to(torch.promote_types(z.dtype, torch.float32)), self.scale, self.softcap)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _logit_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) of a text config: the names transformers' causal LMs read, as trl 1.16's
    `DistillationTrainer` reads them (trl/trainer/distillation_trainer.py; inline there, no helper to import)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)  # Falcon-H1
    if scale is None and getattr(config, "logits_scaling", None) is not None:  # Granite, MiniCPM3 divide
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    return (1.0 if scale is None else float(scale)), (float(softcap) if softcap else None)


def lm_head_of(model: nn.Module) -> LMHead:
    """The `LMHead` of a causal LM or a `PeftModel` of one (not yet checked: see `split_lm_head`).

    Raises:
        HeadSplitError: the model has no output embeddings.
    """
    base = unwrap_peft(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        raise HeadSplitError(f"{type(base).__name__} has no output embeddings (get_output_embeddings() is None): "
                             "its LM head cannot be split off")
    config = base.config.get_text_config()
    scale, softcap = _logit_transform(config)
    return LMHead(head, int(config.vocab_size), scale, softcap)


def last_hidden_states(model: nn.Module, via_backbone: bool | None = None, **inputs) -> tuple[torch.Tensor, object]:
    """(hidden (B, T', H), outputs): the last hidden states, the LM head's input, without the logits.

    Args:
        model: a causal LM or a `PeftModel` of one, possibly DDP-wrapped.
        via_backbone: True: the transformer body alone (`backbone_of`), whose outputs are not kept for a hidden state
            tuple (a no-grad reference forward then holds one (B, T, H) tensor, not one per layer), but carry no MoE
            `aux_loss`; False: the model's own forward with `logits_to_keep` empty and `output_hidden_states`, through
            a DDP wrapper; None: the body under no_grad where `model` is not wrapped, else the forward.
    """
    body = None if hasattr(model, "module") else _backbone(model)  # a DDP / DeepSpeed wrapper: its own forward
    if via_backbone or (via_backbone is None and body is not None and not torch.is_grad_enabled()):
        outputs = body(**inputs)
        return outputs.last_hidden_state, outputs
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    keep = torch.zeros(0, dtype=torch.long, device=ids.device)
    outputs = model(**inputs, logits_to_keep=keep, output_hidden_states=True)
    return outputs.hidden_states[-1], outputs


def _backbone(model: nn.Module) -> nn.Module | None:
    """The transformer body of a causal LM (`model.model` for Llama; LoRA layers inside it still run), or None."""
    base = unwrap_peft(model)
    return getattr(base, getattr(base, "base_model_prefix", "model"), None)


# model -> (its head module when checked, the LMHead or the refusal's message); checked again once peft (say) has
# replaced the head module
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe(model: nn.Module, head: LMHead) -> str | None:
    """Why the model's logits are not `head` on its last hidden state, on a few tokens; None when they are."""
    device = _device_of(head.module)
    ids = torch.arange(3, 3 + min(8, head.vocab_size - 3), device=device).remainder(head.vocab_size)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
            expected = torch.log_softmax(want.reshape(-1, want.shape[-1]), -1)
            labels = expected.argmax(-1)
            expected = expected.gather(-1, labels[:, None])[:, 0]
            got = {}  # both ways to the last hidden states
            for via_backbone in (False, True) if _backbone(model) is not None else (False,):
                hidden, outputs = last_hidden_states(model, via_backbone, input_ids=ids, use_cache=False)
                if not via_backbone and outputs.logits is not None and outputs.logits.shape[1] != 0:
                    shape = tuple(outputs.logits.shape)
                    return f"its forward ignores logits_to_keep (returned logits of shape {shape})"
                got[via_backbone] = head.token_logprobs(hidden.reshape(-1, hidden.shape[-1]), labels).logprobs
    except Exception as err:  # noqa: BLE001  any failure means the split is not known to be exact
        return f"its forward with logits_to_keep and output_hidden_states failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    # 16-bit weights round the two paths differently; a missing transform is off by far more
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for via_backbone, logprobs in got.items():
        error = (logprobs.to(expected.device) - expected).abs().max().item() if logprobs.numel() else 0.0
        if not error <= tol * (1 + expected.abs().max().item()):
            where = "its body's last hidden state" if via_backbone else "its last hidden state"
            return (f"its logits are not its LM head ({type(head.module).__name__}, scale {head.scale}, softcap "
                    f"{head.softcap}) on {where}: log-probs differ by {error:.3g}")
    return None


def split_lm_head(model: nn.Module) -> LMHead:
    """The model's `LMHead`, checked once per model (cached) to give the model's own log-probs.

    Args:
        model: a causal LM or a `PeftModel` of one (not DDP-wrapped).

    Raises:
        HeadSplitError: naming the model's class and what does not split.
    """
    base = unwrap_peft(model)
    module = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    module_then, cached = _CHECKED.get(model, (None, None))
    if cached is None or module_then is not module:
        try:
            head = lm_head_of(model)
            if getattr(getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None)),
                       "is_prompt_learning", False):
                raise HeadSplitError("a prompt-learning peft adapter (virtual tokens) is active")
            reason = _probe(model, head)
            cached = head if reason is None else f"{type(base).__name__}: {reason}"
        except HeadSplitError as err:
            cached = f"{type(base).__name__}: {err}"
        _CHECKED[model] = (module, cached)
    if isinstance(cached, str):
        raise HeadSplitError(f"the LM head of {cached}; cannot compute the loss in chunks of tokens without the "
                             "full logits (set chunked_lm_head=False for the full-logits path)")
    return cached


# `chunked_lm_head=None` chunks only above this vocabulary: below it the logits of thousands of tokens fit in one
# chunk (2^25 / 4,096 = 8,192 tokens), so chunking saves nothing, and the full-logits path keeps its floats (the toy
# world's vocabulary is 107)
AUTO_MIN_VOCAB = 4096


def vocab_size_of(model: nn.Module) -> int | None:
    """Rows of the model's output head (None where it has none)."""
    base = unwrap_peft(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return None if weight is None else int(weight.shape[0])


def resolve_lm_head(model: nn.Module, mode: bool | None, trainer: str) -> LMHead | None:
    """The head to chunk over, or None for the full-logits path, as the trainer's `chunked_lm_head` says.

    Args:
        mode: True: chunked, or `HeadSplitError`; None: chunked where the vocabulary is over `AUTO_MIN_VOCAB` and the
            model splits, else the full logits (a model that does not split is logged, by name); False: the full
            logits.
        trainer: the trainer's name, for the log.
    """
    if mode is False:
        return None
    if mode is None and (vocab_size_of(model) or 0) <= AUTO_MIN_VOCAB:
        return None
    try:
        return split_lm_head(model)
    except HeadSplitError as err:
        if mode:
            raise
        logger.warning("%s: computing the loss from the full logits: %s", trainer, err)
        return None


def check_liger_lm_head(model: nn.Module) -> None:
    """`use_liger_kernel=True` refuses a peft adapter on the LM head, as TRL 1.16's GRPO / RLOO trainers do (trl#4612):
    Liger's fused linear cross-entropy reads `lm_head.weight` itself, so an adapter wrapping the head would not be
    trained. (`modules_to_save=["lm_head"]` makes the head a trained copy, not an adapter layer: allowed.)

    Args:
        model: the policy, a causal LM or a `PeftModel` of one.

    Raises:
        ValueError: the output embeddings are a peft tuner layer (a LoRA on `lm_head`).
    """
    base = unwrap_peft(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or base is model:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(head, BaseTunerLayer):
        raise ValueError("use_liger_kernel=True with a peft adapter on `lm_head` "
                         f"({type(head).__module__}.{type(head).__name__}): Liger's kernels read `lm_head.weight` "
                         "directly, so the adapter would never be trained (as TRL refuses it). Remove 'lm_head' from "
                         "the adapter's target_modules (modules_to_save=['lm_head'] trains the head in full), or set "
                         "use_liger_kernel=False (hf_rlhf's chunked LM head trains an adapter on it).")
