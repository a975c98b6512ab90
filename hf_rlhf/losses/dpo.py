"""Direct preference optimisation losses (the DPO family, SimPO, ORPO): pure tensor functions (torch only).

Everything here is a function of the four summed completion log-prob vectors, policy and reference, chosen and
rejected (B,), and where a loss needs them the completion lengths (B,). `hf_rlhf.trainers.dpo_trainer.DPOTrainer`
computes those vectors; `tests/unit/test_dpo_losses.py` checks every loss against TRL 1.16's own code on the same
tensors.

References: `trl/trainer/dpo_trainer.py` (1.16) `DPOTrainer._compute_loss`, lines 1342-1520 (f-divergence scores,
every `loss_type`, WPO weights); `trl/experimental/cpo/cpo_trainer.py:715` (SimPO); `trl/experimental/orpo/
orpo_trainer.py:670` (ORPO's odds ratio).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# the loss types trl 1.16's DPOTrainer takes, then the reference-free ones added here
TRL_DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                      "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
REFERENCE_FREE_LOSS_TYPES = ("simpo", "orpo")
DPO_LOSS_TYPES = TRL_DPO_LOSS_TYPES + REFERENCE_FREE_LOSS_TYPES
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# losses whose f-divergence generalisation TRL documents as valid (dpo_config.py, f_divergence_type's help)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def needs_reference(loss_types) -> bool:
    """Whether any of `loss_types` reads the reference log-probs (SimPO, ORPO and plain `sft` do not)."""
    return any(t not in REFERENCE_FREE_LOSS_TYPES + ("sft",) for t in loss_types)


def f_divergence_scores(logratios: torch.Tensor, f_divergence_type: str = "reverse_kl",
                        alpha: float = 0.5) -> torch.Tensor:
    """f'(π/π_ref) of each sequence: the score DPO compares under an f-divergence (Wang et al. 2023,
    https://huggingface.co/papers/2309.16240); `reverse_kl` is plain DPO (the log-ratio itself).

    Args:
        logratios: (B,) log π(y|x) - log π_ref(y|x).
        f_divergence_type: one of `F_DIVERGENCES`.
        alpha: the α of `alpha_divergence`.

    Returns:
        (B,) scores. TRL 1.16 dpo_trainer.py:1342-1370.
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        t = (alpha - 1.0) * logratios
        clamp_max = {torch.float16: 11.0, torch.bfloat16: 80.0}.get(t.dtype, 80.0)
        return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) / (alpha - 1.0)
    raise ValueError(f"f_divergence_type={f_divergence_type!r}; expected one of {list(F_DIVERGENCES)}")


