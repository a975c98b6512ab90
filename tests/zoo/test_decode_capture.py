"""`PPOConfig.logprobs_from_generation` (`hf_rlhf.generation.DecodeCapture`) on every architecture: the log-probs
and value-head values read off the `generate` and `lean` engines' decoding equal the trainer's forward over prompt +
response (what the rollout would otherwise run) to float rounding, and capturing changes no sampled token."""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, PAD_ID, attentions, build, random_sequences

from hf_rlhf.generation import build_engine
from hf_rlhf.models.policy_value import PolicyAndValue, response_logits
from hf_rlhf.tensors import first_true_indices, logprobs_from_logits

TEMPERATURE = 0.7
STOPS = list(range(20, 32))  # frequent enough that rows stop at different steps


def _prompts(repeat: int = 1):
    rows = [r for r in random_sequences([5, 9, 12, 3], seed=1) for _ in range(repeat)]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD_ID] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _sample(engine, model, ids, mask, capture: bool):
    torch.manual_seed(7)
    return engine.generate(model, ids, mask, max_new_tokens=8, do_sample=True, temperature=TEMPERATURE,
                           eos_token_id=STOPS, pad_token_id=PAD_ID, return_logprobs=capture, return_hidden=capture)


def _response_mask(response_ids):
    """1 up to and including the first stop token, as the rollout truncates."""
    stop_at = first_true_indices(torch.isin(response_ids, torch.tensor(STOPS)))
    return (torch.arange(response_ids.shape[1]).unsqueeze(0) <= stop_at.unsqueeze(1)).long()


@pytest.mark.parametrize("backend", ["generate", "lean", "generate_shared"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_decoded_logprobs_and_values_equal_the_forward(model_type, backend):
    attn = "sdpa" if "sdpa" in attentions(model_type) else "eager"
    module = PolicyAndValue(build(model_type, attn=attn)).eval()
    shared = backend == "generate_shared"  # G rows per prompt, the prompt prefilled once
    engine = build_engine("generate" if shared else backend, share_prompts=shared)
    ids, mask = _prompts(repeat=3 if shared else 1)
    with torch.no_grad():
        plain = _sample(engine, module.policy, ids, mask, capture=False)
        out = _sample(engine, module.policy, ids, mask, capture=True)
        assert plain.logprobs is None and plain.hidden is None
        assert torch.equal(out.response_ids, plain.response_ids)  # the hooks change no draw
        response_ids = out.response_ids
        response_mask = _response_mask(response_ids)
        assert 0 < int(response_mask.sum()) < response_mask.numel()  # some rows stopped early
        logits, values, _ = response_logits(module, ids, mask, response_ids, response_mask, temperature=TEMPERATURE)
        expected = logprobs_from_logits(logits, response_ids)
        decoded_values = module.value_head(out.hidden).squeeze(-1).float()
    keep = response_mask.bool()
    assert out.logprobs.shape == response_ids.shape and out.hidden.shape[:2] == response_ids.shape
    assert_close(out.logprobs[keep], expected[keep], atol=2e-5, rtol=1e-5)
    assert_close(decoded_values[keep], values[keep], atol=2e-5, rtol=1e-5)
    # one position off would not pass: the neighbouring step's log-probs are far from these
    assert (out.logprobs[:, 1:] - expected[:, :-1])[keep[:, 1:]].abs().max() > 1e-2


def test_static_engine_returns_no_logprobs():
    model = build("llama").eval()
    engine = build_engine("static", compile=False, bucket=16)
    ids, mask = _prompts()
    out = _sample(engine, model, ids, mask, capture=True)
    assert not engine.supports_capture and out.logprobs is None and out.hidden is None
