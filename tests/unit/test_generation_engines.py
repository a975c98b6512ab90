"""The rollout's generation engines (`hf_rlhf.generation`): `static` gives `generate`'s tokens, reads live weights."""

import pytest
import torch

from hf_rlhf.generation import GenerationOutput, build_engine
from hf_rlhf.toy import build_toy_model, make_tasks
from hf_rlhf.trainers.ppo_config import PPOConfig


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def _prompts(tokenizer, n=6, seed=3):
    """(ids, mask) of n left-padded toy prompts of different lengths."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer([r["prompt"] for r in make_tasks(n, seed=seed)], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    assert len(set(enc["attention_mask"].sum(1).tolist())) > 1  # the rows really are padded differently
    return enc["input_ids"], enc["attention_mask"]


def _generate(engine, model, tokenizer, ids, mask, **kw):
    options = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    options.update(kw)
    out = engine.generate(model, ids, mask, **options)
    assert isinstance(out, GenerationOutput) and out.response_ids.shape == (ids.shape[0], options["max_new_tokens"])
    return out.response_ids


def test_static_cache_greedy_and_sampled_tokens_equal_generate(tokenizer, tiny_model):
    ids, mask = _prompts(tokenizer)
    reference, static = build_engine("generate"), build_engine("static", compile=False, bucket=16)
    assert ids.shape[1] % 16  # the static engine really pads the prompts to its bucket
    assert torch.equal(_generate(static, tiny_model, tokenizer, ids, mask),
                       _generate(reference, tiny_model, tokenizer, ids, mask))
    sampled = []
    for engine in (reference, static):
        torch.manual_seed(7)
        sampled.append(_generate(engine, tiny_model, tokenizer, ids, mask, do_sample=True, temperature=1.3, top_k=20,
                                 top_p=0.9))
    assert torch.equal(*sampled)  # same logits, same random draws
    assert static.stats.calls == 2 and static.stats.new_tokens == 2 * ids.shape[0] * 8
    assert static.stats.compiles == 0  # compile=False: no compile


def test_an_optimizer_step_is_seen_by_the_next_generation(tokenizer):
    model = build_toy_model(tokenizer, "tiny", seed=0).eval()
    ids, mask = _prompts(tokenizer)
    static, reference = build_engine("static", compile=False), build_engine("generate")
    before = _generate(static, model, tokenizer, ids, mask)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    logits[:, before[:, 0]].sum().neg().backward()  # push away from the tokens it chose first
    optimizer.step()
    static.sync_weights(model)  # the documented hook: a no-op for an in-process engine
    after = _generate(static, model, tokenizer, ids, mask)
    assert not torch.equal(after, before)
    assert torch.equal(after, _generate(reference, model, tokenizer, ids, mask))


def test_unknown_backend_and_unsupported_model_are_refused_by_name(tmp_path, tiny_model):
    expected = r"generation_backend='vllm'; expected one of \['generate', 'static', 'lean'\]"
    with pytest.raises(ValueError, match=expected):
        PPOConfig(output_dir=str(tmp_path), generation_backend="vllm", report_to="none")
    assert PPOConfig(output_dir=str(tmp_path), generation_backend="static", report_to="none")
    tiny_model._can_compile_fullgraph = False  # as transformers marks a model without static-cache support
    try:
        with pytest.raises(ValueError, match=r"generation_backend='static' cannot serve .*model_type="):
            build_engine("static").check_model(tiny_model)
    finally:
        del tiny_model._can_compile_fullgraph
    build_engine("static").check_model(tiny_model)


def test_static_cache_on_a_lora_policy_equals_generate(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_toy_model(tokenizer, "tiny", seed=0),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    ids, mask = _prompts(tokenizer)
    static = build_engine("static", compile=False)
    static.check_model(model)  # looks through the peft wrapper
    with_adapter = _generate(static, model, tokenizer, ids, mask)
    assert torch.equal(with_adapter, _generate(build_engine("generate"), model, tokenizer, ids, mask))
    with model.disable_adapter():
        assert not torch.equal(_generate(static, model, tokenizer, ids, mask), with_adapter)  # the adapter is used


def _stop_tokens(engine, model, tokenizer, ids, mask, **kw):
    """Two tokens the reference samples at different steps of different rows: as eos they stop rows unevenly."""
    torch.manual_seed(11)
    tokens = _generate(engine, model, tokenizer, ids, mask, max_new_tokens=12, **kw)
    return [int(tokens[0, 2]), int(tokens[-1, 5])]


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=1.3, top_k=20, top_p=0.9),
                                      dict(do_sample=True, temperature=0.7, top_k=5), dict(do_sample=True, top_p=0.8)])
def test_lean_tokens_and_random_stream_equal_generate(tokenizer, tiny_model, sampling):
    """Greedy and sampled (same seed) tokens, rows stopping at eos at different steps, uneven left padding; the random
    stream is left where generate leaves it (the next draw is equal too)."""
    ids, mask = _prompts(tokenizer)
    reference, lean = build_engine("generate"), build_engine("lean")
    eos = _stop_tokens(reference, tiny_model, tokenizer, ids, mask, **sampling)
    for eos_token_id in (None, eos):
        outputs = []
        for engine in (reference, lean):
            torch.manual_seed(7)
            out = engine.generate(tiny_model, ids, mask, max_new_tokens=12, eos_token_id=eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **sampling)
            assert out.logprobs is None
            outputs.append((out.response_ids, torch.rand(3)))
        (expected, next_draw), (got, lean_next_draw) = outputs
        assert torch.equal(got, expected) and torch.equal(lean_next_draw, next_draw)
        if eos_token_id is not None:  # rows really stopped at different steps, and were padded after eos
            stopped_at = [next((i for i, t in enumerate(row.tolist()) if t in eos), None) for row in expected]
            assert len(set(stopped_at)) > 1, stopped_at
            assert (expected == tokenizer.pad_token_id).any()
    assert lean.stats.calls == 2


def test_lean_stops_when_every_row_has_finished(tokenizer, tiny_model):
    ids, mask = _prompts(tokenizer)
    reference = build_engine("generate")
    first = _generate(reference, tiny_model, tokenizer, ids, mask, max_new_tokens=12)
    eos = sorted(set(first[:, :4].flatten().tolist()))  # every row emits one of these within 4 steps
    outs = [engine.generate(tiny_model, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                            pad_token_id=tokenizer.pad_token_id).response_ids for engine in (reference,
                                                                                             build_engine("lean"))]
    assert outs[0].shape[1] < 12 and torch.equal(outs[1], outs[0])


def test_lean_on_a_lora_policy_equals_generate(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_toy_model(tokenizer, "tiny", seed=0),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    ids, mask = _prompts(tokenizer)
    lean = build_engine("lean")
    lean.check_model(model)  # looks through the peft wrapper
    sampled = []
    for engine in (build_engine("generate"), lean):
        torch.manual_seed(3)
        sampled.append(_generate(engine, model, tokenizer, ids, mask, do_sample=True, temperature=0.9, top_k=30))
    assert torch.equal(*sampled)
    with_adapter = _generate(lean, model, tokenizer, ids, mask)
    assert torch.equal(with_adapter, _generate(build_engine("generate"), model, tokenizer, ids, mask))
    with model.disable_adapter():
        assert not torch.equal(_generate(lean, model, tokenizer, ids, mask), with_adapter)  # the adapter is used


def test_lean_refuses_options_it_does_not_implement_by_name(tmp_path, tokenizer, tiny_model):
    """At config time for generation_kwargs; at the first rollout for the model's generation_config."""
    for kwargs, name in ((dict(repetition_penalty=1.2), "repetition_penalty"), (dict(num_beams=2), "num_beams"),
                         (dict(min_new_tokens=3), "min_new_tokens")):
        with pytest.raises(ValueError, match=rf"generation_backend='lean' does not implement .*{name}.*"
                                             r"generation_backend='generate'"):
            PPOConfig(output_dir=str(tmp_path), generation_backend="lean", generation_kwargs=kwargs, report_to="none")
        PPOConfig(output_dir=str(tmp_path), generation_backend="generate", generation_kwargs=kwargs, report_to="none")
    ids, mask = _prompts(tokenizer)
    lean = build_engine("lean")
    with pytest.raises(ValueError, match=r"does not implement .*num_beams"):
        _generate(lean, tiny_model, tokenizer, ids, mask, generation_kwargs=dict(num_beams=2))
    before = tiny_model.generation_config.repetition_penalty
    tiny_model.generation_config.repetition_penalty = 1.3  # as a hub model's generation_config may set it
    try:
        with pytest.raises(ValueError, match=r"RepetitionPenaltyLogitsProcessor.*generation_backend='generate'"):
            _generate(lean, tiny_model, tokenizer, ids, mask)
    finally:
        tiny_model.generation_config.repetition_penalty = before
    _generate(lean, tiny_model, tokenizer, ids, mask)


