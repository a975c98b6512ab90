"""TRL's vLLM server and engine settings, accepted and unused: vLLM cannot run here (`use_vllm` is refused by name),
and TRL itself leaves these unused when `use_vllm` is off. Shared by the configs that take trl's vLLM fields
(`GRPOConfig`, `DistillationConfig`), so a trl config file loads unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VLLMIgnoredOptions:
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
