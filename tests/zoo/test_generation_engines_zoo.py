"""The `static` and `lean` engines give `generate`'s greedy tokens on every architecture (uneven left padding), and
`lean` its sampled tokens for the same seed."""

import pytest
import torch
from zoo_models import MODEL_TYPES, PAD_ID, build, random_sequences

from hf_rlhf.generation import build_engine


def _left_padded(lengths):
    rows = random_sequences(lengths, seed=1)
    width = max(lengths)
    ids = torch.tensor([[PAD_ID] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _greedy(engine, model, ids, mask, new=10):
    return engine.generate(model, ids, mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD_ID).response_ids


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_static_cache_greedy_equals_generate(model_type):
    model = build(model_type)
    static = build_engine("static", compile=False, bucket=16)
    static.check_model(model)  # every zoo architecture is served (a refusal would name it here)
    ids, mask = _left_padded([5, 9, 12, 3])
    assert torch.equal(_greedy(static, model, ids, mask), _greedy(build_engine("generate"), model, ids, mask))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lean_greedy_and_sampled_tokens_equal_generate(model_type):
    model = build(model_type)
    lean, reference = build_engine("lean"), build_engine("generate")
    lean.check_model(model)
    ids, mask = _left_padded([5, 9, 12, 3])
    assert torch.equal(_greedy(lean, model, ids, mask), _greedy(reference, model, ids, mask))
    sampled = []
    for engine in (reference, lean):
        torch.manual_seed(5)
        sampled.append(engine.generate(model, ids, mask, max_new_tokens=10, do_sample=True, temperature=1.2, top_k=40,
                                       top_p=0.95, eos_token_id=None, pad_token_id=PAD_ID).response_ids)
    assert torch.equal(*sampled)


def test_compiled_static_cache_on_llama_compiles_once_per_bucket_and_reads_new_weights():
    model = build("llama")
    static, reference = build_engine("static", bucket=16), build_engine("generate")
    ids, mask = _left_padded([5, 9, 12, 3])
    before = _greedy(static, model, ids, mask)
    assert torch.equal(before, _greedy(reference, model, ids, mask))
    short_ids, short_mask = _left_padded([4, 7, 2, 6])  # another prompt length, same bucket of 16
    assert torch.equal(_greedy(static, model, short_ids, short_mask), _greedy(reference, model, short_ids, short_mask))
    assert static.stats.compiles == 1 and static.stats.compile_seconds > 0
    with torch.no_grad():  # as an optimizer step does: the same parameters, changed in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = _greedy(static, model, ids, mask)
    assert not torch.equal(after, before)
    assert torch.equal(after, _greedy(reference, model, ids, mask))
    assert static.stats.compiles == 1
