"""The `generate` engine's shared prefill (`GenerateEngine(share_prompts=True)`, on with `PPOConfig.prefix_sharing`):
each distinct prompt's KV cache computed once and copied to its rows gives `generate`'s own tokens, greedy and
sampled from the same seed, on every architecture."""

import pytest
import torch
from zoo_models import MODEL_TYPES, PAD_ID, attentions, build, random_sequences

from hf_rlhf.collators import LeftPaddingCollator
from hf_rlhf.generation.engines import GenerateEngine, shared_prompt_cache


def grouped_prompts():
    """Three prompts (lengths 5, 2 and 1), three rows each, interleaved, left-padded."""
    prompts = random_sequences([5, 2, 1], seed=11)
    rows = [prompts[i % 3] for i in range(9)]
    batch = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": p} for p in rows])
    return batch["input_ids"], batch["attention_mask"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_shared_prefill_gives_generates_tokens(model_type, attn):
    if attn not in attentions(model_type):
        pytest.skip(f"{model_type} has no {attn} attention in transformers")
    model = build(model_type, attn=attn)
    query_ids, query_mask = grouped_prompts()
    assert shared_prompt_cache(model, query_ids, query_mask) is not None
    for do_sample in (False, True):
        outputs = []
        for share in (False, True):
            torch.manual_seed(3)
            out = GenerateEngine(share_prompts=share).generate(
                model, query_ids, query_mask, max_new_tokens=6, do_sample=do_sample, temperature=0.9,
                pad_token_id=PAD_ID, eos_token_id=None)
            outputs.append(out.response_ids)
        assert torch.equal(outputs[0], outputs[1]), (do_sample, outputs)
    assert not torch.equal(outputs[0][0], outputs[0][3])  # sampled: a prompt's rows differ (no copy of one row)
    widths = []  # generate starts from the shared cache: its first forward reads only the prompts' last column
    hook = model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True)
    GenerateEngine(share_prompts=True).generate(model, query_ids, query_mask, max_new_tokens=2, do_sample=False,
                                                pad_token_id=PAD_ID, eos_token_id=None)
    hook.remove()
    assert widths[:2] == [(3, query_ids.shape[1] - 1), (9, 1)], widths


def test_distinct_prompts_use_generates_own_prefill():
    model = build("llama")
    ids = torch.tensor(random_sequences([4, 4], seed=1))
    assert shared_prompt_cache(model, ids, torch.ones_like(ids)) is None
