"""Token log-probabilities from the last hidden states, the LM head applied to a chunk of tokens at a time.

At a real vocabulary (128-152 k entries) the (N, V) logits of N trained tokens are the largest tensor of a step,
and autograd keeps them (and their log-softmax) for the backward. Here the head runs on `chunk_size` tokens at a
time and only each token's log-prob of its label (and, on request, its entropy and whether the label is the top
token) is kept; the backward recomputes each chunk's logits from the saved hidden states and head weight. Peak
extra memory is then a few (chunk_size, V) tensors instead of (N, V) ones. Pure torch (CPU and every GPU).

The logits are the model's: z = scale * (h @ W^T + b), soft-capped as Gemma 2 does (cap * tanh(z / cap)) when
`softcap` is set, then divided by `temperature` (the sampling distribution of PPO / GRPO). The same per-token
quantities as `hf_rlhf.tensors.logprobs_from_logits` / `entropy_from_logits` on those logits, in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The most logits one chunk holds: 2^25 float32 = 128 MiB, 220 tokens of a 151,936-entry vocabulary (the backward
# holds about three (chunk, V) float32 tensors at once). Larger chunks make faster GEMMs but keep more: on an H200
# (Qwen2 shape, 2 layers, float32) 2^27 took one step of 4 x 4000 tokens in 0.53 s instead of 0.60 s (the full logits:
# 0.42 s) at the same peak, but 2 x 1000 tokens then peaked at 4,972 MB against 2,668 MB (the full logits: 4,853).
# A small vocabulary fits every token in one chunk, so a toy model pays for no loop.
CHUNK_ELEMENTS = 1 << 25


def tokens_per_chunk(vocab_size: int, chunk_size: int | None = None) -> int:
    """`chunk_size`, or the tokens whose logits fit `CHUNK_ELEMENTS` (at least one)."""
    return chunk_size if chunk_size is not None else max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def _transform(z: torch.Tensor, scale: float, softcap: float | None, temperature: float):
    """(final logits, tanh(z·scale / cap) or None) from the head's raw output z (float32)."""
    if scale != 1.0:
        z = z * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, capped


