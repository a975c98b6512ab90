"""KTO losses: Kahneman-Tversky optimisation from unpaired desirable / undesirable completions, and the unpaired
APO-zero loss; pure torch.

KTO (Ethayarajh et al. 2024, https://huggingface.co/papers/2402.01306, Eq. 7) scores each completion's log-ratio
r = log π(y|x) − log π_ref(y|x) against a reference point z0, the KL of the policy from the reference, estimated
from mismatched (prompt, completion) pairs of the same batch (`kl_reference_point`):

    desirable:    1 − σ(β (r − z0))          undesirable:    1 − σ(β (z0 − r))

APO-zero unpaired (D'Oosterlinck et al. 2024, https://huggingface.co/papers/2408.06266, Eq. 7): no reference point,
desirable 1 − σ(β r), undesirable σ(β r). Each loss is weighted by `desirable_weight` / `undesirable_weight` and the
batch loss is their mean over every completion (trl 1.16 kto_trainer.py:1421-1460).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def uses_kl_reference_point(loss_type: str) -> bool:
    """Whether `loss_type` needs the KL reference point z0 (and so the mismatched completions): all but APO-zero."""
    return loss_type != "apo_zero_unpaired"


def kl_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor,
                       gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """KTO's reference point z0: the batch mean of the policy / reference log-ratio of mismatched completions, its
    mean over ranks, clamped at 0; no gradient flows through it (trl 1.16 kto_trainer.py:1416-1418).

    Args:
        kl_logps: (N,) summed log-probs of each prompt's mismatched completion under the policy.
        ref_kl_logps: (N,) the same under the reference.
        gather: `accelerator.gather` across ranks (a 1-element tensor in, (W,) out); None: one process.

    Returns:
        A 0-dim tensor z0 >= 0.

    >>> kl_reference_point(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]))
    tensor(0.)
    >>> kl_reference_point(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0]))
    tensor(0.5000)
    """
    local = (kl_logps - ref_kl_logps).mean().detach()
    ranks = gather(local.reshape(1)) if gather is not None else local.reshape(1)
    return ranks.mean().clamp(min=0)


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor | None,
             beta: float = 0.1, loss_type: str = "kto", desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KTO (or APO-zero unpaired) loss of a batch of labelled completions.

    Args:
        logps: (N,) summed completion log-probs under the policy.
        ref_logps: (N,) the same under the reference.
        labels: (N,) bool, True for a desirable completion.
        kl: 0-dim reference point z0 (`kl_reference_point`); None (or unused) for `apo_zero_unpaired`.
        beta: β, the deviation from the reference.
        loss_type: one of `KTO_LOSS_TYPES`.
        desirable_weight / undesirable_weight: weights of the desirable / undesirable losses.

    Returns:
        (loss: 0-dim mean of the weighted losses, losses: (N,) weighted, rewards: (N,) β·r, detached).
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    labels = labels.bool()
    logratios = logps - ref_logps
    if loss_type == "kto":
        if kl is None:
            raise ValueError("loss_type 'kto' needs the KL reference point kl")
        desirable = 1 - F.sigmoid(beta * (logratios - kl))
        undesirable = 1 - F.sigmoid(beta * (kl - logratios))
    else:
        desirable = 1 - F.sigmoid(beta * logratios)
        undesirable = F.sigmoid(beta * logratios)
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses.nanmean(), losses, beta * logratios.detach()