def dpo_loss(loss_type: str, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None, *, beta: float = 0.1,
             label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None, discopop_tau: float = 0.05,
             f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
             simpo_gamma: float = 0.5) -> torch.Tensor:
    """Per-pair loss of one preference-optimisation `loss_type`.

    Args:
        loss_type: one of `DPO_LOSS_TYPES`.
        chosen_logps / rejected_logps: (B,) summed completion log-probs under the policy.
        ref_chosen_logps / ref_rejected_logps: (B,) the same under the reference (None for `simpo`, `orpo`, `sft`).
        beta: DPO's β (IPO's τ, ORPO's λ, SimPO's β).
        label_smoothing: the label noise ε of `robust`, `exo_pair`, `aot*` (cDPO) and `simpo`.
        chosen_lengths / rejected_lengths: (B,) completion token counts: `ipo`, `sigmoid_norm`, `sft`, `simpo`,
            `orpo` (which average the log-probs per token).
        discopop_tau: DiscoPOP's τ.
        f_divergence_type / f_alpha_divergence_coef: the f-divergence of the log-ratio scores.
        simpo_gamma: SimPO's target margin γ.

    Returns:
        (B,) per-pair loss; the batch loss is its mean. `sft`, as TRL computes it, is the mean NLL over every chosen
        token of the batch, repeated B times; `orpo` is that NLL minus λ·log σ(log odds ratio) per pair.
    """
    if loss_type == "simpo":  # SimPO (Meng et al. 2024), TRL's CPOTrainer with loss_type="simpo", cpo_trainer.py:715
        logits = chosen_logps / chosen_lengths.clamp(min=1) - rejected_logps / rejected_lengths.clamp(min=1)
        logits = logits - simpo_gamma / beta
        return (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                - F.logsigmoid(-beta * logits) * label_smoothing)
    if loss_type == "orpo":  # ORPO (Hong et al. 2024), orpo_trainer.py:670 odds_ratio_loss plus its NLL term
        return orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta)
    if loss_type == "sft":  # dpo_trainer.py:1495: mean NLL over the batch's chosen tokens
        nll = -chosen_logps.sum() / chosen_lengths.sum().clamp(min=1)
        return nll.expand(chosen_logps.shape[0])

    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    delta = chosen_scores - rejected_scores
    if loss_type == "sigmoid":  # Rafailov et al. 2023, Eq. 7
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":  # SLiC (Zhao et al. 2023)
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":  # Azar et al. 2023, Eq. 17, per-token averaged scores as TRL
        ipo_delta = chosen_scores / chosen_lengths.clamp(min=1) - rejected_scores / rejected_lengths.clamp(min=1)
        return (ipo_delta - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":  # Ji et al. 2024, Eq. 16
        eps = torch.tensor(label_smoothing, device=delta.device)
        qw, log_qw = torch.sigmoid(beta * delta), F.logsigmoid(beta * delta)
        ql, log_ql = torch.sigmoid(-beta * delta), F.logsigmoid(-beta * delta)
        return qw * (log_qw - torch.log1p(-eps)) + ql * (log_ql - torch.log(eps))
    if loss_type == "nca_pair":  # Chen et al. 2024
        c, r = beta * chosen_logratios, beta * rejected_logratios
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if loss_type == "robust":  # Chowdhury et al. 2024
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "bco_pair":  # Jung et al. 2024
        return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
    if loss_type == "sppo_hard":  # Wu et al. 2024, Eq. 4.7 with hard probabilities
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):  # Melnyk et al. 2024: the batch's sorted ratios matched
        if loss_type == "aot":
            a, _ = torch.sort(chosen_logps - rejected_logps, dim=0)
            b, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
        else:
            a, _ = torch.sort(chosen_logratios, dim=0)
            b, _ = torch.sort(rejected_logratios, dim=0)
        d = a - b
        return -F.logsigmoid(beta * d) * (1 - label_smoothing) - F.logsigmoid(-beta * d) * label_smoothing
    if loss_type == "apo_zero":  # D'Oosterlinck et al. 2024, Eq. 7
        return 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":  # Eq. 8
        return (torch.sigmoid(beta * chosen_logratios) + 1
                - torch.sigmoid(beta * (chosen_logratios - rejected_logratios)))
    if loss_type == "discopop":  # Chan et al. 2024, Eq. 5
        logits = beta * delta
        modulation = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    if loss_type == "sigmoid_norm":
        d = chosen_scores / chosen_lengths.clamp(min=1) - rejected_scores / rejected_lengths.clamp(min=1)
        return -F.logsigmoid(beta * d)
    raise ValueError(f"loss_type={loss_type!r}; expected one of {list(DPO_LOSS_TYPES)}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, numerically stable (Mächler 2012), as `trl.trainer.utils.log1mexp`."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
              rejected_lengths: torch.Tensor, beta: float) -> torch.Tensor:
    """ORPO (Hong et al. 2024, https://huggingface.co/papers/2403.07691, Eqs. 4 and 7): per pair,
    NLL(chosen) - λ·log σ(log odds(chosen) - log odds(rejected)), with per-token averaged log-probs.

    Args:
        chosen_logps / rejected_logps: (B,) summed completion log-probs (policy; no reference).
        chosen_lengths / rejected_lengths: (B,) completion token counts.
        beta: λ.

    Returns:
        (B,) per pair; the NLL term is the batch's mean over chosen tokens (as `trl.experimental.orpo`'s
        cross-entropy), repeated per pair.
    """
    chosen_avg = chosen_logps.float() / chosen_lengths.clamp(min=1)
    rejected_avg = rejected_logps.float() / rejected_lengths.clamp(min=1)
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    nll = -chosen_logps.float().sum() / chosen_lengths.sum().clamp(min=1)
    return nll - beta * F.logsigmoid(log_odds)


def combined_loss(loss_types, loss_weights, *args, pair_weights: torch.Tensor | None = None,
                  **kwargs) -> torch.Tensor:
    """Σ_k w_k · mean(pair_weights · dpo_loss(loss_types[k], ...)): TRL's `loss_type` list with `loss_weights`
    (None: all 1), dpo_trainer.py:1385-1530.

    Args and kwargs: as `dpo_loss`, the same for every loss type. pair_weights: (B,) WPO weights or None.
    Returns a 0-dim tensor.
    """
    weights = loss_weights if loss_weights is not None else [1.0] * len(loss_types)
    if len(weights) != len(loss_types):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(loss_types)} loss types")
    total = 0.0
    for loss_type, weight in zip(loss_types, weights):
        per_pair = dpo_loss(loss_type, *args, **kwargs)
        if pair_weights is not None:
            per_pair = per_pair * pair_weights
        total = total + per_pair.mean() * weight
    return total


