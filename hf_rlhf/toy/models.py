"""Tiny Llama-style models built from a config, randomly initialised and seeded (no download).

"tiny" is for unit tests (a forward and backward of 8 short rows takes a few ms); "small" is
what the recipes train from scratch on CPU, sized so a short SFT run learns the toy tasks only
in part (see `hf_rlhf.toy.tasks`).
"""

from __future__ import annotations

SIZES = {
    # hidden, layers, heads, mlp
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
    "small": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384
    ),
}


def toy_model_config(tokenizer, size: str = "tiny"):
    """A `LlamaConfig` whose vocabulary and special ids come from `tokenizer`."""
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max(256, tokenizer.model_max_length),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # the vocabulary is ~100 characters, so untied heads cost almost nothing
        tie_word_embeddings=False,
        attention_dropout=0.0,
        **SIZES[size],
    )


def _seeded(build, seed: int):
    import torch

    # fork the RNG so building a model does not move the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().float()


def build_toy_model(tokenizer, size: str = "tiny", seed: int = 0, attn_implementation: str = "sdpa"):
    """A randomly initialised `LlamaForCausalLM` in fp32, identical for identical seeds."""
    from transformers import LlamaForCausalLM

    config = toy_model_config(tokenizer, size)
    config._attn_implementation = attn_implementation
    model = _seeded(lambda: LlamaForCausalLM(config), seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_toy_reward_model(tokenizer, size: str = "tiny", seed: int = 0):
    """A randomly initialised `LlamaForSequenceClassification` with one label (the reward)."""
    from transformers import LlamaForSequenceClassification

    config = toy_model_config(tokenizer, size)
    config.num_labels = 1
    # the score is read at the last non-pad token, which needs pad_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return _seeded(lambda: LlamaForSequenceClassification(config), seed)


def keep_layers(model, layers: list[int]):
    """A copy of a toy `LlamaForCausalLM` with only the decoder `layers` (by index, in order): a smaller student that
    starts from the teacher's own weights (DistilBERT's initialisation, Sanh et al. 2019, every other layer).

    Embeddings, final norm and LM head are copied as they are; each kept layer's attention is renumbered for the KV
    cache.
    """
    import copy

    import torch

    if not layers or sorted(set(layers)) != list(layers) or layers[-1] >= model.config.num_hidden_layers:
        raise ValueError(f"layers must be increasing indices below {model.config.num_hidden_layers}, got {layers}")
    student = copy.deepcopy(model)
    student.model.layers = torch.nn.ModuleList([student.model.layers[i] for i in layers])
    for index, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = index
    student.config.num_hidden_layers = len(layers)
    return student
