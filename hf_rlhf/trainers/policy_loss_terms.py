"""`PolicyLossTerms`: what `PPOTrainer.compute_loss` asks of the trainer beyond the pure loss math: TRL's public
helpers `get_high_entropy_mask` (it gathers over processes) and `get_off_policy_mask`, the adaptive entropy
coefficient (state across micro-batches), the MoE router's load-balancing loss; and the sampler correction's check.
"""

from __future__ import annotations

import torch

from ..generation import build_engine
from ..losses.grpo import adaptive_entropy_coef, entropy_threshold, high_entropy_mask, off_policy_mask
from ..tensors import masked_sum
from ..training.state_callbacks import AdaptiveEntropyCallback, find_callback


class PolicyLossTerms:
    """Mixed into `PPOTrainer` (so into `GRPOTrainer`); reads `self.args`, `self.accelerator`, `self.metrics`."""

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's `GRPOTrainer.get_high_entropy_mask`: True on the tokens whose entropy is at least the `threshold`
        quantile of every process's masked token entropies.

        Args:
            entropies: (B, T) per-token entropy.
            mask: (B, T) 1 on valid tokens.
            threshold: quantile in [0, 1].

        Returns:
            (B, T) bool.
        """
        local = entropies[mask.bool()].float()
        pad = -1e9  # entropies are >= 0: the sentinel cannot collide with one
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad))
        return high_entropy_mask(entropies, mask, entropy_threshold(gathered[gathered != pad], threshold))

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's `GRPOTrainer.get_off_policy_mask` (DeepSeek-V3.2): (B, 1), 1 to keep a sequence whose advantage
        is >= 0 or whose mean KL(sampler ‖ policy) is <= the threshold. `advantages` (B, 1) or (B,)."""
        keep = off_policy_mask(advantages.reshape(-1), per_token_logps, sampling_per_token_logps, mask,
                               off_policy_threshold)
        return keep.unsqueeze(1)

    def _entropy_coef(self, token_entropy, mask) -> float:
        """The entropy bonus's coefficient for this micro-batch: `entropy_coef`, or with `use_adaptive_entropy`
        TRL's controller (applied while the last step's entropy is at or below `entropy_target`; updated at each
        optimizer step from that step's token-mean entropy over every process)."""
        args = self.args
        if not args.use_adaptive_entropy:
            if args.entropy_coef and self.accelerator.sync_gradients:  # TRL logs the static one too
                self.metrics["train"].add("entropy_coef", args.entropy_coef)
            return args.entropy_coef
        state = find_callback(self.callback_handler, AdaptiveEntropyCallback)  # restored from a checkpoint too
        coef = state.coef if state.last <= args.entropy_target else 0.0
        window = torch.stack([masked_sum(token_entropy.detach(), mask), mask.sum().float()])
        state.window = window if state.window is None else state.window + window
        if self.accelerator.sync_gradients:  # the optimizer step's last micro-batch
            total = self.accelerator.reduce(state.window, reduction="sum")
            state.last = (total[0] / total[1].clamp(min=1.0)).item()
            state.coef = adaptive_entropy_coef(state.coef, state.last, args.entropy_target, args.entropy_coef_delta,
                                               args.entropy_coef_min, args.entropy_coef_max)
            state.window = None
            self.metrics["train"].add("entropy_coef", state.coef)
        return coef

    @property
    def entropy_coef(self) -> float:
        """TRL's attribute: the entropy bonus's current coefficient (the adaptive controller's, or `entropy_coef`)."""
        state = find_callback(self.callback_handler, AdaptiveEntropyCallback)
        return self.args.entropy_coef if state is None else state.coef

    @property
    def use_adaptive_entropy(self) -> bool:
        return self.args.use_adaptive_entropy

    def _aux_loss(self):
        """The MoE router's load-balancing loss of this micro-batch's forward, weighted (GRPOTrainer's
        `router_aux_loss_coef`), scaled for gradient accumulation; 0 without it."""
        return 0.0


def check_sampling_correction(args, multi_turn: bool) -> None:
    """The sampler correction needs the sampling log-probs of every row: a one-turn rollout from an engine that
    returns them."""
    reasons = []
    if not build_engine(args.generation_backend).supports_capture:
        reasons.append(f"generation_backend={args.generation_backend!r} returns no log-probs (use 'generate' or "
                       "'lean')")
    if multi_turn:
        reasons.append("a multi-turn rollout (tools, environment_factory or rollout_func) has no sampling "
                       "log-probs for the environment's turns")
    if args.filter_groups:
        reasons.append("filter_groups joins rows of several generation rounds")
    if (args.generation_kwargs or {}).get("num_beams", 1) > 1:
        reasons.append("beam search (generation_kwargs num_beams > 1) keeps the best beams, not samples of the "
                       "policy: there are no sampling log-probs to correct with")
    if reasons:
        raise ValueError(f"vllm_importance_sampling_correction=True cannot be honoured: {'; '.join(reasons)}")
