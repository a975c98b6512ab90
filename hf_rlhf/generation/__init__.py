"""Generation: decoded greedy completions (`generate_completions`, for evaluation and logged samples) and the
rollout's generation engines (`GenerationEngine`, `build_engine`, `PPOConfig.generation_backend`)."""

from .capture import DecodeCapture
from .completions import generate_completions
from .engines import (
           GENERATION_BACKENDS,
           EngineStats,
           GenerateEngine,
           GenerationEngine,
           GenerationOutput,
           LeanDecodeEngine,
           StaticCacheEngine,
           build_engine,
           check_lean_options,
)

__all__ = ["GENERATION_BACKENDS", "DecodeCapture", "EngineStats", "GenerateEngine", "GenerationEngine",
           "GenerationOutput", "LeanDecodeEngine", "StaticCacheEngine", "check_lean_options", "build_engine",
           "generate_completions"]
