"""Data collators: `collator(features) -> dict[str, torch.Tensor]`, sharing one set of label rules."""

from .packing import PackingCollator, position_ids_from_lengths
from .padding import LeftPaddingCollator, PaddingCollator, position_ids_from_mask
from .pairwise import PairwiseCollator

__all__ = [
    "LeftPaddingCollator", "PackingCollator", "PaddingCollator", "PairwiseCollator", "position_ids_from_lengths",
    "position_ids_from_mask",
]