def final_logits(z: torch.Tensor, scale: float = 1.0, softcap: float | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
    """The model's logits from its head's raw output z (..., V): scaled, soft-capped, divided by `temperature`."""
    return _transform(z, scale, softcap, temperature)[0]


class TokenScores(NamedTuple):
    """Per-token outputs, each (N,) float32 (top1 bool), None where not asked for."""

    logprobs: torch.Tensor  # log p(label)
    entropy: torch.Tensor | None  # H(p), differentiable
    top1: torch.Tensor | None  # label == argmax of the logits
    mean_logits: torch.Tensor | None  # the logits' mean over the vocabulary (no gradient)
    log_sum_sq: torch.Tensor | None  # log Σ_v p_v² (no gradient; WPO's weights)


def _chunk_stats(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool, with_top1: bool, with_moments: bool):
    """(log-prob of each label, logsumexp, entropy, label-is-argmax, mean logit, log Σ p²; None where not asked for)
    of final logits (c, V)."""
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    top1 = z.argmax(-1) == labels if with_top1 else None
    mean = z.mean(-1) if with_moments else None
    log_sum_sq = torch.logsumexp(2 * z, dim=-1) - 2 * lse if with_moments else None
    return logprobs, lse, entropy, top1, mean, log_sum_sq


class ChunkedLinearLogprobs(torch.autograd.Function):
    """log p(label) (and entropy) under softmax(transform(hidden @ weight^T + bias)), chunked over tokens.

    forward(hidden (N, H), weight (V, H), bias (V,) or None, labels (N,), scale, softcap, temperature, chunk,
    with_entropy, with_top1, with_moments) -> the five `TokenScores` (N,) outputs, float32; those not asked for are
    empty (0,) tensors. Saves hidden, weight, bias, labels and the (N,) logsumexp (and entropy).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale, softcap, temperature, chunk, with_entropy, with_top1,
                with_moments):
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        parts = [[] for _ in range(6)]  # logprobs, lse, entropy, top1, mean, log Σ p²
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            z, _ = _transform(F.linear(h, weight, bias).to(out_dtype), scale, softcap, temperature)
            for part, value in zip(parts, _chunk_stats(z, y, with_entropy, with_top1, with_moments)):
                if value is not None:
                    part.append(value)
            del z
        # a distinct empty tensor per output: one marked non-differentiable must not be another output
        logprobs, lse, entropy, top1, mean, log_sum_sq = (torch.cat(part) if part else hidden.new_zeros(
            0, dtype=out_dtype) for part in parts)
        top1 = top1.bool()
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.options = (scale, softcap, temperature, chunk, with_entropy)
        ctx.mark_non_differentiable(top1, mean, log_sum_sq)
        ctx.set_materialize_grads(False)  # an output the loss does not use (the entropy metric) costs no backward
        return logprobs, entropy, top1, mean, log_sum_sq

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_non_differentiable):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        scale, softcap, temperature, chunk, with_entropy = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        use_entropy = with_entropy and grad_entropy is not None
        out_dtype = lse.dtype
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # float32 sums over the chunks, cast to the weight's dtype at the end
        grad_weight = torch.zeros(weight.shape, dtype=out_dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=out_dtype, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h, y = hidden[start:end], labels[start:end]
            z, capped = _transform(F.linear(h, weight, bias).to(out_dtype), scale, softcap, temperature)
            log_p = z.sub_(lse[start:end, None])  # z is this chunk's own: in place, one (c, V) tensor fewer
            # d log p_y / dz = onehot(y) - p;  dH / dz = -p (log p + H)
            if use_entropy:
                p = log_p.exp()
                g = log_p.add_(entropy[start:end, None]).mul_(p).mul_(-grad_entropy[start:end, None].to(out_dtype))
                if grad_logprobs is not None:
                    g.addcmul_(p, grad_logprobs[start:end, None].to(out_dtype), value=-1)
                del p
            elif grad_logprobs is not None:
                g = log_p.exp_().mul_(-grad_logprobs[start:end, None].to(out_dtype))
            else:  # only the (non-differentiable) top1 output reached the backward
                g = log_p.zero_()
            if grad_logprobs is not None:
                g.scatter_add_(-1, y[:, None], grad_logprobs[start:end, None].to(out_dtype))
            if temperature != 1.0:
                g /= temperature
            if capped is not None:  # d(cap·tanh(x / cap)) / dx = 1 - tanh²
                g *= 1 - capped * capped
            if scale != 1.0:
                g *= scale
            if need_hidden:
                grad_hidden[start:end] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                if weight.dtype == out_dtype:
                    grad_weight.addmm_(g.t(), h)  # one GEMM into the sum, no (V, H) temporary
                else:
                    grad_weight += (g.t().to(hidden.dtype) @ h).to(out_dtype)
            if need_bias:
                grad_bias += g.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None, None, None,
                None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           labels: torch.Tensor, *, scale: float = 1.0, softcap: float | None = None,
                           temperature: float = 1.0, chunk_size: int | None = None, with_entropy: bool = False,
                           with_top1: bool = False, with_moments: bool = False) -> TokenScores:
    """Per-token log-prob of `labels` under a linear LM head, computed `chunk_size` tokens at a time.

    Args:
        hidden: (N, H) last hidden states (the LM head's inputs), one per scored token.
        weight: (V, H) the head's weight (the input embeddings when tied). bias: (V,) or None.
        labels: (N,) token ids in [0, V).
        scale: the logits are multiplied by it (Cohere's `logit_scale`; 1 / Granite's `logits_scaling`).
        softcap: Gemma 2's `final_logit_softcapping`: logits = cap · tanh(logits / cap), after `scale`.
        temperature: the final logits are divided by it.
        chunk_size: tokens per chunk; None: `tokens_per_chunk(V)`.
        with_entropy: also return each token's entropy (differentiable).
        with_top1: also return whether each label is the argmax of its logits.
        with_moments: also return each token's mean logit and log Σ p² (no gradient).

    Returns:
        `TokenScores`, (N,) each; float32 (float64 for float64 inputs).
    """
    chunk = tokens_per_chunk(weight.shape[0], chunk_size)
    out = ChunkedLinearLogprobs.apply(hidden, weight, bias, labels, float(scale), softcap, float(temperature), chunk,
                                      with_entropy, with_top1, with_moments)
    wanted = (True, with_entropy, with_top1, with_moments, with_moments)
    return TokenScores(*(value if want else None for value, want in zip(out, wanted)))


def module_token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, vocab_size: int, *,
                          scale: float = 1.0, softcap: float | None = None, temperature: float = 1.0,
                          chunk_size: int | None = None, with_entropy: bool = False, with_top1: bool = False,
                          with_moments: bool = False) -> TokenScores:
    """`chunked_token_logprobs` for a head that is any module (a LoRA-wrapped or quantized `lm_head`).

    Each chunk runs `head` under `torch.utils.checkpoint` (recomputed in the backward), so only its (c,) outputs
    are kept between the forward and the backward. Args and returns as `chunked_token_logprobs`.
    """
    chunk = tokens_per_chunk(vocab_size, chunk_size)
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)

    def run(h, y):
        z, _ = _transform(head(h).to(out_dtype), scale, softcap, temperature)
        logprobs, _, *rest = _chunk_stats(z, y, with_entropy, with_top1, with_moments)
        return (logprobs, *rest)

    grad = torch.is_grad_enabled()
    parts = [checkpoint(run, h, y, use_reentrant=False) if grad else run(h, y)
             for h, y in zip(hidden.split(chunk), labels.split(chunk))]
    wanted = (True, with_entropy, with_top1, with_moments, with_moments)
    if not parts:
        empty = hidden.new_zeros(0, dtype=out_dtype)
        # a graph through the head all the same (a zero-token micro-batch still has a backward)
        logprobs = head(hidden).to(out_dtype).sum(-1) * 0 if grad else empty
        return TokenScores(logprobs, *(empty if want else None for want in wanted[1:]))._replace(
            top1=empty.bool() if with_top1 else None)
    return TokenScores(*(torch.cat(values) if want else None for values, want in zip(zip(*parts), wanted)))
