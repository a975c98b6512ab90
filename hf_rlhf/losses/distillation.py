"""On-policy distillation's loss: the generalised Jensen-Shannon divergence between student and teacher.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD), Eq. 1,
as trl 1.16 computes it (`trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`, and per token in
`trl.kernels.chunked_divergence`): with p_s = softmax(z_s / T), p_t = softmax(z_t / T) over the vocabulary,

    beta = 0:        KL(p_t || p_s)                                  (forward KL)
    beta = 1:        KL(p_s || p_t)                                  (reverse KL)
    0 < beta < 1:    beta KL(p_t || m) + (1 - beta) KL(p_s || m),    m = (1 - beta) p_s + beta p_t

`chunked_divergence` gives the same per-token values from the two models' last hidden states, their heads applied
to a chunk of tokens at a time (recomputed in the backward), so neither model's (N, V) logits are ever held whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

REDUCTIONS = ("batchmean", "sum", "mean", "none")
# The most (chunk, V) elements one chunk of the divergence holds: 2^24 float32 = 64 MiB, 110 tokens of a 151,936-entry
# vocabulary; a chunk holds about six such tensors at once (both models' logits and log-probs, the mixture, the
# gradient). On the Qwen2.5-0.5B shape (1-layer student, 2-layer teacher, 4 x 64 tokens a micro-batch, 2 steps of
# bench/distill.py --preset qwen, fp32, CPU) the run peaked at 5,281 MB with 2^25, 4,674 MB with 2^24 and 4,720 MB
# with 2^23, in 31.3 / 31.5 / 32.1 s.
DIVERGENCE_CHUNK_ELEMENTS = 1 << 24


def divergence_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of `chunked_divergence` at this vocabulary: `DIVERGENCE_CHUNK_ELEMENTS` // V, at least 1."""
    return max(1, DIVERGENCE_CHUNK_ELEMENTS // max(1, vocab_size))


def divergence_per_element(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                           beta: float) -> torch.Tensor:
    """The generalised JSD's terms, one per vocabulary entry, from log-probabilities (TRL's formula, op for op).

    Args:
        student_log_probs: (..., V) log p_s. teacher_log_probs: (..., V) log p_t.
        beta: 0 forward KL, 1 reverse KL, in between the JSD against the mixture (1 - beta) p_s + beta p_t.

    Returns:
        (..., V): summed over the last dimension, the divergence of each position.
    """
    if beta == 0:
        return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    weight = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
    mixture = torch.logsumexp(torch.stack([student_log_probs + torch.log1p(-weight),
                                           teacher_log_probs + torch.log(weight)]), dim=0)
    kl_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
    return weight * kl_teacher + (1 - weight) * kl_student


def divergence_and_gradient(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                            temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence (...,), student entropy (...,), d divergence / d student_logits (..., V)), float32 (float64 stays
    so), no autograd graph; the formulas are `_TokenDivergence`'s."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    with torch.no_grad():
        log_ps = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
        log_pt = F.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
        p_s = log_ps.exp()
        entropy = -(p_s * log_ps).sum(-1)
        if beta == 0:
            p_t = log_pt.exp()
            divergence = (p_t * (log_pt - log_ps)).sum(-1)
            grad = p_s.sub_(p_t)
        elif beta == 1:
            diff = log_ps.sub_(log_pt)
            divergence = (p_s * diff).sum(-1)
            grad = diff.sub_(divergence.unsqueeze(-1)).mul_(p_s)
        else:
            log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
            teacher_term = (log_pt.exp() * (log_pt - log_m)).sum(-1)
            g = log_ps.sub_(log_m).mul_(1.0 - beta)  # (1 - beta)(log p_s - log m)
            student_term = (p_s * g).sum(-1)  # = (1 - beta) KL(p_s || m)
            divergence = beta * teacher_term + student_term
            grad = g.sub_(student_term.unsqueeze(-1)).mul_(p_s)
        if temperature != 1.0:
            grad.div_(temperature)
    return divergence, entropy, grad


class _TokenDivergence(torch.autograd.Function):
    """Per-position divergence and student entropy with the gradient to the student's logits worked out by hand.

    The forward keeps one (..., V) tensor for the backward, G = d divergence / d z_s, instead of autograd's graph
    through log-softmax, the mixture's log-sum-exp and two KL terms (several (..., V) tensors, and as many again in
    their backward). With p = softmax(z / T), per position:

        beta = 0:       D = Σ p_t (log p_t - log p_s)                 G = (p_s - p_t) / T
        beta = 1:       D = Σ p_s (log p_s - log p_t)                 G = p_s (log p_s - log p_t - D) / T
        otherwise:      D = beta KL(p_t || m) + (1 - beta) KL(p_s || m),  g = (1 - beta)(log p_s - log m),
                        G = p_s (g - Σ p_s g) / T,                    m = (1 - beta) p_s + beta p_t
    """

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, beta: float, temperature: float):
        divergence, entropy, grad = divergence_and_gradient(student_logits, teacher_logits, beta, temperature)
        ctx.save_for_backward(grad)
        ctx.logits_dtype = student_logits.dtype
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, grad_divergence, grad_entropy):
        (grad,) = ctx.saved_tensors
        return (grad * grad_divergence.unsqueeze(-1)).to(ctx.logits_dtype), None, None, None


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence, student entropy) of each position from full logits, in float32 (float64 stays so).

    The values are `divergence_per_element` summed over the vocabulary (TRL's); the gradient to `student_logits` is
    computed in the forward (`_TokenDivergence`), so the backward holds one (..., V) tensor. The teacher's logits get
    no gradient.

    Args:
        student_logits: (..., V), differentiable. teacher_logits: (..., V).
        beta: see `divergence_per_element`. temperature: both logits are divided by it first.

    Returns:
        ((...,) divergence, (...,) entropy of p_s in nats, no gradient).
    """
    if not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _TokenDivergence.apply(student_logits, teacher_logits.detach(), float(beta), float(temperature))


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         labels: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                         reduction: str = "batchmean", num_items_in_batch=None) -> torch.Tensor:
    """trl's `generalized_jsd_loss` (GKD; same arguments, same values): the divergence reduced over positions.

    Args:
        student_logits, teacher_logits: (B, T, V).
        labels: (B, T), -100 where a position is left out; None: every position counts.
        beta, temperature: see `token_divergence`.
        reduction: "batchmean" (sum / kept positions with labels, sum / B without), "sum", "mean" (over elements),
            or "none" (the (B, T, V) terms, or the kept positions' (N, V) terms with labels).
        num_items_in_batch: when given, sum / num_items_in_batch whatever `reduction` says (gradient accumulation).

    Returns:
        a scalar, or the unreduced terms for reduction="none".
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    terms = divergence_per_element(F.log_softmax(student_logits / temperature, dim=-1),
                                   F.log_softmax(teacher_logits / temperature, dim=-1), beta)
    mask = None
    if labels is not None:
        mask = labels != -100
        terms = terms[mask]
    if num_items_in_batch is not None:
        total = terms.sum()
        return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch)
                        else num_items_in_batch)
    if reduction == "batchmean":
        return terms.sum() / (mask.sum().clamp_min(1) if mask is not None else max(terms.size(0), 1))
    if reduction == "sum":
        return terms.sum()
    if reduction == "mean":
        return terms.mean()
    return terms


