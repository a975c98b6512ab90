"""Data collators: `collator(features) -> dict[str, torch.Tensor]`, sharing one set of label rules."""

from .packing import PackingCollator, position_ids_from_lengths
from .padding import LeftPaddingCollator, PaddingCollator

__all__ = ["LeftPaddingCollator", "PackingCollator", "PaddingCollator", "position_ids_from_lengths"]
