"""`Experience`: what one rollout hands to the PPO loss, as tensors with one row per prompt."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..tensors import padding_bounds


@dataclass
class Experience:
    """One rollout's batch (B rows; Q prompt columns, left-padded; R response columns, right-padded).

    Every (B, R) field is aligned with `response_ids`: column t describes response token t. Values outside
    `response_mask` are meaningless (0 or padding) and never reach a loss. In a multi-turn rollout with tools the
    response also holds tokens the policy did not generate (tool results, the template's turn markers): they are
    in `context_mask` (attended to) but not in `response_mask` (not trained on, not counted in any token mean).
    """

    query_ids: torch.LongTensor  # (B, Q) prompt tokens, left-padded with the pad id
    query_mask: torch.Tensor  # (B, Q) 1 on prompt tokens, 0 on the left padding
    response_ids: torch.LongTensor  # (B, R) sampled tokens up to and including the stop token, pad id after it
    response_mask: torch.Tensor  # (B, R) 1 on response tokens (the stop token included), 0 after it
    old_logprobs: torch.Tensor  # (B, R) log π_old(token) at rollout time (eval mode, temperature applied)
    ref_logprobs: torch.Tensor  # (B, R) log π_ref(token) under the reference (adapters off / frozen copy)
    old_values: torch.Tensor  # (B, R) V_old(state before the token), at rollout time; 0 for critic-free estimators
    scores: torch.Tensor  # (B,) sequence score after normalisation, clipping and the missing-eos penalty
    rewards: torch.Tensor  # (B, R) per-token reward: -β·KL on each token, plus the score on the last one
    advantages: torch.Tensor  # (B, R) the estimator's advantages (GAE: whitened when `whiten_advantages`)
    returns: torch.Tensor  # (B, R) GAE: value targets (unwhitened advantages + old values); see estimate_advantages
    context_mask: torch.Tensor | None = None  # (B, R) 1 on every response-side token in the context; None: = mask
    # with the sampler correction (`PPOConfig.vllm_importance_sampling_correction`), else None:
    sampling_logprobs: torch.Tensor | None = None  # (B, R) log π_sampler(token): the engine's, as it sampled
    sampling_ratio: torch.Tensor | None = None  # (B, R) π_old / π_sampler truncated or masked (a row's one value
    # repeated over its tokens in the sequence modes), the loss's per-token weight

    def __post_init__(self):
        if self.context_mask is None:  # one turn: the context is the response itself
            self.context_mask = self.response_mask.clone()

    def __len__(self) -> int:
        return self.query_ids.shape[0]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The fields as a dict, those that are None left out (a micro-batch for the Trainer: no key is named
        `labels`)."""
        return {name: getattr(self, name) for name in self.field_names() if getattr(self, name) is not None}

    @classmethod
    def from_dict(cls, data: dict) -> Experience:
        """Rebuild from `to_dict()` output (extra keys, e.g. rollout stats, are ignored)."""
        return cls(**{name: data[name] for name in cls.field_names() if name in data})

    def select(self, indices) -> Experience:
        """The rows `indices` (a list or LongTensor), in that order."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.query_ids.device)
        return Experience(**{name: value.index_select(0, index) for name, value in self.to_dict().items()})

    def to(self, device) -> Experience:
        return Experience(**{name: value.to(device) for name, value in self.to_dict().items()})

    def trimmed(self) -> Experience:
        """Drop prompt columns that are padding in every row (left) and response columns past every row's end.

        A micro-batch of a rollout is usually narrower than the rollout; the forward then costs less.
        """
        q_start, r_end = padding_bounds(self.query_mask, self.context_mask)
        out = {}
        for name, value in self.to_dict().items():
            if name.startswith("query_"):
                value = value[:, q_start:]
            elif value.dim() == 2:
                value = value[:, :r_end]
            out[name] = value
        return Experience(**out)
