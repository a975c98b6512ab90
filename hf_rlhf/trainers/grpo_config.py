"""`GRPOConfig`: `PPOConfig` with GRPO's defaults and every option name of trl 1.16's `GRPOConfig`.

A TRL script keeps its config as it is: `GRPOConfig(beta=..., epsilon=..., num_iterations=...,
max_completion_length=..., steps_per_generation=...)`. Each TRL option here is one of:

- the same option under PPOConfig's name, set from TRL's (`TRL_NAMES`: beta -> kl_coef, epsilon -> cliprange,
  num_iterations -> num_ppo_epochs, max_completion_length -> response_length); either name may be given, both
  read the same afterwards, and two different values are an error;
- the same option under the same name (num_generations, temperature, top_p, top_k, epsilon_high, loss_type,
  scale_rewards, importance_sampling_level, mask_truncated_completions, entropy_coef, max_tool_calling_iterations,
  ds3_gather_for_generation, generation_kwargs, disable_dropout);
- converted: steps_per_generation / generation_batch_size -> rollout_batch_size (per device: per_device_train_batch_size
  x steps_per_generation); min_p, repetition_penalty, cache_implementation -> generation_kwargs; reward_weights and
  use_bias_correction_kl are read by `GRPOTrainer`;
- implemented under TRL's name and meaning (`IMPLEMENTED`: the loss types' parameters, delta, the masks, adaptive
  entropy and the sampler correction of `PolicyLossOptions`, which every PPOConfig has; and here
  multi_objective_aggregation, sync_ref_model, log_completions, chat_template_kwargs, cast_lm_head_to_fp32, the MoE
  router loss, model_init_kwargs / trust_remote_code, shuffle_dataset, pad_to_multiple_of);
- accepted and unused where TRL ignores it too in the same run (the vllm_* server options without use_vllm, ...:
  `IGNORED_AS_IN_TRL`);
- refused with the reason when set to anything but TRL's default (`REFUSED`: use_vllm, since vLLM cannot be
  installed here, and the transformers paged / continuous-batching engines).

Defaults are TRL's, except `vllm_importance_sampling_correction=None` (TRL's True acts only with vLLM; here True
turns the correction on for any engine), `disable_dropout=True` (the rollout's old log-probs are exact only without
dropout) and
`bf16` / `gradient_checkpointing` (device-aware, as every hf_rlhf config).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .ppo_config import PPOConfig
from .vllm_options import VLLMIgnoredOptions

# TRL's name -> PPOConfig's name, for the options both have under different names
TRL_NAMES = {"beta": "kl_coef", "epsilon": "cliprange", "num_iterations": "num_ppo_epochs",
             "max_completion_length": "response_length"}
# TRL options passed to `generate` (TRL hands them to its generation config)
GENERATION_OPTIONS = {"min_p": None, "repetition_penalty": 1.0, "cache_implementation": None}
# accepted, and unused exactly where TRL does not use them either (a condition below never holds here)
IGNORED_AS_IN_TRL = {
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url",
    "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size",  # without use_vllm
    "log_multimodal",  # images in the completions table: no image inputs here
    "transformers_continuous_batching_config",  # use_transformers_continuous_batching only
}
# TRL option -> why it cannot apply; refused when set to anything but TRL's default
REFUSED = {
    "use_vllm": "vLLM cannot be installed here; generation_backend picks the engine (generate, static, lean), and "
                "vllm_importance_sampling_correction=True corrects for any engine's sampling log-probs",
    "use_transformers_continuous_batching": "use generation_backend ('generate', 'static' or 'lean')",
    "use_transformers_paged": "use generation_backend ('generate', 'static' or 'lean')",
    "log_completions_hub_repo": "no Hub here: log_completions writes completions.jsonl into output_dir and the "
                                "table through report_to",
}
# TRL's GRPO options this module implements (read by GRPOTrainer / PPOTrainer, `PolicyLossOptions` for the loss)
IMPLEMENTED = {
    "delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg", "off_policy_mask_threshold", "top_entropy_quantile", "use_adaptive_entropy",
    "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
    "multi_objective_aggregation", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "log_completions", "num_completions_to_print", "log_unique_prompts", "chat_template_kwargs",
    "cast_lm_head_to_fp32", "router_aux_loss_coef", "model_init_kwargs", "trust_remote_code", "shuffle_dataset",
    "pad_to_multiple_of",
}
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class GRPOConfig(VLLMIgnoredOptions, PPOConfig):
    """GRPO options as trl 1.16's `GRPOConfig` names them (see the module docstring), on top of `PPOConfig`.

    Batches, as in TRL: `per_device_train_batch_size` counts completions; a generation is `steps_per_generation`
    micro-batches per device (default `gradient_accumulation_steps`: one optimizer step per generation and
    iteration), i.e. `per_device_train_batch_size * steps_per_generation / num_generations` prompts per device, each
    sampled `num_generations` times; `generation_batch_size` is the same count over all processes. Unlike TRL, a
    prompt's group of completions stays on one process, so the per-device generation must hold whole groups.
    `num_iterations` passes are made over each generation (PPOConfig's `num_ppo_epochs`).
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW (TRL's)."})
    advantage_estimator: str = field(default="grpo", metadata={"help": "GRPO by default; any PPOConfig estimator."})
    num_generations: int | None = field(default=8, metadata={"help": "Completions sampled per prompt (G)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (TRL's default 1.0)."})
    kl_coef: float = field(default=0.0, metadata={"help": "β: TRL's `beta` (default 0: no reference model)."})
    kl_estimator: str = field(default="k3", metadata={"help": "GRPO's per-token KL: k3."})
    kl_clamp: float | None = field(default=None, metadata={"help": "TRL's GRPO does not clamp the k3 KL."})
    kl_in_loss: bool = field(default=True, metadata={"help": "GRPO: β·KL per token in the loss."})
    num_ppo_epochs: int = field(default=1, metadata={"help": "TRL's `num_iterations`."})
    response_length: int = field(default=512, metadata={"help": "TRL's `max_completion_length`."})
    # TRL's names of PPOConfig options
    beta: float = field(default=0.0, metadata={"help": "KL coefficient β (PPOConfig's kl_coef)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip of the ratio (PPOConfig's cliprange)."})
    num_iterations: int = field(default=1, metadata={"help": "Passes over each generation (num_ppo_epochs)."})
    max_completion_length: int = field(default=512, metadata={"help": "Max new tokens (response_length)."})
    # batches
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Micro-batches per generation per device. None: gradient_accumulation_steps."})
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Completions per generation over all processes (or steps_per_generation)."})
    # generation
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling (passed to generate)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty (passed to generate)."})
    cache_implementation: str | None = field(default=None, metadata={"help": "KV cache of generate."})
    # rewards and loss
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function (default: 1 each)."})
    use_bias_correction_kl: bool = field(
        default=True, metadata={"help": "Multiply the per-token KL by the importance ratio (TRL's default)."})
    # models (TRL's model_init_kwargs / trust_remote_code: mapped to hf_rlhf.ModelConfig when the model is a path)
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "from_pretrained keywords for a model given by path (dtype, attn_implementation, revision, ...)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Trust the model repository's own code."})
    router_aux_loss_coef: float | None = field(default=None, metadata={
        "help": "MoE router load-balancing loss weight; None: the model config's own (0 off)."})
    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "Compute the LM head in float32."})
    # data
    shuffle_dataset: bool = field(default=True, metadata={"help": "False: prompts in dataset order."})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={
        "help": "Left-pad each prompt batch to a multiple of this many tokens ('auto': none off Neuron)."})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={
        "help": "Keywords for apply_chat_template (e.g. {'enable_thinking': False})."})
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={
        "help": "sum_then_normalize (GRPO) or normalize_then_sum (GDPO: each reward normalised in its group first).",
        "choices": list(MULTI_OBJECTIVE_AGGREGATIONS)})
    # reference syncing (TR-DPO)
    sync_ref_model: bool = field(default=False, metadata={"help": "Mix the policy into the reference (TR-DPO)."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "α: ref = α·policy + (1 − α)·ref."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Optimizer steps between reference syncs."})
    # logging
    log_completions: bool = field(default=False, metadata={
        "help": "Log each rollout's prompts, completions, rewards and advantages (report_to, completions.jsonl)."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Rows printed (None: all)."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "Print each prompt once."})
    # TRL options refused when set (REFUSED gives why), at TRL's defaults
    use_vllm: bool = field(default=False, metadata={"help": REFUSED["use_vllm"]})
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": REFUSED["use_transformers_continuous_batching"]})
    use_transformers_paged: bool = field(default=False, metadata={"help": REFUSED["use_transformers_paged"]})
    log_completions_hub_repo: str | None = field(default=None, metadata={"help": REFUSED["log_completions_hub_repo"]})
    # TRL options accepted and unused, as TRL leaves them unused in the same run (IGNORED_AS_IN_TRL)
    # (the vLLM ones: VLLMIgnoredOptions)
    log_multimodal: bool = True
    transformers_continuous_batching_config: dict | None = None

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL's spelling: True is "group", False "none"
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.pad_to_multiple_of in ("auto", "none", "None", "null"):  # TRL's "auto" pads on Neuron only
            self.pad_to_multiple_of = None
        elif isinstance(self.pad_to_multiple_of, str):  # from the command line, as TRL
            self.pad_to_multiple_of = int(self.pad_to_multiple_of)
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"GRPOConfig.pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}.")
        for name in ("model_init_kwargs", "chat_template_kwargs"):  # a JSON string from the command line, as TRL
            if isinstance(getattr(self, name), str):
                import json

                setattr(self, name, json.loads(getattr(self, name)))
        if self.multi_objective_aggregation == "normalize_then_sum":
            if self.advantage_estimator != "grpo":
                raise ValueError("GRPOConfig: multi_objective_aggregation='normalize_then_sum' is GRPO's advantage "
                                 f"(GDPO); advantage_estimator={self.advantage_estimator!r} has its own.")
            # TRL normalises the summed rewards over the batch and reads no scale_rewards in this branch
            self.scale_rewards = "batch"
        defaults = {f.name: f.default for f in fields(self)}
        defaults["pad_to_multiple_of"] = None  # "auto", as normalised above
        for name in REFUSED:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r} is not supported: {REFUSED[name]}.")
        self._merge_trl_names(defaults)
        extra = {name: getattr(self, name) for name, default in GENERATION_OPTIONS.items()
                 if getattr(self, name) != default}
        if extra:
            if isinstance(self.generation_kwargs, str):
                import json

                self.generation_kwargs = json.loads(self.generation_kwargs)
            self.generation_kwargs = {**extra, **(self.generation_kwargs or {})}
        if self.auto_find_batch_size:  # as TRL: a shrunk batch no longer holds whole prompt groups
            raise ValueError("GRPOConfig: auto_find_batch_size is not supported: a generation must hold whole groups "
                             "of num_generations completions; lower per_device_train_batch_size instead.")
        super().__post_init__()

    def _merge_trl_names(self, defaults: dict) -> None:
        """Both names of each option in `TRL_NAMES` read the one value given (the default when neither is)."""
        for trl_name, ours in TRL_NAMES.items():
            theirs_value, our_value = getattr(self, trl_name), getattr(self, ours)
            if theirs_value != defaults[trl_name] and our_value != defaults[ours] and theirs_value != our_value:
                raise ValueError(f"GRPOConfig: {trl_name}={theirs_value!r} and {ours}={our_value!r} are one option "
                                 f"under TRL's and PPOConfig's names; set one of them.")
            value = theirs_value if theirs_value != defaults[trl_name] else our_value
            setattr(self, trl_name, value)
            setattr(self, ours, value)

    def _check_batches(self):
        """TRL's generation batch (steps_per_generation / generation_batch_size) as PPOConfig's rollout_batch_size."""
        micro, processes = self.per_device_train_batch_size, self.world_size
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            # both are set after __post_init__: a config rebuilt from its `to_dict()` (or TRL's) must still build
            if self.generation_batch_size != micro * processes * self.steps_per_generation:
                raise ValueError("GRPOConfig: 'generation_batch_size' and 'steps_per_generation' can not be both "
                                 "configured at the same time (as in TRL).")
            self.generation_batch_size = None
        if self.generation_batch_size is not None:
            if self.generation_batch_size % (micro * processes):
                raise ValueError(f"GRPOConfig: generation_batch_size ({self.generation_batch_size}) must be divisible "
                                 f"by the global batch size ({micro * processes}).")
            self.steps_per_generation = self.generation_batch_size // (micro * processes)
        if self.steps_per_generation is not None:
            if self.rollout_batch_size is not None and self.rollout_batch_size != micro * self.steps_per_generation:
                raise ValueError("GRPOConfig: set steps_per_generation (or generation_batch_size) or "
                                 "rollout_batch_size, not both.")
            self.rollout_batch_size = micro * self.steps_per_generation
        super()._check_batches()
        self.steps_per_generation = self.rollout_batch_size // micro
        self.generation_batch_size = self.rollout_batch_size * processes
