"""Models: loading (dtype, attention, LoRA / QLoRA), the value head and score reading, adapters, policy + value,
the value adapter, adapter merging and the packing self-check."""
