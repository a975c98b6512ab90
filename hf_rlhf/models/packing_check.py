"""A self-check, on the model about to be trained, that packed layouts keep their sequences apart.

`packing`, `padding_free` (SFT and reward) and `prefix_sharing` (reward) put several sequences in one row and rely
on the model to keep them apart: from restarted `position_ids` (transformers' packed-sequence detection, or flash
attention's `cu_seq_lens_*`), or from a 4D attention mask. Not every architecture does: OPT builds its causal mask
without the `position_ids`, so packed sequences attend to each other, silently. Remote code may do anything.

`check_packing_exact` runs two short random sequences through the model laid out as the trainer's collator lays
them out, and apart, and compares what every head reads (the backbone's last hidden state; the logits when the
model has no backbone attribute). It takes a few milliseconds on a small model and raises `PackingCheckError`
naming the architecture, the layout, the difference and what to do.
"""

from __future__ import annotations

import torch
from torch import nn

from ..collators import PackingCollator, PairwiseCollator
from ..tensors import additive_mask
from .adapters import unwrap_peft
from .value_head import ValueHeadModel, backbone_of

LAYOUTS = ("packing", "padding_free", "prefix_sharing")
# max |packed - apart| / max |apart| allowed: float32 rounding, or half-precision rounding
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 3e-2


class PackingCheckError(ValueError):
    """A packed layout gives the model's sequences different outputs from running them apart."""


def _causal_lm_of(model: nn.Module) -> nn.Module:
    return model.pretrained_model if isinstance(model, ValueHeadModel) else model


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _outputs(model: nn.Module, inputs: dict) -> torch.Tensor:
    """(1, T, H) last hidden state of the backbone (the logits (1, T, V) if there is no backbone), float32."""
    try:
        body = backbone_of(_causal_lm_of(unwrap_peft(model)))
    except ValueError:
        return model(**inputs).logits.float()
    return body(**inputs).last_hidden_state.float()