def completion_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                     ld_alpha: float | None = None) -> dict[str, torch.Tensor]:
    """Summed completion log-probs of each sequence of a padded batch, and the per-token statistics TRL logs.

    Args:
        logits: (N, T, V) causal LM logits of `input_ids` (the logit at t predicts token t + 1).
        input_ids: (N, T).
        completion_mask: (N, T) 1 on completion tokens (the tokens scored), 0 on prompt and padding.
        ld_alpha: LD-DPO (Liu et al. 2024, https://huggingface.co/papers/2409.06411): with chosen rows first then
            rejected ones, tokens past the shorter completion of a pair weigh `ld_alpha`; None: plain sums.

    Returns:
        See `token_statistics`, with L = T - 1. TRL 1.16 dpo_trainer.py:1300-1320 (the fused LM head's
        `log_probs`, `entropy`, `mean_logits`, `is_top1`).
    """
    return token_statistics(logits[:, :-1], input_ids[:, 1:], completion_mask[:, 1:], ld_alpha)


def gathered_completion_logps(logits: torch.Tensor, row_index: torch.Tensor, logit_index: torch.Tensor,
                              target_ids: torch.Tensor, gather_mask: torch.Tensor,
                              ld_alpha: float | None = None) -> dict[str, torch.Tensor]:
    """`completion_logps` of sequences laid out several to a row (prefix sharing,
    `collators.dpo.PrefixSharedPreferenceCollator`): sequence i's completion token j is predicted by
    `logits[row_index[i], logit_index[i, j]]`.

    Args:
        logits: (R, T, V). row_index: (N,). logit_index, target_ids, gather_mask: (N, L).

    Returns:
        See `token_statistics`.
    """
    selected = logits[row_index.unsqueeze(1), logit_index]  # (N, L, V)
    return token_statistics(selected, target_ids, gather_mask, ld_alpha)


def padded_gather_index(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The padded layout's completion tokens in the gathered form of `gathered_completion_logps`: the logit at t
    predicts token t + 1, so sequence i's completion token j is predicted at `logit_index[i, j]` of its own row.

    Args:
        input_ids: (N, T). completion_mask: (N, T) 1 on the completion tokens to score.

    Returns:
        {"row_index": (N,) arange, "logit_index": (N, L) positions in [0, T - 1) in order (0 past a sequence's last
        completion token), "target_ids": (N, L), "gather_mask": (N, L)}; L = the longest completion (at least 1).

    >>> g = padded_gather_index(torch.tensor([[5, 6, 7, 0], [5, 8, 0, 0]]), torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]))
    >>> g["logit_index"], g["target_ids"], g["gather_mask"]  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[0, 1], [0, 0]]), tensor([[6, 7], [8, 0]]), tensor([[1, 1], [1, 0]]))
    """
    scored = completion_mask[:, 1:].bool()
    length = max(int(scored.sum(1).max()) if scored.numel() else 0, 1)
    # a stable sort puts each row's scored positions first, in their order
    order = torch.sort((~scored).to(torch.uint8), dim=1, stable=True).indices[:, :length]
    gather_mask = scored.gather(1, order)
    return {"row_index": torch.arange(input_ids.shape[0], device=input_ids.device),
            "logit_index": order * gather_mask, "target_ids": input_ids[:, 1:].gather(1, order) * gather_mask,
            "gather_mask": gather_mask.long()}


def logits_to_keep_per_row(row_index: torch.Tensor, logit_index: torch.Tensor,
                           num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions whose logits a forward must compute (transformers' `logits_to_keep` as a 2D integer tensor:
    each row's positions, the same count per row), and where each gathered logit lands in its output.

    Args:
        row_index: (N,) the row of each sequence. logit_index: (N, L) the positions predicting its tokens.
        num_rows: R, the forward's batch size.

    Returns:
        keep: (R, K) positions, K = L × the most sequences on one row (unused slots: position 0).
        column: (N, L): with `logits` = the forward's (R, K, V) output, sequence i's token j is predicted by
            `logits[row_index[i], column[i, j]]` (= the full forward's `logits[row_index[i], logit_index[i, j]]`).

    >>> keep, column = logits_to_keep_per_row(torch.tensor([0, 1, 0]), torch.tensor([[3, 4], [1, 2], [5, 0]]), 2)
    >>> keep, column  # doctest: +NORMALIZE_WHITESPACE
    (tensor([[3, 4, 5, 0], [1, 2, 0, 0]]), tensor([[0, 1], [0, 1], [2, 3]]))
    """
    length = logit_index.shape[1]
    on_row = torch.nn.functional.one_hot(row_index, num_rows)  # (N, R)
    slot = (on_row.cumsum(0) - 1).gather(1, row_index.unsqueeze(1))  # (N, 1): earlier sequences on the same row
    column = slot * length + torch.arange(length, device=logit_index.device)
    keep = logit_index.new_zeros(num_rows, int(on_row.sum(0).max()) * length)
    keep[row_index.unsqueeze(1), column] = logit_index
    return keep, column