def reduce_divergence(divergence: torch.Tensor, mask: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Σ divergence over `mask` / num_items_in_batch, or / the kept positions (at least 1) when it is None (TRL).

    Args:
        divergence: (B, T) or (N,) per position. mask: the same shape, 1 where a position is trained on.
    """
    total = (divergence * mask.to(divergence.dtype)).sum()
    if num_items_in_batch is None:
        return total / mask.sum().clamp(min=1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def chunked_divergence(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_logits_fn,
                       teacher_logits_fn, beta: float, temperature: float = 1.0,
                       chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_divergence` from the models' last hidden states, the heads applied `chunk_size` tokens at a time.

    Each chunk runs under activation checkpointing: the forward keeps only its (c,) outputs and the backward
    recomputes the chunk's student logits (and the teacher's, without gradient), so the peak holds a few (c, V)
    tensors, never (N, V) ones of either model.

    Args:
        student_hidden: (N, H_s), differentiable. teacher_hidden: (N, H_t); the widths may differ.
        student_logits_fn, teacher_logits_fn: (c, H) -> (c, V) final logits (the model's scale / soft cap applied,
            not the temperature); only the student's carries a gradient.
        beta, temperature: see `token_divergence`. chunk_size: tokens per chunk.

    Returns:
        ((N,) divergence, (N,) student entropy without gradient), float32.
    """
    if not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise ValueError(f"beta must be in [0, 1], got {beta}")

    def run(h_s, h_t):
        with torch.no_grad():
            z_t = teacher_logits_fn(h_t)
        return token_divergence(student_logits_fn(h_s), z_t, beta, temperature)

    grad = torch.is_grad_enabled() and student_hidden.requires_grad
    parts = [checkpoint(run, h_s, h_t, use_reentrant=False) if grad else run(h_s, h_t)
             for h_s, h_t in zip(student_hidden.split(chunk_size), teacher_hidden.split(chunk_size))]
    if not parts:  # no trained token: a zero that still reaches the student's head (a backward must run)
        zero = student_logits_fn(student_hidden[:0]).sum() * 0.0
        return zero.reshape(1)[:0].float(), student_hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class _LinearHeadDivergence(torch.autograd.Function):
    """Σ divergence over tokens, the student's head a linear layer: gradients worked out chunk by chunk in the forward.

    forward(hidden (N, H), weight (V, H), bias (V,) or None, teacher_hidden (N, H_t), teacher_logits_fn, scale,
    softcap, beta, temperature, chunk) -> (Σ divergence, (N,) divergence, (N,) entropy). Per chunk: the student's
    final logits, the teacher's, `divergence_and_gradient`, then d/d hidden = G W into an (N, H) buffer and
    d/d weight += Gᵀ h into one (V, H) buffer (Liger's and TRL's fused-linear layout): the head runs twice per chunk
    instead of four times (forward, recompute, two backward products), and no chunk's autograd graph is kept. The
    backward scales the buffers by the loss's gradient, a scalar, so the result is exact for any use of the sum.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_logits_fn, scale, softcap, beta, temperature,
                chunk):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        divergence, entropy = hidden.new_empty(n, dtype=dtype), hidden.new_empty(n, dtype=dtype)
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b else None
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]  # autograd is off inside a Function's forward
            z, capped = F.linear(h, weight, bias).to(dtype), None
            if scale != 1.0:
                z.mul_(scale)
            if softcap is not None:
                capped = z.div_(softcap).tanh_()
                z = capped * softcap
            z_t = teacher_logits_fn(teacher_hidden[start:start + chunk])
            d, e, g = divergence_and_gradient(z, z_t, beta, temperature)
            del z, z_t
            if capped is not None:  # d (cap tanh(z scale / cap)) / d(z scale) = 1 - tanh²
                g.mul_(1.0 - capped.square())
            if scale != 1.0:
                g.mul_(scale)
            g = g.to(weight.dtype)
            if want_h:
                grad_h[start:start + chunk] = g @ weight
            if want_w:
                grad_w.addmm_(g.T, h.to(weight.dtype))
            if want_b:
                grad_b.add_(g.sum(0))
            divergence[start:start + chunk], entropy[start:start + chunk] = d, e
            del g
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.mark_non_differentiable(divergence, entropy)
        return divergence.sum(), divergence, entropy

    @staticmethod
    def backward(ctx, grad_total, grad_divergence, grad_entropy):
        grads = [None if g is None else g.mul_(grad_total.to(g.dtype)) for g in ctx.saved_tensors]  # used once
        return (*grads, None, None, None, None, None, None, None)


def linear_head_divergence(student_hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           teacher_hidden: torch.Tensor, teacher_logits_fn, beta: float, temperature: float = 1.0,
                           scale: float = 1.0, softcap: float | None = None,
                           chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ divergence, (N,) divergence, (N,) student entropy) with the student's logits softcap(scale (h Wᵀ + b)).

    The sum carries the gradient to `student_hidden`, `weight` and `bias` (`_LinearHeadDivergence`): one (V, H)
    gradient buffer and a few (chunk, V) tensors at a time, never (N, V) ones; the per-token values carry none.

    Args:
        student_hidden: (N, H). weight: (V, H). bias: (V,) or None. teacher_hidden: (N, H_t).
        teacher_logits_fn: (c, H_t) -> (c, V) the teacher's final logits (not divided by the temperature).
        beta, temperature: see `token_divergence`. scale, softcap: the student model's logit transform
            (`hf_rlhf.models.lm_head.LMHead`). chunk_size: tokens per chunk.
    """
    if not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _LinearHeadDivergence.apply(student_hidden, weight, bias, teacher_hidden, teacher_logits_fn, float(scale),
                                       softcap, float(beta), float(temperature), int(chunk_size))