@torch.no_grad()
def check_packing_exact(model: nn.Module, layout: str, max_length: int | None = None,
                        lengths: tuple[int, int] = (6, 4), seed: int = 0) -> float:
    """Raise `PackingCheckError` unless two sequences give the same outputs laid out as `layout` and apart.

    Args:
        model: the model to train: a causal LM, a sequence-classification or `ValueHeadModel` reward model, or a
            `PeftModel` of one; any device and dtype. It is run in eval mode (dropout off) and put back.
        layout: "packing" / "padding_free": the sequences end to end in one row with restarted `position_ids`,
            no attention mask, `use_cache=False`, as `PackingCollator` lays them out (flash attention also gets
            `cu_seq_lens_*`). "prefix_sharing": one pair [shared prefix | chosen tail | rejected tail] with the
            4D mask of `PairwiseCollator(prefix_sharing=True)`.
        max_length: the longest sequence the trainer will see (None: unbounded). prefix_sharing's 4D mask
            replaces a sliding-window model's own mask, so it is exact only while sequences fit in the window;
            with a window and a longer (or unbounded) max_length it is refused without a forward.
        lengths: lengths of the two sequences (for prefix_sharing: of the chosen and rejected sequences, which
            share their first half).
        seed: of the random token ids.

    Returns:
        The largest relative difference found, max |laid out - apart| / max |apart| (below the tolerance).

    Raises:
        PackingCheckError: the difference is above the tolerance (1e-4 in float32, 3e-2 in half precision).
        ValueError: an unknown layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    base = unwrap_peft(_causal_lm_of(unwrap_peft(model)))
    config = base.config
    attn = getattr(config, "_attn_implementation", None) or "eager"
    window = getattr(config.get_text_config(), "sliding_window", None)
    if layout == "prefix_sharing" and window and (max_length is None or max_length > window):
        raise PackingCheckError(
            f"prefix_sharing=True is not exact on this model ({config.model_type}): its own 4D attention mask "
            f"replaces the model's sliding window of {window} tokens, so sequences longer than the window "
            f"(max_length={max_length}) would attend beyond it. Use padding_free=True (exact with sliding windows), "
            f"or max_length <= {window}.")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config().vocab_size
    first, second = (torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths)
    if layout == "prefix_sharing":
        second = first[: min(lengths) // 2] + second[min(lengths) // 2:]

    def run(inputs: dict) -> torch.Tensor:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        return _outputs(model, {**inputs, "use_cache": False})[0]

    was_training = model.training
    model.eval()
    try:
        apart = [run({"input_ids": torch.tensor([ids])}) for ids in (first, second)]
        if layout == "prefix_sharing":
            batch = PairwiseCollator(pad_token_id=0, prefix_sharing=True)([{"chosen_ids": first,
                                                                            "rejected_ids": second}])
            mask = batch["attention_mask"]
            if attn == "eager":  # eager adds the mask to its scores (as RewardTrainer passes it)
                mask = additive_mask(mask, _float_dtype(model))
            laid_out = run({"input_ids": batch["input_ids"], "attention_mask": mask,
                            "position_ids": batch["position_ids"]})
            shared = len(first) + len(second) - batch["input_ids"].shape[1]
            expected = torch.cat([apart[0], apart[1][shared:]])
        else:
            flash = attn.startswith("flash_attention")
            batch = PackingCollator(completion_only_loss=False, return_flash_attention_kwargs=flash)(
                [{"input_ids": first}, {"input_ids": second}])
            batch.pop("labels")
            laid_out = run(batch)
            expected = torch.cat(apart)
    finally:
        model.train(was_training)
    difference = (laid_out - expected).abs().max().item()
    relative = difference / max(expected.abs().max().item(), 1e-12)
    dtype = _float_dtype(model)
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    if not relative <= tolerance:  # NaN fails too
        raise PackingCheckError(
            f"{layout}=True is not exact on this model ({config.model_type}, {attn} attention, {dtype}): two "
            f"sequences laid out as {layout} lays them out give outputs up to {difference:.3g} away (relative "
            f"{relative:.2g}, tolerance {tolerance:g}) from the same sequences run apart, so the sequences of a "
            f"row would see each other or be misplaced. Set {layout}=False; or, if you know better, "
            "packing_check=False to train anyway.")
    return relative


@torch.no_grad()
def right_padding_needs_no_mask(model: nn.Module, lengths: tuple[int, int] = (6, 4), seed: int = 0) -> bool:
    """Whether a right-padded batch gives its real tokens the same outputs without its attention mask (pure causal
    attention: no real token sees the padding after it), so that sdpa can take its causal kernel instead of a dense
    mask. False where the model reads the mask otherwise (positions from the mask other than a running count, say).

    Args:
        model: a causal LM or a `PeftModel` of one; run in eval mode and put back. lengths: two rows, the second padded.
        seed: of the random token ids.

    Returns:
        whether the real positions' outputs (backbone hidden states, else logits) agree within `TOLERANCE`.
    """
    base = unwrap_peft(_causal_lm_of(unwrap_peft(model)))
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    vocab = base.config.get_text_config().vocab_size
    width = max(lengths)
    input_ids = torch.randint(0, vocab, (len(lengths), width), generator=generator).to(device)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long().to(device)
    was_training = model.training
    model.eval()
    try:
        masked = _outputs(model, {"input_ids": input_ids, "attention_mask": mask, "use_cache": False})
        causal = _outputs(model, {"input_ids": input_ids, "use_cache": False})
    finally:
        model.train(was_training)
    real = mask.bool()
    difference = (masked[real] - causal[real]).abs().max().item() / max(masked[real].abs().max().item(), 1e-12)
    return difference <= TOLERANCE.get(_float_dtype(model), HALF_TOLERANCE)  # NaN: False
