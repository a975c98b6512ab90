"""`DecodeCapture`: the sampled tokens' log-probabilities (and the hidden states the LM head read) taken off an
in-process engine's decoding forwards, so that a rollout needs no policy forward of its own to get them.

TRL 1.12's PPOTrainer reads its old log-probs off the logits `generate` returns; `output_logits` would hold every
step's (B, V) logits to the end of the call (a 150k vocabulary x 128 rows x 512 steps is 39 GB), so this keeps one
step's at a time instead: a forward hook on the causal LM holds the last position's logits until the next decoding
forward, whose input token is the one sampled from them, and gathers its log-probability then (the last step's
token comes from the returned ids). A forward pre-hook on the LM head keeps what it read at the last position
(after the final norm: what a value head on the policy reads).

The decode computes one position at a time against a KV cache, the trainer's forward the whole sequence at once:
the same math, other kernel shapes, so the two agree to float rounding, not bit for bit (the trainer checks this
on its first rollout, `hf_rlhf.rollout.rollout_maker`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..models.adapters import unwrap_peft


class DecodeCapture:
    """Collects, per decoding step, log p(sampled token) at `temperature` and (with `hidden`) the LM head's input.

    Args:
        temperature: the sampling temperature (log-probs of softmax(logits / temperature), as the trainer's forward).
        hidden: also keep the LM head's input at each step's last position.

    Use: `with capture.recording(model): ...decode...`, then `capture.result(response_ids)`. Only the forwards inside
    `recording` count, and the first of them must be the one that predicts the first new token (an engine that
    prefills part of the prompt beforehand keeps that forward outside).
    """

    def __init__(self, temperature: float = 1.0, hidden: bool = False):
        self.temperature, self.hidden = temperature, hidden
        self._logprobs: list[torch.Tensor] = []
        self._hidden: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None  # (B, V) float32 logits of the last forward, its token not yet seen

    @contextmanager
    def recording(self, model):
        base = unwrap_peft(model)  # the transformers model: the module whose forward `generate` calls
        handles = [base.register_forward_hook(self._on_forward, with_kwargs=True)]
        if self.hidden:
            handles.append(base.get_output_embeddings().register_forward_pre_hook(self._on_head))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _on_forward(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._pending is not None and ids is not None:
            self._take(ids[:, -1])
        self._pending = output.logits[:, -1].detach().float()

    def _on_head(self, module, args) -> None:
        self._hidden.append(args[0][:, -1].detach())

    def _take(self, tokens: torch.LongTensor) -> None:
        # one (B, V) step at once: logit[token] - logsumexp(logits), as `logprobs_from_logits` computes each row
        scaled = self._pending / self.temperature
        picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        self._logprobs.append(picked - torch.logsumexp(scaled, dim=-1))
        self._pending = None

    def result(self, response_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs (B, R) float32, hidden (B, R, H) or None) of the R = response_ids.shape[1] new tokens.

        A rank that decoded past its own last token (synced ZeRO-3 / FSDP ranks step together) has extra steps: only
        the first R count.
        """
        width = response_ids.shape[1]
        if len(self._logprobs) < width and self._pending is not None:
            self._take(response_ids[:, len(self._logprobs)])
        if len(self._logprobs) < width:
            raise RuntimeError(f"the engine ran {len(self._logprobs)} decoding forwards for {width} new tokens")
        logprobs = torch.stack(self._logprobs[:width], dim=1)
        hidden = torch.stack(self._hidden[:width], dim=1) if self.hidden else None
        return logprobs, hidden