def token_statistics(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                     ld_alpha: float | None = None) -> dict[str, torch.Tensor]:
    """Per-sequence completion log-probs and per-token statistics from the logits that predict each token.

    Args:
        logits: (N, L, V), the logit predicting `target[:, l]` at l.
        target: (N, L) token ids.
        mask: (N, L) 1 where the token is a completion token to score.
        ld_alpha: see `completion_logps`.

    Returns:
        {"logps": (N,), "token_logps": (N, L) masked, "mask": (N, L) float, "lengths": (N,), "entropy": (N, L),
         "mean_logits": (N, L), "is_top1": (N, L) bool, "log_sum_sq_probs": (N, L)}.
    """
    logits = logits if logits.dtype == torch.float64 else logits.float()  # log-softmax in fp32 at least
    mask = mask.to(logits.dtype)
    logprobs_all = logits.log_softmax(-1)
    token_logps = torch.gather(logprobs_all, -1, target.unsqueeze(-1)).squeeze(-1) * mask
    logps = _sequence_logps(token_logps, mask, ld_alpha)
    with torch.no_grad():
        probs = logprobs_all.exp()
        entropy = -(probs * logprobs_all).sum(-1)
        log_sum_sq = torch.logsumexp(2 * logprobs_all, dim=-1)
    return {"logps": logps, "token_logps": token_logps, "mask": mask, "lengths": mask.sum(1),
            "entropy": entropy, "mean_logits": logits.detach().mean(-1),
            "is_top1": logits.detach().argmax(-1) == target, "log_sum_sq_probs": log_sum_sq}


def _sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """(N,) summed log-probs of masked (N, L) token log-probs; LD-DPO's weighting with `ld_alpha`."""
    if ld_alpha is None:
        return token_logps.sum(1)
    pos = mask.cumsum(1)
    shared = torch.minimum(*mask.sum(1).chunk(2)).repeat(2).unsqueeze(1)
    return (token_logps * ((pos > 0) & (pos <= shared))).sum(1) + ld_alpha * (token_logps * (pos > shared)).sum(1)


def scored_token_statistics(mask: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor, top1: torch.Tensor,
                            mean_logits: torch.Tensor, log_sum_sq: torch.Tensor,
                            ld_alpha: float | None = None) -> dict[str, torch.Tensor]:
    """`token_statistics` from per-token values already computed at the scored positions (the chunked LM head's,
    `hf_rlhf.models.lm_head`, which never forms the logits).

    Args:
        mask: (N, L) 1 where a token is scored. logprobs (differentiable), entropy, top1, mean_logits, log_sum_sq:
            (M,) each, M = mask.sum(), in the order of `mask`'s nonzero entries.
        ld_alpha: see `completion_logps`.

    Returns:
        As `token_statistics`; 0 (False) at the positions outside `mask`.
    """
    keep = mask.bool()

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(keep.shape, dtype=values.dtype, device=keep.device).masked_scatter(keep, values)

    token_logps = scatter(logprobs)
    mask = mask.to(token_logps.dtype)
    return {"logps": _sequence_logps(token_logps, mask, ld_alpha), "token_logps": token_logps, "mask": mask,
            "lengths": mask.sum(1), "entropy": scatter(entropy.detach()), "mean_logits": scatter(mean_logits),
            "is_top1": scatter(top1), "log_sum_sq_probs": scatter(log_sum_sq)}


def wpo_weights(token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WPO's per-sequence weight (Zhou et al. 2024, https://huggingface.co/papers/2406.11827, Eq. 2), as TRL 1.16
    dpo_trainer.py:1520: exp(mean over completion tokens of log p(y_t) - log Σ_v p(v)²), detached.

    Args:
        token_logps / log_sum_sq_probs / mask: (N, T-1). Returns (N,).
    """
    with torch.no_grad():
        aligned = (token_logps - log_sum_sq_probs) * mask
        return torch.exp(aligned.sum(1) / mask.sum(1).clamp(min=1))
