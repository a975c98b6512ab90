"""GRPOTrainer: trl 1.16's `GRPOTrainer` signature and logged metrics on `PPOTrainer`'s critic-free loop.

A TRL GRPO script runs with `from hf_rlhf import GRPOConfig, GRPOTrainer` in place of `from trl import ...`: the
same keywords (`model`, `reward_funcs`, `args`, `train_dataset`, `processing_class`, `reward_processing_classes`,
`callbacks`, `optimizers`, `peft_config`, `tools`, `rollout_func`, `environment_factory`), the same dataset rows
(a `prompt`, text or messages, and any columns the reward functions read), and TRL's metric names in the logs
(`reward`, `reward_std`, `rewards/{name}/mean|std`, `frac_reward_zero_std`, `completions/*`, `entropy`, `kl`,
`clip_ratio/*`, `tools/*`, `num_tokens`, `step_time`), next to PPOTrainer's own (`objective/*`, `policy/*`,
`loss/*`). What differs from TRL is listed in docs/grpo.md ("GRPOTrainer: a drop-in for trl.GRPOTrainer").
"""

from __future__ import annotations

import time

import torch

from ..losses.ppo import importance_log_weights
from ..rewards.weighted import WeightedRewards
from .grpo_config import GRPOConfig
from .grpo_metrics import clip_metrics, completion_metrics, reward_metrics
from .ppo_trainer import PPOTrainer


