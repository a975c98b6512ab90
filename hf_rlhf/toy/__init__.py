"""An offline toy world for tests and recipe defaults: tasks with checkable answers, a locally
trained character tokenizer and tiny randomly initialised Llama models."""

from .models import build_toy_model, build_toy_reward_model, toy_model_config
from .tasks import (
    answer_for_prompt,
    exact_match,
    is_correct,
    make_tasks,
    preference_dataset,
    prompt_dataset,
    reward_fn,
    sft_dataset,
    unpaired_dataset,
)
from .tokenizer import build_toy_tokenizer, build_toy_tool_tokenizer
from .tool_task import tool_exact_match, tool_prompt_dataset, tool_reward, tool_sft_dataset

__all__ = [
    "answer_for_prompt",
    "build_toy_model",
    "build_toy_reward_model",
    "build_toy_tokenizer",
    "build_toy_tool_tokenizer",
    "exact_match",
    "is_correct",
    "make_tasks",
    "preference_dataset",
    "prompt_dataset",
    "reward_fn",
    "sft_dataset",
    "tool_exact_match",
    "tool_prompt_dataset",
    "tool_reward",
    "tool_sft_dataset",
    "toy_model_config",
    "unpaired_dataset",
]
