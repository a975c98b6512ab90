"""Tensor helpers shared by every trainer: masked statistics and log-probabilities from logits.

The one home for these helpers (torch only; no transformers, peft or bitsandbytes). A `mask` is
any tensor broadcastable to `x` whose nonzero entries mark the positions to use; positions outside
it never reach a result, so NaN or inf there (padding logits, say) cannot leak in.
"""

from __future__ import annotations

import math

import torch


def _keep(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with masked-out positions set to 0, boolean mask expanded to x's shape)."""
    keep = mask.bool().expand_as(x)
    # torch.where rather than x * mask: 0 * nan = nan would leak padding garbage into the sums
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)), keep


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of `x` over the positions where `mask` is nonzero.

    Args:
        x: (B, T), or any shape.
        mask: broadcastable to `x`; nonzero = keep.
        dim: dimension(s) to reduce; None reduces all of them.

    Returns:
        0-dim tensor if `dim` is None, else `x` with `dim` reduced.
    """
    kept, _ = _keep(x, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is nonzero (as `trl.core.masked_mean`).

    An empty mask (or an empty row, with `dim`) gives NaN, like the mean of an empty tensor, so the
    mistake shows in the logs instead of passing as 0.

    Args:
        x: (B, T), or any shape.
        mask: broadcastable to `x`; nonzero = keep.
        dim: dimension(s) to reduce; None reduces all of them.

    Returns:
        0-dim tensor if `dim` is None, else `x` with `dim` reduced.
    """
    kept, keep = _keep(x, mask)
    if dim is None:
        return kept.sum() / keep.sum()
    return kept.sum(dim) / keep.sum(dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all the positions where `mask` is nonzero (as `trl.core.masked_var`).

    Args:
        x: (B, T), or any shape.
        mask: broadcastable to `x`; nonzero = keep.
        unbiased: apply Bessel's correction n / (n - 1).

    Returns:
        0-dim tensor.

    Raises:
        ValueError: the mask keeps no element, or one element with `unbiased=True`.
    """
    n = int(mask.bool().expand_as(x).sum())  # one host sync; called once per rollout batch
    if n < (2 if unbiased else 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} masked element(s), the mask keeps {n}")
    centered = x - masked_mean(x, mask)
    var = masked_mean(centered * centered, mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  all_reduce_sum=None) -> torch.Tensor:
    """Normalise `x` to mean 0 and variance 1 over the masked positions (as `trl.core.masked_whiten`).

    Statistics use the masked positions only (unbiased variance); positions outside the mask are
    set to 0 in the result, so padding never carries a value into a loss.

    Args:
        x: (B, T), or any shape.
        mask: broadcastable to `x`; nonzero = keep.
        shift_mean: if False, the mean is added back (scale only), as TRL does for rewards.
        eps: added to the variance before the square root.
        all_reduce_sum: `tensor -> tensor`, the sum over processes (e.g. `lambda t: accelerator.reduce(t, "sum")`):
            the mean and variance are then those of every process's masked positions together, so W processes
            whiten exactly as one process holding the whole batch would. None: this process's positions only.

    Returns:
        Tensor of the shape of `x`.
    """
    if all_reduce_sum is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:  # the same two passes as masked_mean / masked_var, with the sums taken over all processes
        kept, keep = _keep(x, mask)
        count, total = all_reduce_sum(torch.stack([keep.sum().to(x.dtype), kept.sum()])).unbind()
        if count < 2:
            raise ValueError(f"masked_whiten needs at least 2 masked elements over all processes, found {int(count)}")
        mean = total / count
        var = all_reduce_sum(masked_sum((x - mean).square(), mask)) / (count - 1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _keep(whitened, mask)[0]


# The most float32 logits (rows x T x V) one reduction below takes at once: 64 MiB. A real vocabulary (32k-256k
# entries) exceeds it with a single row of a few hundred tokens, so those go one row at a time (the peak extra
# memory of `trl.trainer.utils.selective_log_softmax`); a small vocabulary or short rows go in a few calls instead
# of one call per row, whose per-row overhead made 64 toy rows of 24 tokens x 100 entries 6x slower (11.1 against
# 1.8 ms forward and backward, 2 CPU threads). Each row reduces over its own V entries either way: the same values.
LOGITS_CHUNK_ELEMENTS = 1 << 24


def logit_rows_per_chunk(logits: torch.Tensor) -> int:
    """How many rows of `logits` one reduction takes at once: as many as `LOGITS_CHUNK_ELEMENTS` holds, at least one.

    Args:
        logits: (B, ...), B >= 0.
    """
    return max(1, LOGITS_CHUNK_ELEMENTS // max(1, math.prod(logits.shape[1:])))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of the logits: log_softmax(logits).gather(labels).

    Computed as logit[label] - logsumexp(logits) in float32, over chunks of rows (`logit_rows_per_chunk`), so the
    peak extra memory is one chunk (at most 64 MiB, or one (T, V) row) instead of a (B, T, V) log_softmax (the trick
    of `trl.trainer.utils.selective_log_softmax`).

    Args:
        logits: (B, T, V); any float dtype.
        labels: (B, T) token ids in [0, V); mask padding yourself (a -100 would fail to gather).

    Returns:
        (B, T) in float32 (float64 if the logits are float64).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logit_rows_per_chunk(logits)
    out = []
    for chunk, chunk_labels in zip(logits.split(rows), labels.split(rows)):
        chunk = chunk.to(dtype)
        out.append(chunk.gather(-1, chunk_labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
    return _joined(out)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of the logits at each position: logsumexp(z) - Σ softmax(z)·z.

    Over chunks of rows in float32, as `logprobs_from_logits`.

    Args:
        logits: (B, T, V).

    Returns:
        (B, T) in float32 (float64 if the logits are float64), in nats.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = []
    for chunk in logits.split(logit_rows_per_chunk(logits)):
        chunk = chunk.to(dtype)
        out.append(torch.logsumexp(chunk, dim=-1) - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
    return _joined(out)


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True of each row, or the row length T if there is none (as TRL's helper).

    Used to truncate responses after the first stop token.

    Args:
        bools: (B, T) boolean.

    Returns:
        (B,) long.
    """
    length = bools.size(-1)
    positions = torch.arange(length, device=bools.device)
    # False positions become T, True positions keep their index; the min is the first True (or T)
    return torch.where(bools.bool(), positions, length).min(dim=-1).values


def last_true_indices(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last nonzero entry of each row: the last real token of a left- or right-padded row.

    Args:
        mask: (B, T) 0/1 or boolean.

    Returns:
        (B,) long; 0 for a row with no nonzero entry (callers that cannot accept one check first).

    >>> last_true_indices(torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]]))
    tensor([2, 4])
    """
    positions = torch.arange(mask.size(-1), device=mask.device)
    return torch.where(mask.bool(), positions, 0).max(dim=-1).values


def last_token_index_packed(lengths) -> torch.Tensor:
    """Position of each sequence's last token in a row of sequences laid end to end.

    Args:
        lengths: the S sequence lengths, each >= 1 (a list or a (S,) tensor).

    Returns:
        (S,) long.

    >>> last_token_index_packed([3, 2, 1])
    tensor([2, 4, 5])
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if (lengths < 1).any():
        raise ValueError(f"sequence lengths must be >= 1, got {lengths.tolist()}")
    return lengths.cumsum(0) - 1


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a (B, T) 0/1 attention mask is its real tokens then only padding.

    >>> is_right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]])), is_right_padded(torch.tensor([[0, 1, 1]]))
    (True, False)
    """
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return bool(torch.equal(attention_mask.bool(), positions < attention_mask.sum(1, keepdim=True)))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as the additive one eager attention adds to its scores.

    >>> additive_mask(torch.tensor([True, False]))
    tensor([ 0.0000e+00, -3.4028e+38])
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def prompt_groups(query_ids: torch.LongTensor, query_mask: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Which rows share a prompt (ids and mask equal).

    Returns:
        (group (B,): each row's group u, first (U,): each group's first row), groups ordered by `torch.unique`.

    >>> prompt_groups(torch.tensor([[6, 7], [0, 5], [6, 7]]), torch.tensor([[1, 1], [0, 1], [1, 1]]))
    (tensor([1, 0, 1]), tensor([1, 0]))
    """
    _, group = torch.unique(torch.cat([query_ids, query_mask.to(query_ids.dtype)], dim=1), dim=0,
                            return_inverse=True)
    batch = query_ids.shape[0]
    rows = torch.arange(batch, device=query_ids.device)
    first = torch.full((int(group.max()) + 1,), batch, dtype=torch.long, device=query_ids.device).scatter_reduce(
        0, group, rows, reduce="amin")
    return group, first


