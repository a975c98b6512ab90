"""A causal LM's KV cache of prompts, read by later tokens without being extended: KTO's mismatched completions
score against the prompt computed (with gradients) for the matched completions, in a forward without gradients.

`read_only_cache` turns the `DynamicCache` a forward returned into one whose layers return the cached keys and values
followed by the new tokens' but keep none of them (the cache is not grown, so a no-grad forward over it holds one
layer's concatenation at a time, and the tensors the first forward saved for its backward are never written).
`KTOTrainer._prompt_cache_exact` compares, on the model about to be trained, sequences scored that way with the same
sequences run apart.
"""

from __future__ import annotations

import torch

try:  # transformers >= 4.56: caches made of layers
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - an older transformers: the prompt cache is not used
    DynamicCache = DynamicLayer = None


class _ReadOnlyLayer(DynamicLayer or object):
    """A `DynamicLayer` that returns its keys and values with the new tokens' appended, and stores nothing."""

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def read_only_cache(cache):
    """`cache` (a `DynamicCache` of plain, full-attention layers) made read-only, its tensors detached; None for any
    other cache (sliding windows, linear attention, other classes), whose layers this does not know how to read."""
    if DynamicCache is None or type(cache) is not DynamicCache or not getattr(cache, "layers", None):
        return None
    if any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in cache.layers):
        return None
    for layer in cache.layers:
        layer.__class__ = _ReadOnlyLayer
        layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
    return cache