class GRPOTrainer(PPOTrainer):
    """GRPO (or any `advantage_estimator` of `GRPOConfig`) with trl 1.16 `GRPOTrainer`'s arguments.

    Args:
        model: the policy: a path or hub id, a causal LM or a `PeftModel`.
        reward_funcs: a reward function `(prompts, completions, **columns) -> list[float]`, a reward model or its
            path, or a list of them; their scores are summed with `GRPOConfig.reward_weights`. Functions also get
            TRL's `trainer_state`, `log_metric(name, value)`, `log_extra(column, values)` (a no-op: there is no
            completions table) and, with `environment_factory`, `environments`. None: only with an environment
            that defines `get_reward()`.
        args: a `GRPOConfig` (a trl `GRPOConfig` is converted, field for field).
        train_dataset: prompt rows (`prompt`: text or messages); other columns reach the reward functions.
        eval_dataset: prompt rows for `evaluate()` / `eval_strategy` (as `PPOTrainer`; TRL's metrics with `eval_`).
        processing_class: the policy's tokenizer (default: loaded from the model's path).
        reward_processing_classes: the reward models' tokenizers: one, or a list with one per reward function.
        callbacks, optimizers, peft_config: as for `transformers.Trainer` / TRL.
        quantization_config: refused: load with `model_config=hf_rlhf.ModelConfig(load_in_4bit=True, ...)`.
        tools, rollout_func, environment_factory: as `PPOTrainer` (TRL 1.16's).
        **kwargs: `PPOTrainer`'s own extras (`ref_model`, `model_config`, `value_model`, `ptx_dataset`).
    """

    config_class = GRPOConfig
    tag_names = ("hf_rlhf", "trl", "grpo")
    default_output_dir = "grpo-output"
    counts_tokens = True  # TRL's num_tokens: prompt and completion tokens of every rollout so far (tools' excepted)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, **kwargs):
        args = self.resolve_args(args)
        if quantization_config is not None:
            raise ValueError("GRPOTrainer(quantization_config=...) is not taken: pass model_config=hf_rlhf."
                             "ModelConfig(load_in_4bit=True, ...) (or a model loaded quantized).")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else (
            [] if reward_funcs is None else [reward_funcs])
        tokenizers = reward_processing_classes
        if tokenizers is not None and not isinstance(tokenizers, (list, tuple)):
            tokenizers = [tokenizers] * len(funcs)
        reward = WeightedRewards(funcs, args.reward_weights, tokenizers) if funcs else None
        if reward is None and args.reward_weights is not None:
            raise ValueError("reward_weights is set but there are no reward_funcs")
        self._reward_parts, self._reward_names, self._reward_weights = [], ["reward"], torch.ones(1)
        self._step_started, self._micro_left = None, 0
        super().__init__(model, reward, args=args, train_dataset=train_dataset, processing_class=processing_class,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers,
                         eval_dataset=eval_dataset, tools=tools, environment_factory=environment_factory,
                         rollout_func=rollout_func, **kwargs)

    # -- rewards: each function's scores kept for TRL's metrics ---------------------------------------
    def compute_rewards(self, prompts: list, completions: list, **columns) -> torch.Tensor:
        """The weighted sum of the reward functions (plus an environment's `get_reward()`, weight 1, as TRL)."""
        environments = columns.pop("environments", None)
        rows, names, weights = [], [], []
        source = self.reward_source
        if isinstance(source, WeightedRewards):
            extra = {"trainer_state": self.state, "log_metric": self._log_metric, "log_extra": _no_extra_columns}
            if environments is not None:
                extra["environments"] = environments
            source(prompts, completions, function_kwargs=extra, **columns)
            rows.append(source.last)
            names, weights = list(source.names), source.weights.tolist()
        elif source is not None:  # replaced after __init__ by a plain callable
            rows.append(torch.as_tensor(source(prompts, completions, **columns), dtype=torch.float32)[None])
            names, weights = ["reward"], [1.0]
        if environments is not None and self.environment_pool.has_reward:
            rows.append(torch.tensor([[float(env.get_reward()) for env in environments]]))
            names, weights = names + [type(environments[0]).__name__], weights + [1.0]
        per_func = torch.cat(rows) if rows else torch.zeros(1, len(completions))
        self._reward_parts.append(per_func)
        self._reward_names, self._reward_weights = names or ["reward"], torch.tensor(weights or [1.0])
        return (self._reward_weights[:, None] * per_func).sum(0)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` for reward functions: averaged over the logging window (and ranks)."""
        self.metrics["eval" if self._evaluating else "train"].add(name, float(value))

    def score_completions(self, prompts: list, completions: list, **columns):
        """Each reward function's scores of evaluated completions, for TRL's `eval_rewards/{name}/*`."""
        kept, self._reward_parts = self._reward_parts, []
        try:
            self.compute_rewards(prompts, completions, **columns)
            return list(self._reward_names), torch.cat(self._reward_parts), self._reward_weights
        finally:
            self._reward_parts = kept

    # -- TRL's rollout metrics ------------------------------------------------------------------------
    def _make_experience(self, rows, indices, refill=None):
        self._reward_parts = []
        experience, stats = super()._make_experience(rows, indices, refill)
        gather = self.accelerator.gather
        device = self.accelerator.device
        maker = self.rollout_maker
        per_func = gather(torch.cat(self._reward_parts, dim=1).T.contiguous().to(device)).T.cpu()
        stats.update(reward_metrics(per_func, self._reward_names, self._reward_weights, self.args.num_generations))
        stats.update(completion_metrics(gather(maker.last_lengths).cpu(), gather(maker.last_stopped).cpu()))
        # TRL's num_tokens: prompt and completion tokens per completion (tool results not counted), summed at logs
        self.metrics["train"].add("num_tokens", (experience.query_mask.sum() + maker.last_lengths.sum()).float())
        return experience, stats

    def log_policy_terms(self, metrics, logprobs, old_logprobs, advantages, mask) -> None:
        """TRL's `clip_ratio/*` of this micro-batch (token means, and the extremes of per-sequence means)."""
        args = self.args
        ratio = torch.exp(importance_log_weights(logprobs - old_logprobs, mask, args.importance_sampling_level))
        high = args.epsilon_high if args.epsilon_high is not None else args.cliprange
        sums, per_sequence = clip_metrics(ratio, advantages, mask, args.cliprange, high)
        tokens = mask.sum().float()
        for name, value in sums.items():
            metrics.add(name, value, tokens)
        metrics.add_min("clip_ratio/low_min", per_sequence["clip_ratio/low_min"])
        metrics.add_max("clip_ratio/high_max", per_sequence["clip_ratio/high_max"])

    def logged_metrics(self, mode: str, totals: dict[str, tuple[float, float]]) -> dict[str, float]:
        logs = super().logged_metrics(mode, totals)
        for trl_name, ours in (("entropy", "policy/entropy_avg"), ("kl", "loss/kl_avg")):
            if ours in logs:  # TRL's names for the same token means
                logs[trl_name] = logs[ours]
        return logs

    # -- TRL's step_time: rollout and every micro-batch of the optimizer step -------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self._step_started = time.perf_counter()
        batches, tokens = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._micro_left = len(batches)
        return batches, tokens

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self._micro_left -= 1
        if self._micro_left == 0 and self._step_started is not None:
            self.metrics["train"].add("step_time", time.perf_counter() - self._step_started)
        return loss


def _no_extra_columns(column: str, values: list) -> None:
    """TRL's `log_extra` (columns of its completions table): accepted, nothing is logged here."""
