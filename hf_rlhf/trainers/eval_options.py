"""`OnlineEvalOptions`: how PPO / GRPO / RLOO evaluate on held-out prompts (mixed into `PPOConfig`).

TRL 1.16's GRPOTrainer evaluates with `eval_strategy` / `eval_steps` on an `eval_dataset` of prompt rows, sampling
`num_generations_eval` completions per prompt (default `num_generations`) with the training temperature, and counts
`per_device_eval_batch_size` in completions. Kept here under the same names; `eval_do_sample` (greedy decoding) and
`eval_pass_threshold` (what pass@k counts as correct) are hf_rlhf's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OnlineEvalOptions:
    """Evaluation of an online trainer (`hf_rlhf.rollout.evaluation`).

    Args:
        num_generations_eval: completions per evaluation prompt (TRL's). None: `num_generations` when sampling, 1
            when greedy. With more than one, pass@k is logged for k = 1, 2, 4, ..., n.
        eval_do_sample: sample at the training `temperature` / `top_k` / `top_p` (TRL's evaluation); False: greedy
            decoding, one completion per prompt.
        eval_pass_threshold: a completion counts as correct for pass@k when its reward (the weighted sum of the
            reward functions) is at least this (1.0: the usual 0/1 accuracy reward).
    """

    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per evaluation prompt (TRL's). None: num_generations when "
                                        "sampling, 1 when greedy."})
    eval_do_sample: bool = field(
        default=True, metadata={"help": "Evaluation samples at the training temperature (as TRL); False: greedy."})
    eval_pass_threshold: float = field(
        default=1.0, metadata={"help": "A completion with reward >= this counts as correct for eval pass@k."})

    @property
    def eval_generations(self) -> int:
        """Completions per evaluation prompt: `num_generations_eval`, else `num_generations` (sampling, as TRL's
        trainer resolves it) or 1 (greedy)."""
        if self.num_generations_eval is not None:
            return self.num_generations_eval
        return self.num_generations if self.eval_do_sample else 1

    def _resolve_eval_options(self) -> None:
        """Check the evaluation options (after `num_generations` is set); `num_generations_eval` stays as given."""
        owner, n = type(self).__name__, self.eval_generations
        if n < 1:
            raise ValueError(f"{owner}.num_generations_eval must be >= 1, got {n}.")
        if not self.eval_do_sample and n > 1:
            raise ValueError(f"{owner}: eval_do_sample=False decodes greedily, so num_generations_eval={n} would "
                             "repeat one completion; set it to 1 (or leave it None).")
        if self.eval_strategy != "no" and self.per_device_eval_batch_size % n:  # as TRL: checked when evaluating
            raise ValueError(f"{owner}: per_device_eval_batch_size={self.per_device_eval_batch_size} (completions "
                             f"per evaluation batch) must be a multiple of num_generations_eval={n}: a prompt's "
                             "completions are evaluated on one process (an `evaluate()` call outside eval_strategy "
                             "takes one prompt a batch at the least).")
