"""Per-token KL estimates, the controllers of the KL coefficient β, and the rollout statistics built on them (torch
only)."""

from __future__ import annotations

import math

import torch

from ..tensors import masked_sum

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLAMP = 10.0  # OpenRLHF's and verl's bound on the estimate


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1",
               clamp: float | None = K3_CLAMP) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from tokens sampled from π.

    Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html).

    With log r = logp_ref - logp: k1 = -log r (unbiased, can be negative); k2 = ½(log r)² (biased,
    low variance); k3 = (r - 1) - log r (unbiased, always ≥ 0). TRL's `kl_estimator` offers k1
    and k3; verl calls the three "kl", "mse" and "low_var_kl".

    k3 grows as r = e^{log r}: one token the reference finds e^15 times likelier gives 3.3e6, a penalty that
    swamps every score of the batch. Its estimate is therefore clamped to [-clamp, clamp] (k3 ≥ 0, so to at most
    `clamp`), as OpenRLHF's `compute_approx_kl` and verl's "low_var_kl" do with 10. k1 and k2 grow at most
    quadratically in log r and are not clamped (as TRL).

    Args:
        logprobs: (B, T) log-probabilities of the sampled tokens under the policy π.
        ref_logprobs: (B, T) the same under the reference π_ref.
        estimator: one of `KL_ESTIMATORS`.
        clamp: bound of the k3 estimate (> 0); None: unclamped.

    Returns:
        (B, T); mask out padding yourself.
    """
    log_ratio = logprobs - ref_logprobs  # log π/π_ref = -log r
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        k3 = torch.expm1(-log_ratio) + log_ratio  # expm1: exact near r = 1, where k3 ≈ ½(log r)²
        return k3 if clamp is None else k3.clamp(-clamp, clamp)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid ones are {', '.join(KL_ESTIMATORS)}")


class _KLController:
    """The state both controllers share: the current coefficient β, saved in checkpoints."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ValueError(f"the KL coefficient must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController(_KLController):
    """A constant KL coefficient β, with the controller interface (as `trl` ≤ 0.11 and OpenRLHF)."""

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController(_KLController):
    """β steered towards a target KL (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

        e = clip(KL / target - 1, -0.2, 0.2);   β ← β · (1 + e · n_steps / horizon)

    as `AdaptiveKLController` in `trl` ≤ 0.11 and OpenRLHF. A non-finite KL leaves β unchanged, so
    one bad batch cannot turn β into NaN for the rest of the run.

    Args:
        init_kl_coef: β at the start, ≥ 0.
        target: the KL (summed over the response, per sequence) to steer towards, > 0.
        horizon: > 0; an update over n_steps samples moves β by at most 20 %·n_steps/horizon.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if not target > 0 or not horizon > 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        super().__init__(init_kl_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def sequence_policy_stats(kl: torch.Tensor, logprobs: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                          kl_coef: float) -> dict[str, torch.Tensor]:
    """Per-sequence values of the rollout statistics that need the policy's log-probs (TRL's PPO names).

    Args:
        kl: (B, T) per-token KL estimate (`kl_penalty`).
        logprobs: (B, T) the policy's log-probs of the response tokens.
        scores: (B,) shaped sequence scores.
        mask: (B, T) 1 on response tokens.
        kl_coef: β.

    Returns:
        {"objective/kl": Σ_t kl, "objective/entropy": -Σ_t log π (a one-sample entropy estimate),
        "objective/non_score_reward": -β Σ_t kl, "objective/rlhf_reward": score - β Σ_t kl}, each (B,) float64
        (rewards near the float32 limit overflow a float32 mean).
    """
    kl_per_sequence = masked_sum(kl, mask, dim=1)
    non_score = (-kl_coef * kl_per_sequence).double()
    return {"objective/kl": kl_per_sequence.double(), "objective/entropy": masked_sum(-logprobs, mask, dim=1).double(),
            "objective/non_score_reward": non_score, "objective/rlhf_reward": scores.double() + non_score}
