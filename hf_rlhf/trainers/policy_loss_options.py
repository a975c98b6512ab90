"""`PolicyLossOptions`: trl 1.16 GRPOConfig's policy-loss options, on every PPOConfig (every estimator's loss).

The math is `hf_rlhf.losses.grpo`; `PPOTrainer.compute_loss` applies it. The names, defaults and meanings are
TRL's, with one deliberate difference: `vllm_importance_sampling_correction` defaults to None, "off", where TRL's
default True acts only with `use_vllm=True` (its vLLM sampler); here no sampler is separate from the trainer unless
asked, so None keeps TRL's behaviour for a run without vLLM and True turns the correction on with any engine that
returns the sampling log-probs (`generate`, `lean`, or a `rollout_func` returning `logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..losses.grpo import SAMPLING_CORRECTION_MODES


@dataclass
class PolicyLossOptions:
    """Options of the policy loss of trl 1.16's GRPOConfig (see `hf_rlhf.losses.grpo` for the formulas)."""

    delta: float | None = field(default=None, metadata={
        "help": "Two-sided clipping (INTELLECT-2): the unclipped ratio capped at delta (TRL advises > 1 + "
                "epsilon_high). None: off."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "loss_type='sapo': τ for A > 0."})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "loss_type='sapo': τ for A <= 0."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "loss_type='vespo': k for A >= 0."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "loss_type='vespo': λ for A >= 0."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "loss_type='vespo': k for A < 0."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "loss_type='vespo': λ for A < 0."})
    off_policy_mask_threshold: float | None = field(default=None, metadata={
        "help": "DeepSeek-V3.2's off-policy sequence mask: drop negative-advantage sequences whose mean "
                "KL(sampler || policy) exceeds this. None: off."})
    top_entropy_quantile: float = field(default=1.0, metadata={
        "help": "Train on the top q of tokens by entropy (over every process's tokens); 1.0: all tokens."})
    use_adaptive_entropy: bool = field(default=False, metadata={
        "help": "Adapt entropy_coef each optimizer step toward entropy_target (applied when the entropy is at or "
                "below it)."})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "use_adaptive_entropy: lower bound."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "use_adaptive_entropy: upper bound."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "use_adaptive_entropy: step."})
    entropy_target: float = field(default=0.2, metadata={"help": "use_adaptive_entropy: target mean entropy."})
    vllm_importance_sampling_correction: bool | None = field(default=None, metadata={
        "help": "Correct for the sampler's log-probs differing from the trainer's (any engine; TRL's name). None: "
                "off (TRL: on with use_vllm only)."})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={
        "help": "token_truncate, token_mask, sequence_truncate or sequence_mask.",
        "choices": list(SAMPLING_CORRECTION_MODES)})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={
        "help": "Upper bound C_max of the correction's ratio (truncated to it, or masked above it)."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={
        "help": "Lower bound C_min of the correction's ratio (truncated to it, or masked below it)."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={
        "help": "Deprecated in TRL: vllm_importance_sampling_clip_max."})

    @property
    def sampling_correction(self) -> bool:
        """Whether the rollout keeps the sampler's log-probs and the loss weighs tokens by the correction's ratio."""
        return bool(self.vllm_importance_sampling_correction)

    def _check_policy_loss_options(self) -> None:
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated alias
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        name = type(self).__name__
        checks = [
            (self.delta is None or self.delta > 0, f"delta must be > 0 or None, got {self.delta}"),
            (0 <= self.top_entropy_quantile <= 1, f"top_entropy_quantile must be in (0, 1], got "
                                                 f"{self.top_entropy_quantile}"),
            (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0, "sapo temperatures must be > 0"),
            (self.entropy_coef_min <= self.entropy_coef_max, "entropy_coef_min must be <= entropy_coef_max"),
            (self.entropy_coef_delta >= 0, "entropy_coef_delta must be >= 0"),
            (self.vllm_importance_sampling_mode in SAMPLING_CORRECTION_MODES,
             f"vllm_importance_sampling_mode must be one of {SAMPLING_CORRECTION_MODES}, got "
             f"{self.vllm_importance_sampling_mode!r}"),
            (low is None or high is None or low < high, f"vllm_importance_sampling_clip_min ({low}) must be < "
                                                        f"vllm_importance_sampling_clip_max ({high})"),
            (low is not None or high is not None, "at least one of vllm_importance_sampling_clip_min / _max must be "
                                                  "set (as TRL)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message}.")
