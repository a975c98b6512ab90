"""Tiny random-init models of the architectures users bring, built from configs (no download).

Each is 2 layers, hidden 32, the toy tokenizer's vocabulary and special ids (so the trainers can tokenize for
it), fp32, dropout off. `build(model_type, head, attn)` gives a causal LM ("lm") or a one-label
sequence-classification model ("seq_cls"), seeded so that the same call gives the same weights.
"""

from __future__ import annotations

import torch

from hf_rlhf.toy import build_toy_tokenizer

TOKENIZER = build_toy_tokenizer()
VOCAB = len(TOKENIZER)
PAD_ID = TOKENIZER.pad_token_id

COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD_ID, bos_token_id=TOKENIZER.bos_token_id,
              eos_token_id=TOKENIZER.eos_token_id, tie_word_embeddings=False)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)

# model_type -> config kwargs. Sliding windows are small (4) so that they cut into the test sequences.
ARCHITECTURES: dict[str, dict] = {
    "llama": dict(LLAMA_LIKE),
    "mistral": dict(LLAMA_LIKE, sliding_window=4),
    "qwen2": dict(LLAMA_LIKE),
    "qwen3": dict(LLAMA_LIKE, head_dim=16),
    "gemma2": dict(LLAMA_LIKE, head_dim=16, sliding_window=4, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, query_pre_attn_scalar=16),
    "phi3": dict(LLAMA_LIKE),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
                 summary_first_dropout=0.0),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                max_position_embeddings=128, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
    "qwen2_moe": dict(LLAMA_LIKE, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
}
MODEL_TYPES = list(ARCHITECTURES)
# transformers implements these only with eager attention (an sdpa request is refused when the model is built)
EAGER_ONLY = {"gemma2"}


def attentions(model_type: str) -> list[str]:
    """The attention implementations transformers offers on CPU for `model_type` ("sdpa", "eager")."""
    return ["eager"] if model_type in EAGER_ONLY else ["sdpa", "eager"]


def build_config(model_type: str, attn: str = "eager", num_labels: int | None = None):
    from transformers import AutoConfig

    kwargs = dict(COMMON, **ARCHITECTURES[model_type])
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = attn
    return config


def build(model_type: str, head: str = "lm", attn: str | None = None, seed: int = 0):
    """A seeded fp32 model in eval mode: head "lm" (causal LM) or "seq_cls" (one-label reward model).

    attn: "sdpa" or "eager"; None: the first of `attentions(model_type)`.
    """
    attn = attn or attentions(model_type)[0]
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = build_config(model_type, attn, num_labels=1 if head == "seq_cls" else None)
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, attn_implementation=attn, dtype=torch.float32)
    if head == "lm":
        model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def random_sequences(lengths, seed: int = 0) -> list[list[int]]:
    """Token lists of the given lengths, ids drawn from the non-special part of the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
