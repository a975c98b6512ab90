"""`hf_rlhf.training.memory_plan`: the plan's arithmetic on a tiny config, against numbers computed by hand."""

import pytest

from hf_rlhf.training.memory_plan import (
    CHUNK_COPIES,
    LOGITS_COPIES,
    RUNTIME_OVERHEAD,
    SHARED_MASK_COPIES,
    ModelShape,
    PlanOptions,
    plan_memory,
)

# vocabulary 100, hidden 16, intermediate 32, 2 layers, 4 heads of 4, 2 kv heads, tied embeddings
TINY = ModelShape(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=4, tied=True)
R = RUNTIME_OVERHEAD["cpu"]  # a CPU process's growth besides the tensors (60 MiB), in every phase


def parts(plan):
    return {name: size for name, size, _ in plan.parts}


def test_parameter_count_by_hand():
    # a layer: q 16x16 + k, v 16x8 each + o 16x16 = 768; gate, up, down 3 x 16 x 32 = 1536; 2 norms of 16
    assert TINY.layer_params == 768 + 1536 + 32
    assert TINY.params == 100 * 16 + 2 * 2336 + 16  # embedding (tied: no head) + layers + final norm = 6288
    assert TINY.decode_params() == 2 * 2336 + 16 + 1600  # every layer and the (tied) head
    untied = ModelShape(**{**TINY.__dict__, "tied": False})
    assert untied.params == TINY.params + 1600


