"""The SFT DFT loss (dynamic fine-tuning): pure tensor functions (torch only)."""

from __future__ import annotations

import torch


def dft_token_losses(logprobs: torch.Tensor) -> torch.Tensor:
    """DFT's per-token loss, -log p(y_t) * sg(p(y_t)) (Wu et al. 2025), of any shape of label log-probs."""
    return -logprobs * logprobs.detach().exp()


def dft_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Dynamic Fine-Tuning loss: each token's negative log-likelihood weighted by its detached probability.

        loss = sum_t -log p(y_t) * sg(p(y_t)) / N

    Wu et al. 2025 (https://huggingface.co/papers/2508.05629), as `trl.SFTTrainer` with `loss_type="dft"`.

    Args:
        logits: (B, T', V) causal LM logits, T' >= T (prompt-learning virtual tokens come first and are skipped).
        labels: (B, T) unshifted labels, -100 where no loss is taken.
        num_items_in_batch: N, the trained tokens of the whole accumulated batch; None: those of this batch.

    Returns:
        0-dim loss.
    """
    logits = logits[:, -labels.shape[1]:][:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    logprobs = torch.gather(logits.log_softmax(-1), -1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = dft_token_losses(logprobs) * mask
    count = mask.sum() if num_items_in_batch is None else num_items_in_batch
    return per_token.sum() / torch.as_tensor(count, device=per_token.device).clamp(min=1)


def dft_compute_loss_func(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """`dft_loss` as a `transformers.Trainer` `compute_loss_func(outputs, labels, num_items_in_batch)`."""
    return dft_loss(outputs.logits, labels, num_items_in_batch)
