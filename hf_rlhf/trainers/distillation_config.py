"""`DistillationConfig`: `PPOConfig`'s rollout loop with every option name of trl 1.16's `DistillationConfig`.

A TRL distillation script keeps its config: `DistillationConfig(beta=..., temperature=..., max_completion_length=...,
teacher_model_init_kwargs=...)`. Each TRL option here is one of:

- the same option under the same name (beta: the divergence, not a KL coefficient; temperature, top_p, top_k,
  generation_kwargs, max_tool_calling_iterations, ds3_gather_for_generation, disable_dropout, learning_rate);
- the same option under PPOConfig's name: max_completion_length -> response_length (either name; both read alike);
- converted: min_p, repetition_penalty, cache_implementation -> generation_kwargs; model_init_kwargs /
  teacher_model_init_kwargs (keys dtype, attn_implementation, device_map None) -> how `DistillationTrainer` loads a
  model given by path; teacher_model_name_or_path -> the teacher when `DistillationTrainer(teacher_model=None)`;
- accepted and unused where TRL leaves it unused too (the vllm_* options without use_vllm; num_completions_to_print
  without log_completions);
- refused with the reason when set to anything but TRL's default (`REFUSED`).

Added here: `lmbda` (GKD's on-policy fraction: each rollout is the student's samples with probability lmbda, else
the dataset's `completion` column; 1.0, TRL 1.16's behaviour, by default) and every `PPOConfig` option of the
rollout (`generation_backend`, `chunked_lm_head`, `rollout_batch_size`, tools' timeouts, ...). The
optimizer step is TRL's: one generation of per_device_train_batch_size x gradient_accumulation_steps completions per
device, one optimizer step on it (`rollout_batch_size` larger makes several steps of one generation).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .ppo_config import PPOConfig
from .vllm_options import VLLMIgnoredOptions

GENERATION_OPTIONS = {"min_p": None, "repetition_penalty": 1.0, "cache_implementation": None}
# model_init_kwargs keys a model given by path is loaded with (ModelConfig's fields of the same meaning)
INIT_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "device_map")
IGNORED_AS_IN_TRL = {
    "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url",
    "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size",  # without use_vllm
    "num_completions_to_print",  # log_completions only
}
REFUSED = {
    "trust_remote_code": "pass model_config=hf_rlhf.ModelConfig(trust_remote_code=True), or loaded models",
    "teacher_model_revision": "pass the teacher's local directory (or a loaded model)",
    "shuffle_dataset": "the prompt order is always a seeded shuffle (set data_seed), so that resume can replay it",
    "pad_to_multiple_of": "the rollout left-pads prompts itself (generation_backend='static' buckets them by 32)",
    "chat_template_kwargs": "not implemented: render the prompts yourself or set the tokenizer's chat template",
    "use_vllm": "vLLM cannot be used; generation_backend picks the engine (generate, static, lean)",
    "log_completions": "use hf_rlhf.callbacks.SampleCompletionsCallback to log sample completions",
    "log_unique_prompts": "not implemented",
}


@dataclass
class DistillationConfig(VLLMIgnoredOptions, PPOConfig):
    """On-policy distillation options as trl 1.16's `DistillationConfig` names them (see the module docstring).

    The loss: the generalised JSD between the student's and the teacher's next-token distributions at
    `temperature` on every completion token (`beta` 0: forward KL(teacher || student), 1: reverse KL, in between the
    JSD against the mixture), summed over the step's completion tokens / their count (TRL's reduction).
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate for AdamW (TRL's)."})
    beta: float = field(default=1.0, metadata={
        "help": "Generalised JSD: 0.0 forward KL, 1.0 reverse KL, in between the JSD (not a KL penalty)."})
    lmbda: float = field(default=1.0, metadata={
        "help": "Share of rollouts sampled from the student (on-policy); the others train on the dataset's "
                "`completion` column (GKD's lmbda). 1.0: always on-policy, as TRL 1.16."})
    max_completion_length: int = field(default=512, metadata={"help": "Max new tokens (PPOConfig's response_length)."})
    response_length: int = field(default=512, metadata={"help": "TRL's max_completion_length."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature, and the loss's (TRL's 1.0)."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "The teacher's path when DistillationTrainer gets no teacher_model."})
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": f"For a student given by path: {', '.join(INIT_KWARGS)} (device_map None)."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": f"For a teacher given by path: {', '.join(INIT_KWARGS)} (device_map None)."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling (passed to generate)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty (passed to generate)."})
    cache_implementation: str | None = field(default=None, metadata={"help": "KV cache of generate."})
    # PPOConfig options whose PPO defaults would cost a forward or a callback distillation does not need
    advantage_estimator: str = field(default="reinforce_pp", metadata={"help": "Unused: no advantages are trained."})
    kl_coef: float = field(default=0.0, metadata={"help": "Unused: no reference KL (beta is the divergence)."})
    num_ppo_epochs: int = field(default=1, metadata={"help": "Passes over each generation."})
    reward_normalization: str = field(default="none", metadata={"help": "Unused: no rewards."})
    # TRL options refused when set (REFUSED gives why), at TRL's defaults
    trust_remote_code: bool = field(default=False, metadata={"help": REFUSED["trust_remote_code"]})
    teacher_model_revision: str | None = field(default=None, metadata={"help": REFUSED["teacher_model_revision"]})
    shuffle_dataset: bool = field(default=True, metadata={"help": REFUSED["shuffle_dataset"]})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": REFUSED["pad_to_multiple_of"]})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={"help": REFUSED["chat_template_kwargs"]})
    use_vllm: bool = field(default=False, metadata={"help": REFUSED["use_vllm"]})
    log_completions: bool = field(default=False, metadata={"help": REFUSED["log_completions"]})
    log_unique_prompts: bool = field(default=False, metadata={"help": REFUSED["log_unique_prompts"]})
    # TRL options accepted and unused, as TRL leaves them unused in the same run (IGNORED_AS_IN_TRL)
    # (the vLLM ones: VLLMIgnoredOptions)
    num_completions_to_print: int | None = None

    def __post_init__(self):
        import json

        if self.pad_to_multiple_of in ("auto", "none", "None", "null"):  # TRL's "auto" pads on Neuron only
            self.pad_to_multiple_of = None
        defaults = {f.name: f.default for f in fields(self)}
        defaults["pad_to_multiple_of"] = None
        for name in REFUSED:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"DistillationConfig.{name}={getattr(self, name)!r} is not supported: "
                                 f"{REFUSED[name]}.")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"DistillationConfig: beta must be in [0.0, 1.0], got {self.beta}.")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"DistillationConfig: lmbda must be in [0.0, 1.0], got {self.lmbda}.")
        for name in ("model_init_kwargs", "teacher_model_init_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = json.loads(value)
                setattr(self, name, value)
            self._check_init_kwargs(name, value)
        ours, theirs = self.response_length, self.max_completion_length
        if ours != defaults["response_length"] and theirs != defaults["max_completion_length"] and ours != theirs:
            raise ValueError(f"DistillationConfig: max_completion_length={theirs} and response_length={ours} are one "
                             "option under TRL's and PPOConfig's names; set one of them.")
        self.response_length = self.max_completion_length = theirs if theirs != defaults[
            "max_completion_length"] else ours
        if isinstance(self.generation_kwargs, str):
            self.generation_kwargs = json.loads(self.generation_kwargs)
        extra = {name: getattr(self, name) for name, default in GENERATION_OPTIONS.items()
                 if getattr(self, name) != default}
        if extra:
            self.generation_kwargs = {**extra, **(self.generation_kwargs or {})}
        super().__post_init__()

    @staticmethod
    def _check_init_kwargs(name: str, value) -> None:
        if value is None:
            return
        if not isinstance(value, dict):
            raise ValueError(f"DistillationConfig.{name} must be a dict, got {type(value).__name__}.")
        unknown = sorted(set(value) - set(INIT_KWARGS))
        if unknown:
            raise ValueError(f"DistillationConfig.{name}: {unknown} not supported (only {list(INIT_KWARGS)}); pass "
                             "model_config=hf_rlhf.ModelConfig(...) or a loaded model.")
        if value.get("device_map") not in (None, "cpu"):
            raise ValueError(f"DistillationConfig.{name}: device_map={value['device_map']!r} is not supported: the "
                             "Trainer places the models (device_map None).")

    @property
    def old_logprobs_in_loss(self) -> bool:
        """Always: the distillation loss reads no old log-probs, so the rollout makes no policy forward."""
        return True

    @property
    def uses_reference(self) -> bool:
        """Never: the teacher is not PPO's reference (no KL penalty, no reference forward in the rollout)."""
        return False
