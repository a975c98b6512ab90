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

import copy

import torch
from transformers import TrainingArguments

from ..losses.grpo import sequence_advantages
from ..losses.ppo import importance_log_weights
from ..models.adapters import unwrap_peft
from ..models.loading import cast_lm_head_to_fp32, set_router_aux_loss
from ..rewards.weighted import WeightedRewards
from ..rl.critic_free import normalize_then_sum
from ..tools.environments import EnvironmentPool
from .grpo_completions import CompletionsLog, SyncPolicyRefCallback
from .grpo_config import GRPOConfig
from .grpo_metrics import clip_metrics, completion_metrics, reward_metrics
from .ppo_trainer import PPOTrainer
from .step_time import StepTimeMixin


class GRPOTrainer(StepTimeMixin, PPOTrainer):
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
        tokenizers = reward_processing_classes  # as TRL: one object is a list of one
        if tokenizers is not None and not isinstance(tokenizers, (list, tuple)):
            tokenizers = [tokenizers]
        if tokenizers is not None and len(tokenizers) != len(funcs):
            raise ValueError(f"The number of reward processing classes ({len(tokenizers)}) must match the number of "
                             f"reward functions ({len(funcs)}).")
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(args.reward_weights)} weights for {len(funcs)} reward "
                             "functions; give one per reward function (as TRL; an environment's get_reward() has "
                             "weight 1)")
        # TRL: an environment class with get_reward() is one more reward function, after these, weight 1
        pool = None if environment_factory is None else EnvironmentPool(environment_factory, tools)
        env_funcs = [] if pool is None else pool.reward_funcs()
        weights = None if args.reward_weights is None else list(args.reward_weights) + [1.0] * len(env_funcs)
        reward = WeightedRewards(funcs + env_funcs, weights, None if tokenizers is None else list(tokenizers) + [
            None] * len(env_funcs)) if funcs or env_funcs else None
        if args.cast_lm_head_to_fp32:  # the chunked head reads the head's weights itself: the full logits instead
            if args.chunked_lm_head:
                raise ValueError("cast_lm_head_to_fp32=True computes the LM head's full float32 logits; "
                                 "chunked_lm_head=True cannot go with it (leave it None).")
            args.chunked_lm_head = False
        self._reward_parts, self._reward_names, self._reward_weights = [], ["reward"], torch.ones(1)
        self._router_aux = None
        super().__init__(model, reward, args=args, train_dataset=train_dataset, processing_class=processing_class,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers,
                         eval_dataset=eval_dataset, tools=tools, environment_factory=pool,
                         rollout_func=rollout_func, **kwargs)
        policy = self.model.policy
        self.reward_funcs = funcs + env_funcs
        self.reward_processing_classes = list(tokenizers) + [None] * len(env_funcs) if tokenizers is not None else [
            getattr(s, "tokenizer", None) for s in (reward.sources if reward is not None else [])]
        self.rollout_maker.allow_unscored = args.advantage_estimator in ("grpo", "rloo")  # None rewards, as TRL
        if args.cast_lm_head_to_fp32:
            for target in (policy, self.ref_model):
                if target is not None:
                    cast_lm_head_to_fp32(unwrap_peft(target))
        # TRL's attribute: the MoE router's load-balancing loss is added to the loss
        self.aux_loss_enabled = set_router_aux_loss(policy, args.router_aux_loss_coef)
        if self.aux_loss_enabled and self.lm_heads[0] is not None:  # the chunked head runs the backbone only: the
            if args.chunked_lm_head:  # router loss is computed by the causal LM's forward, from the full logits
                raise ValueError("chunked_lm_head=True cannot go with the MoE router loss (the causal LM's forward "
                                 "computes it); set router_aux_loss_coef=0 or chunked_lm_head=None")
            self.lm_heads = self.rollout_maker.lm_heads = (None, self.lm_heads[1])
        if self.aux_loss_enabled and self.share_prompts:  # the router loss reads a 2D mask; prompt sharing's is 4D
            if args.prefix_sharing:
                raise ValueError("prefix_sharing=True cannot go with the MoE router loss (its load-balancing loss "
                                 "reads a 2D attention mask); set router_aux_loss_coef=0 or prefix_sharing=None")
            self.share_prompts = self.rollout_maker.share_prompts = False
        if self.aux_loss_enabled:  # router logits in the loss's forward only: generation's cached steps fail with them
            self._router_config = unwrap_peft(policy).config.get_text_config()
            self._router_config.output_router_logits = False
            unwrap_peft(policy).register_forward_hook(self._keep_router_aux)
        if args.sync_ref_model:  # TR-DPO mixing, with trl's callback (as DPOTrainer)
            if not args.uses_reference:
                raise ValueError("You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model "
                                 "is not used: there is nothing to synchronize. Set sync_ref_model=False, or beta > 0.")
            if self.ref_model is None:
                raise ValueError("sync_ref_model=True needs a separate reference model: a peft policy's reference is "
                                 "its base with the adapters off (as TRL, not supported).")
            self.add_callback(SyncPolicyRefCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        self.completions_log = CompletionsLog(args)  # TRL's `_logs`; written and printed with log_completions

    @classmethod
    def resolve_args(cls, args):
        """As `PPOTrainer`'s; a TRL config's `vllm_importance_sampling_correction=True` acts in TRL with `use_vllm`
        only, so without it the correction stays off here too."""
        if (isinstance(args, TrainingArguments) and not isinstance(args, GRPOConfig)
                and getattr(args, "vllm_importance_sampling_correction", None) and not getattr(args, "use_vllm", 0)):
            args = copy.copy(args)
            args.vllm_importance_sampling_correction = None
        return super().resolve_args(args)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.aux_loss_enabled:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._router_config.output_router_logits = True
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._router_config.output_router_logits = False

    @property
    def reward_func_names(self) -> list[str]:
        """TRL's: each reward function's name, then each environment class's that defines `get_reward()`."""
        if isinstance(self.reward_source, WeightedRewards):
            return list(self.reward_source.names)
        return ["reward"] * (self.reward_source is not None)

    @property
    def reward_weights(self) -> torch.Tensor:
        """TRL's: (K,) the weights of `reward_func_names` (an environment's reward: 1)."""
        if isinstance(self.reward_source, WeightedRewards):
            return self.reward_source.weights.clone()
        return torch.ones(len(self.reward_func_names))

    @property
    def _logs(self) -> dict:
        """TRL's `GRPOTrainer._logs` (the latest generation's prompts, completions, rewards, advantages, extra)."""
        return self.completions_log.logs

    def _keep_router_aux(self, module, inputs, output) -> None:
        self._router_aux = getattr(output, "aux_loss", None)

    def _aux_loss(self):
        """TRL's router term: `router_aux_loss_coef` × the forward's load-balancing loss, scaled for accumulation."""
        if not self.aux_loss_enabled:
            return 0.0
        aux, self._router_aux = self._router_aux, None
        if aux is None:
            raise ValueError("router_aux_loss_coef: the policy's forward returned no aux_loss (the chunked LM head "
                             "runs the backbone only); set chunked_lm_head=False")
        self.metrics["train"].add("aux_loss", aux.detach().float())
        coef = unwrap_peft(self.model.policy).config.get_text_config().router_aux_loss_coef
        return coef * aux / self.current_gradient_accumulation_steps

    # -- rewards: each function's scores kept for TRL's metrics ---------------------------------------
    def compute_rewards(self, prompts: list, completions: list, **columns) -> torch.Tensor:
        """The weighted sum of the reward functions (plus an environment's `get_reward()`, weight 1, as TRL)."""
        environments = columns.pop("environments", None)
        source = self.reward_source
        if isinstance(source, WeightedRewards):  # an environment's get_reward() is one of its functions (as TRL)
            extra = {"trainer_state": self.state, "log_metric": self._log_metric,
                     "log_extra": self.completions_log.add_extra}
            if environments is not None:
                extra["environments"] = environments
            source(prompts, completions, function_kwargs=extra, **columns)
            per_func, names, weights = source.last, list(source.names), source.weights.tolist()
        elif source is not None:  # replaced after __init__ by a plain callable
            per_func = torch.as_tensor(source(prompts, completions, **columns), dtype=torch.float32)[None]
            names, weights = ["reward"], [1.0]
        else:
            per_func, names, weights = torch.zeros(1, len(completions)), [], []
        self._reward_parts.append(per_func)
        self._reward_names, self._reward_weights = names or ["reward"], torch.tensor(weights or [1.0])
        if hasattr(self, "completions_log"):  # (not yet during __init__'s checks)
            self.completions_log.add_rewards(prompts, completions, per_func, self._reward_names)
        if self.args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: each function in its group first
            return normalize_then_sum(per_func.T, self._reward_weights, self.args.num_generations)
        total = (self._reward_weights[:, None] * per_func).nansum(0)  # NaN: the function did not score the row
        return total.masked_fill(torch.isnan(per_func).all(0), float("nan"))

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
        # the rows of the kept groups only (filter_groups scores several rounds: their rows are not logged)
        advantages = gather(sequence_advantages(experience.advantages, experience.response_mask)).cpu()
        if len(self.completions_log.pending) != len(experience):
            self.completions_log.pending = []
        self.completions_log.end_rollout(self.state.global_step, advantages, self.accelerator)
        stats.update(completion_metrics(gather(maker.last_lengths).cpu(), gather(maker.last_stopped).cpu()))
        # TRL's num_tokens: prompt and completion tokens per completion (tool results not counted), summed at logs
        self.metrics["train"].add("num_tokens", (experience.query_mask.sum() + maker.last_lengths.sum()).float())
        return experience, stats

    def log_policy_terms(self, metrics, logprobs, old_logprobs, advantages, mask, stats=None) -> None:
        """TRL's per-micro-batch loss metrics: `policy_loss`; `clip_ratio/*` for the clipped loss types (token means,
        and the extremes of per-sequence means), `cispo_clip_ratio` for cispo, `vespo/phi_seq_mean` for vespo."""
        args = self.args
        tokens = mask.sum().float()
        high = args.epsilon_high if args.epsilon_high is not None else args.cliprange
        if stats is not None:
            metrics.add("policy_loss", stats["policy_loss"])
        if args.loss_type == "vespo":
            metrics.add("vespo/phi_seq_mean", stats["phi"].sum(), float(stats["phi"].numel()))
            return
        ratio = torch.exp(importance_log_weights(logprobs - old_logprobs, mask, args.importance_sampling_level))
        if args.loss_type == "cispo":
            clipped = ((ratio > high) & (advantages > 0)).float()
            metrics.add("cispo_clip_ratio", (clipped * mask).sum(), tokens)
            return
        if args.loss_type == "sapo":  # TRL logs no clip ratios for sapo
            return
        sums, per_sequence = clip_metrics(ratio, advantages, mask, args.cliprange, high)
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

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        if self.args.log_completions and self.accelerator.is_main_process:
            self.completions_log.flush(self.state.global_step, self.args.report_to)