def test_parameter_count_matches_transformers():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    for config in (LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                   Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert ModelShape.from_config(config).params == sum(p.numel() for p in model.parameters())


def test_sft_plan_by_hand():
    plan = plan_memory(TINY, PlanOptions(command="sft", batch_size=2, seq_len=10, steps=2, optimizer="adamw_torch",
                                         logits_copies=3))
    got = parts(plan)
    assert got["weights"] == 6288 * 4
    assert got["gradients"] == 6288 * 4
    assert got["optimizer state"] == 6288 * 8  # AdamW: two fp32 moments
    # per layer per token: 8 x hidden + 4 x intermediate + k and v (2 x 8) = 272 floats; 20 tokens, 2 layers
    assert got["activations"] == 20 * 2 * 272 * 4
    assert got["logits"] == 20 * 100 * 4 * 3  # 20 rows x vocabulary x fp32 x 3 copies
    assert got["optimizer state"] == 6288 * 8
    assert got["optimizer step temporaries"] == 2 * 4 * 1600  # CPU: 2 copies of the largest parameter (embedding)
    # forward / backward: weights + moments + activations + logits + the LM head's gradient (tied: 100 x 16 x 4)
    assert plan.phases["forward / backward"] == R + 25152 + 50304 + 43520 + 24000 + 6400
    assert plan.phases["end of backward"] == R + 25152 + 50304 + 25152 + 6400
    assert plan.phases["optimizer step"] == R + 25152 + 25152 + 50304 + 12800
    assert plan.peak == R + 149376


def test_first_step_never_holds_moments_and_activations():
    plan = plan_memory(TINY, PlanOptions(command="sft", batch_size=2, seq_len=10, steps=1, optimizer="adamw_torch",
                                         logits_copies=3))
    assert plan.phases["forward / backward"] == R + 25152 + 43520 + 24000 + 6400
    assert plan.peak == plan.phases["optimizer step"] == R + 113408
    cuda = plan_memory(TINY, PlanOptions(command="sft", batch_size=2, seq_len=10, steps=1, device="cuda",
                                         optimizer="adamw_torch", logits_copies=3))
    assert parts(cuda)["optimizer step temporaries"] == 2 * 4 * 6288  # foreach: every parameter at once
    assert "runtime" not in parts(cuda) and cuda.peak == 113408 + 2 * 4 * (6288 - 1600)


def test_fused_adamw_has_no_step_temporaries():
    """transformers' default `adamw_torch_fused` updates in place: the step phase is weights + gradients + state."""
    plan = plan_memory(TINY, PlanOptions(command="sft", batch_size=2, seq_len=10, steps=2))
    assert plan.phases["optimizer step"] == R + 25152 + 25152 + 50304
    assert parts(plan)["optimizer step temporaries"] == 0


def test_checkpointing_chunking_lora_bf16():
    base = PlanOptions(command="sft", batch_size=2, seq_len=10)
    ckpt = parts(plan_memory(TINY, PlanOptions(**{**base.__dict__, "activation_checkpointing": True})))
    assert ckpt["activations"] == 20 * 4 * (2 * 16 + 272)  # each layer's input + one layer recomputed
    chunked = parts(plan_memory(TINY, PlanOptions(**{**base.__dict__, "logits_chunk": 4})))
    assert chunked["logits"] == 4 * 100 * 4 * CHUNK_COPIES  # one chunk of 4 rows, its copies in the backward
    whole = parts(plan_memory(TINY, PlanOptions(**{**base.__dict__, "chunked_head": True})))
    assert whole["logits"] == 20 * 100 * 4 * CHUNK_COPIES  # a small vocabulary: every row fits one chunk
    big = ModelShape(**{**TINY.__dict__, "vocab_size": 2**20})  # 2^25 elements per chunk on the CPU: 32 rows
    long = PlanOptions(**{**base.__dict__, "seq_len": 100, "chunked_head": True})
    assert parts(plan_memory(big, long))["logits"] == 32 * 2**20 * 4 * CHUNK_COPIES
    lora = parts(plan_memory(TINY, PlanOptions(**{**base.__dict__, "lora_r": 2})))
    # r x (in + out) per linear: attention (16+16) + 2 (16+8) + (16+16) = 112, mlp 2 (16+32) + (32+16) = 144
    assert TINY.lora_params(2) == 2 * (112 + 144) * 2
    assert lora["weights"] == 6288 * 4 + 1024 * 4 and lora["gradients"] == 1024 * 4
    assert lora["optimizer state"] == 1024 * 8
    bf16 = parts(plan_memory(TINY, PlanOptions(**{**base.__dict__, "weight_dtype": "bfloat16",
                                                  "compute_dtype": "bfloat16", "optimizer": "adamw_8bit"})))
    assert bf16["weights"] == 6288 * 2 and bf16["gradients"] == 6288 * 2 and bf16["optimizer state"] == 6288 * 2
    assert bf16["activations"] == 20 * 2 * 272 * 2


def test_dpo_reference_and_pairs():
    plan = plan_memory(TINY, PlanOptions(command="dpo", batch_size=1, seq_len=10, logits_positions=4))
    got = parts(plan)
    assert got["reference"] == 6288 * 4  # a frozen copy; none with LoRA
    # chosen and rejected, completion positions only, the copies measured for hf_rlhf's DPOTrainer
    assert got["logits"] == 2 * 4 * 100 * 4 * LOGITS_COPIES["dpo"]
    assert "reference" not in parts(plan_memory(TINY, PlanOptions(command="dpo", seq_len=10, lora_r=2)))


def test_grpo_generation_phase():
    options = PlanOptions(command="grpo", batch_size=1, seq_len=10, logits_positions=6, generation_batch=8,
                          prompt_len=4, completion_len=6, steps=1)
    plan = plan_memory(TINY, options)
    got = parts(plan)
    assert "reference" not in got  # beta = 0
    assert got["kv cache"] == 2 * 2 * 8 * 10 * 8 * 4  # layers x (k, v) x kv_dim x context x sequences x 4 B
    assert got["generation logits"] == 8 * 100 * 4 * 2
    generating = R + 6288 * 4 + got["kv cache"] + got["generation logits"] + got["rollout buffer"]
    assert plan.phases["generating"] == generating
    assert got["rollout buffer"] == 8 * 10 * 16 + 8 * 6 * 16
    assert plan.peak == max(plan.phases.values())
    assert parts(plan_memory(TINY, PlanOptions(**{**options.__dict__, "beta": 0.04})))["reference"] == 6288 * 4


def test_named_shapes_and_errors(tmp_path):
    qwen = ModelShape.load("qwen2.5-0.5b")
    assert round(qwen.params / 1e6) == 494  # Qwen2.5-0.5B's 494M
    assert round(ModelShape.load("smollm2-135m").params / 1e6) == 135
    assert round(ModelShape.load("llama-3.2-1b").params / 1e6) == 1236
    assert ModelShape.load("qwen2.5-0.5b", num_layers=2).num_layers == 2
    with pytest.raises(FileNotFoundError):
        ModelShape.load(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown command"):
        plan_memory(TINY, PlanOptions(command="kto"))


def test_accumulation_holds_every_gradient_and_the_shared_prompt_mask_is_counted():
    one = plan_memory(TINY, PlanOptions(**one_options()))
    accumulated = plan_memory(TINY, PlanOptions(**{**one_options(), "gradient_accumulation_steps": 2}))
    # the later micro-batches' backward: every gradient the earlier ones left, plus the head's fresh one
    assert accumulated.phases["forward / backward"] - one.phases["forward / backward"] == 6288 * 4
    shared = plan_memory(TINY, PlanOptions(**{**one_options(), "prefix_sharing": True}))
    length = 4 + 4 * 8  # the prompt once, then the 4 completions, in one row
    assert parts(shared)["shared-prompt mask"] == SHARED_MASK_COPIES * length**2 * 4
    assert shared.phases["forward / backward"] - one.phases["forward / backward"] == SHARED_MASK_COPIES * length**2 * 4
    single = plan_memory(TINY, PlanOptions(**{**one_options(), "prefix_sharing": True, "batch_size": 1}))
    assert "shared-prompt mask" not in parts(single)  # one row a micro-batch: nothing to share


def one_options() -> dict:
    return dict(command="grpo", batch_size=4, seq_len=12, logits_positions=8, prompt_len=4, completion_len=8,
                generation_batch=8, steps=1, logits_copies=3)