def left_padding(mask: torch.Tensor) -> int:
    """The number of leading columns of a left-padded (B, T) 0/1 mask that are padding in every row (0 for a mask
    with no 1).

    >>> left_padding(torch.tensor([[0, 0, 1], [0, 1, 1]]))
    1
    """
    return int(mask.any(0).long().argmax()) if mask.any() else 0


def padding_bounds(query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """(q_start, r_end): the left-padded prompt columns before `q_start` and the right-padded response columns from
    `r_end` on are padding in every row, so `[:, q_start:]` and `[:, :r_end]` keep every real token.

    Args:
        query_mask: (B, Q) 0/1, left-padded. response_mask: (B, R) 0/1, right-padded.

    Returns:
        q_start in [0, Q] (0 when no row has a prompt token), r_end in [1, R] (1 when no row has a response token,
        so that a response column remains).

    >>> padding_bounds(torch.tensor([[0, 0, 1], [0, 1, 1]]), torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]]))
    (1, 2)
    """
    q_start = left_padding(query_mask)
    r_end = int(response_mask.any(0).nonzero().max()) + 1 if response_mask.any() else 1
    return q_start, r_end


def length_sorted_chunks(lengths: torch.Tensor, size: int) -> list[torch.LongTensor]:
    """Row indices in chunks of at most `size` rows, the rows in ascending `lengths` (equal lengths in row order),
    so that the rows of a chunk are of similar length and its padded width is near its rows' own.

    Args:
        lengths: (B,) integer lengths. size: rows per chunk (>= 1).

    Returns:
        ceil(B / size) (n,) long tensors; together every row once.

    >>> length_sorted_chunks(torch.tensor([5, 2, 9, 2, 7]), 2)
    [tensor([1, 3]), tensor([0, 4]), tensor([2])]
    """
    return list(torch.sort(lengths, stable=True).indices.split(size))


def rejoin_chunks(parts: list[torch.Tensor], chunks: list[torch.LongTensor], width: int,
                  value: float = 0.0) -> torch.Tensor:
    """The outputs of row chunks (`length_sorted_chunks`), each padded on the right to `width` along dimension 1
    with `value`, stacked, and put back in the rows' order.

    Args:
        parts: per chunk a (n_i, w_i, ...) tensor, w_i <= width, its rows those of `chunks[i]` in that order.
        chunks: the chunks' row indices, together every row 0..B-1 once.

    Returns:
        (B, width, ...): row b is the output of row b.

    >>> rejoin_chunks([torch.tensor([[7]]), torch.tensor([[5, 6]])], [torch.tensor([1]), torch.tensor([0])], 2)
    tensor([[5, 6],
            [7, 0]])
    """
    tail = (0, 0) * (parts[0].dim() - 2)  # F.pad pads the last dimension first: leave those after dimension 1
    padded = [torch.nn.functional.pad(part, tail + (0, width - part.shape[1]), value=value) for part in parts]
    return torch.cat(padded)[torch.argsort(torch.cat(chunks))]
