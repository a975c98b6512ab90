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


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence, student entropy) of each position from full logits, in float32 (float64 stays so).

    Args:
        student_logits: (..., V), differentiable. teacher_logits: (..., V).
        beta: see `divergence_per_element`. temperature: both logits are divided by it first.

    Returns:
        ((...,) divergence, (...,) entropy of p_s in nats, no gradient).
    """
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_ps = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_pt = F.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    divergence = divergence_per_element(log_ps, log_pt, beta).sum(-1)
    detached = log_ps.detach()
    entropy = -(detached.exp() * detached).sum(-1)
    return divergence, entropy


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
