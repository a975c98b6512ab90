"""The chunked LM head (`hf_rlhf.losses.chunked_head`) against the full logits, values and gradients."""

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.losses.chunked_head import chunked_token_logprobs, module_token_logprobs
from hf_rlhf.tensors import entropy_from_logits, logprobs_from_logits

N, H, V = 7, 5, 11


def tensors(dtype=torch.float64, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator, dtype=dtype).requires_grad_()
    weight = (2 * torch.randn(V, H, generator=generator, dtype=dtype)).requires_grad_()
    b = torch.randn(V, generator=generator, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(V, (N,), generator=generator)
    return hidden, weight, b, labels


def plain(hidden, weight, bias, labels, scale=1.0, softcap=None, temperature=1.0):
    """The full-logits path: the model's logits, then `logprobs_from_logits` / `entropy_from_logits`."""
    z = torch.nn.functional.linear(hidden, weight, bias) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    return logprobs_from_logits(z[None], labels[None])[0], entropy_from_logits(z[None])[0], z.argmax(-1) == labels


OPTIONS = [dict(), dict(scale=0.0625), dict(softcap=3.0), dict(temperature=0.7),
           dict(scale=2.0, softcap=5.0, temperature=1.3)]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("chunk_size", [1, 3, N, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_the_full_logits(options, chunk_size, bias):
    inputs = tensors(bias=bias)
    want_lp, want_h, want_top1 = plain(*inputs, **options)
    got_lp, got_h, got_top1, *_ = chunked_token_logprobs(*inputs, chunk_size=chunk_size, with_entropy=True,
                                                     with_top1=True, **options)
    assert_close(got_lp, want_lp)
    assert_close(got_h, want_h)
    assert torch.equal(got_top1, want_top1)
    weights = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    params = [t for t in inputs[:3] if t is not None]
    want = torch.autograd.grad((want_lp * weights[0]).sum() + (want_h * weights[1]).sum(), params)
    got = torch.autograd.grad((got_lp * weights[0]).sum() + (got_h * weights[1]).sum(), params)
    for g, w in zip(got, want):
        assert_close(g, w)


@pytest.mark.parametrize("options", OPTIONS)
def test_gradcheck_float64(options):
    hidden, weight, bias, labels = tensors()

    def f(h, w, b):
        lp, entropy, *_ = chunked_token_logprobs(h, w, b, labels, chunk_size=3, with_entropy=True, **options)
        return lp, entropy

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_logprobs_only_and_frozen_weight():
    """Without entropy, and with a head that does not train (LoRA's frozen base): only the hidden states' gradient."""
    hidden, weight, _, labels = tensors(bias=False)
    weight = weight.detach()
    lp, entropy, top1, *_ = chunked_token_logprobs(hidden, weight, None, labels, chunk_size=2)
    assert entropy is None and top1 is None
    (got,) = torch.autograd.grad(lp.sum(), hidden)
    (want,) = torch.autograd.grad(plain(hidden, weight, None, labels)[0].sum(), hidden)
    assert_close(got, want)


def test_float32_within_1e5():
    hidden, weight, bias, labels = tensors(torch.float32)
    want_lp, want_h, _ = plain(hidden, weight, bias, labels, softcap=4.0)
    got_lp, got_h, *_ = chunked_token_logprobs(hidden, weight, bias, labels, softcap=4.0, chunk_size=2,
                                              with_entropy=True)
    assert got_lp.dtype == torch.float32
    assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)
    assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(got_lp.sum() + got_h.sum(), (hidden, weight, bias))
    want = torch.autograd.grad(want_lp.sum() + want_h.sum(), (hidden, weight, bias))
    for g, w in zip(got, want):
        assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_no_tokens():
    """An empty selection (a micro-batch with no trained token) gives empty outputs and zero gradients."""
    hidden, weight, bias, _ = tensors()
    lp, entropy, top1, *_ = chunked_token_logprobs(hidden[:0], weight, bias, torch.zeros(0, dtype=torch.long),
                                               with_entropy=True, with_top1=True)
    assert lp.shape == entropy.shape == top1.shape == (0,)
    grads = torch.autograd.grad(lp.sum(), (hidden, weight, bias))
    assert all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("options", OPTIONS[:3])
def test_any_head_module_under_checkpoint(options):
    """`module_token_logprobs`: the head as a module (a LoRA-wrapped head, say), values and gradients as the full
    logits, its own parameters included."""
    hidden, weight, bias, labels = tensors()

    class Lora(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(H, V, dtype=torch.float64)
            self.a = torch.nn.Parameter(torch.randn(2, H, dtype=torch.float64))
            self.b = torch.nn.Parameter(torch.randn(V, 2, dtype=torch.float64))

        def forward(self, x):
            return self.base(x) + x @ self.a.t() @ self.b.t()

    head = Lora()
    z = head(hidden) * options.get("scale", 1.0)
    cap = options.get("softcap")
    z = cap * torch.tanh(z / cap) if cap else z
    want_lp, want_h = logprobs_from_logits(z[None], labels[None])[0], entropy_from_logits(z[None])[0]
    got_lp, got_h, *_ = module_token_logprobs(hidden, head, labels, V, chunk_size=3, with_entropy=True, **options)
    assert_close(got_lp, want_lp)
    assert_close(got_h, want_h)
    params = [hidden, *head.parameters()]
    for g, w in zip(torch.autograd.grad(got_lp.sum() + got_h.sum(), params),
                    torch.autograd.grad(want_lp.sum() + want_h.sum(), params)):
        assert_close(g, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_against_the_full_logits(dtype):
    """On a GPU, a real vocabulary in several chunks: float32 within 1e-5 of the full logits (TF32 off); bfloat16
    weights within bfloat16's rounding of the float32 logits of the same weights."""
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 300, 64, 50_000
    hidden = torch.randn(n, h, device="cuda", generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=generator) / 8).to(dtype).requires_grad_()
    labels = torch.randint(v, (n,), device="cuda", generator=generator)
    want_lp, want_h, _ = plain(hidden.float(), weight.float(), None, labels, softcap=30.0, temperature=0.7)
    got_lp, got_h, *_ = chunked_token_logprobs(hidden, weight, None, labels, softcap=30.0, temperature=0.7,
                                              chunk_size=128, with_entropy=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    assert_close(got_lp, want_lp, **tol)
    assert_close(got_h, want_h, **tol)
    for g, w in zip(torch.autograd.grad(got_lp.sum() + got_h.sum(), (hidden, weight)),
                    torch.autograd.grad(want_lp.sum() + want_h.sum(), (hidden, weight))):
        assert_close(g.float(), w.float(), **tol)


@pytest.mark.parametrize("chunk_size", [2, 100])
def test_moments_and_empty_outputs(chunk_size):
    """`with_moments`: the mean logit and log Σ p² of each token (DPO's `logits/*` metrics and WPO's weights), from
    the Function and from a head module; outputs not asked for are None."""
    hidden, weight, bias, labels = tensors()
    z = torch.nn.functional.linear(hidden, weight, bias).detach() * 0.5
    want_mean, want_sq = z.mean(-1), torch.logsumexp(2 * z.log_softmax(-1), dim=-1)
    head = torch.nn.Linear(H, V, dtype=torch.float64)
    head.weight.data, head.bias.data = weight.detach(), bias.detach()
    for scores in (chunked_token_logprobs(hidden, weight, bias, labels, scale=0.5, chunk_size=chunk_size,
                                          with_moments=True),
                   module_token_logprobs(hidden, head, labels, V, scale=0.5, chunk_size=chunk_size,
                                         with_moments=True)):
        assert scores.entropy is None and scores.top1 is None
        assert_close(scores.mean_logits, want_mean)
        assert_close(scores.log_sum_sq, want_sq)