@pytest.mark.parametrize("backend", ["generate", "lean", "static"])
def test_no_kv_cache_outlives_the_generation_call(tokenizer, tiny_model, backend):
    """The KV cache is sized to the call and freed when it returns (the `static` engine's pre-allocated cache
    included): between rollouts the training step holds no cache (issue 41's KV-cache lever)."""
    import gc
    import weakref

    from transformers.cache_utils import Cache

    created = []
    init = Cache.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(weakref.ref(self))

    ids, mask = _prompts(tokenizer)
    engine = build_engine(backend, **({"compile": False, "bucket": 16} if backend == "static" else {}))
    Cache.__init__ = tracking_init
    try:
        _generate(engine, tiny_model, tokenizer, ids, mask, do_sample=True, temperature=1.0)
    finally:
        Cache.__init__ = init
    gc.collect()
    assert created, "no KV cache was built: the check saw nothing"
    assert all(ref() is None for ref in created), f"{backend}: a KV cache is still referenced after generate"


def test_beam_search_skips_the_shared_prompt_cache_and_the_capture(tokenizer, tiny_model):
    # TRL's generation_kwargs={"num_beams": 2, ...}: generate runs 2 rows per prompt, so the cache prefilled with one
    # row per prompt (prefix sharing) and the log-probs off the decoding do not fit; both are skipped, the tokens are
    # generate's own
    ids, mask = _prompts(tokenizer, n=3)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # 2 rows per prompt: a shared prefill
    beams = {"num_beams": 2, "length_penalty": -0.1}
    shared, plain = build_engine("generate", share_prompts=True), build_engine("generate")
    expected = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=None, **beams)[:, ids.shape[1]:]
    for engine in (shared, plain):
        out = engine.generate(tiny_model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id, generation_kwargs=beams, return_logprobs=True)
        assert torch.equal(out.response_ids, expected) and out.logprobs is None
    torch.manual_seed(0)  # sampled beams (TRL's test: do_sample, top_k, num_beams, length_penalty) run too
    out = shared.generate(tiny_model, ids, mask, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id,
                          generation_kwargs={"do_sample": True, "top_k": 50, **beams})
    assert out.response_ids.shape == (6, 8)
    with pytest.raises(ValueError, match="num_return_sequences must be 1"):
        PPOConfig(output_dir="unused", generation_kwargs={"num_return_sequences": 2})
