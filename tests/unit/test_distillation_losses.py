"""hf_rlhf.losses.distillation against hand-computed values and against trl's own functions on the same tensors."""

import math

import pytest
import torch
from trl.experimental.gkd.gkd_trainer import GKDTrainer
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

from hf_rlhf.losses.distillation import (
    chunked_divergence,
    divergence_per_element,
    generalized_jsd_loss,
    reduce_divergence,
    token_divergence,
)

# p_s = (0.1, 0.9), p_t = (0.9, 0.1): both KLs are 0.8 ln 9; the JSD at beta 0.5 against m = (0.5, 0.5) is
# 0.9 ln 1.8 + 0.1 ln 0.2 (the same for both sides by symmetry)
STUDENT = torch.log(torch.tensor([[0.1, 0.9]], dtype=torch.float64))
TEACHER = torch.log(torch.tensor([[0.9, 0.1]], dtype=torch.float64))


@pytest.mark.parametrize(("beta", "expected"), [(0.0, 0.8 * math.log(9)), (1.0, 0.8 * math.log(9)),
                                                (0.5, 0.9 * math.log(1.8) + 0.1 * math.log(0.2))])
def test_hand_computed_divergences(beta, expected):
    divergence, entropy = token_divergence(STUDENT, TEACHER, beta)
    torch.testing.assert_close(divergence, torch.tensor([expected], dtype=torch.float64))
    torch.testing.assert_close(entropy, torch.tensor([-(0.1 * math.log(0.1) + 0.9 * math.log(0.9))],
                                                     dtype=torch.float64))


def test_forward_and_reverse_kl_are_the_two_directions():
    student = torch.log(torch.tensor([[0.2, 0.8]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[0.6, 0.4]], dtype=torch.float64))
    forward = 0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.8)  # KL(p_t || p_s)
    reverse = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)  # KL(p_s || p_t)
    torch.testing.assert_close(token_divergence(student, teacher, 0.0)[0].item(), forward)
    torch.testing.assert_close(token_divergence(student, teacher, 1.0)[0].item(), reverse)
    # beta 0.25: m = 0.75 p_s + 0.25 p_t
    m = [0.75 * 0.2 + 0.25 * 0.6, 0.75 * 0.8 + 0.25 * 0.4]
    jsd = 0.25 * (0.6 * math.log(0.6 / m[0]) + 0.4 * math.log(0.4 / m[1])) + 0.75 * (
        0.2 * math.log(0.2 / m[0]) + 0.8 * math.log(0.8 / m[1]))
    torch.testing.assert_close(token_divergence(student, teacher, 0.25)[0].item(), jsd)


def test_temperature_divides_both_logits():
    student, teacher = torch.tensor([[2.0, 0.0]], dtype=torch.float64), torch.tensor([[0.0, 2.0]], dtype=torch.float64)
    # at T = 2 the logits are (1, 0) and (0, 1): p_s = (e/(1+e), 1/(1+e)), p_t reversed
    p = math.e / (1 + math.e)
    expected = p * math.log(p / (1 - p)) + (1 - p) * math.log((1 - p) / p)
    torch.testing.assert_close(token_divergence(student, teacher, 0.0, temperature=2.0)[0].item(), expected)


def test_masked_reduction_and_num_items():
    divergence = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(reduce_divergence(divergence, mask), torch.tensor(7.0 / 3))
    torch.testing.assert_close(reduce_divergence(divergence, mask, num_items_in_batch=torch.tensor(14.0)),
                               torch.tensor(0.5))
    torch.testing.assert_close(reduce_divergence(divergence, torch.zeros_like(mask)), torch.tensor(0.0))


@pytest.fixture
def logits():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 11, generator=generator), torch.randn(2, 4, 11, generator=generator),
            torch.tensor([[-100, 1, 2, 3], [-100, -100, 4, -100]]))


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_labels", [False, True])
def test_equals_trl_generalized_jsd_loss(logits, beta, temperature, use_labels):
    student, teacher, labels = logits
    labels = labels if use_labels else None
    for reduction in ("batchmean", "sum", "mean", "none"):
        ours = generalized_jsd_loss(student, teacher, labels, beta, temperature, reduction)
        theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta, temperature, reduction)
        torch.testing.assert_close(ours, theirs)
    ours = generalized_jsd_loss(student, teacher, labels, beta, temperature, num_items_in_batch=torch.tensor(9))
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta, temperature,
                                             num_items_in_batch=torch.tensor(9))
    torch.testing.assert_close(ours, theirs)


def _heads(vocab=13, hs=6, ht=10, n=9, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hs, generator=generator, dtype=torch.float64, requires_grad=True),
            torch.randn(vocab, hs, generator=generator, dtype=torch.float64, requires_grad=True),
            torch.randn(vocab, generator=generator, dtype=torch.float64),
            torch.randn(n, ht, generator=generator, dtype=torch.float64),
            torch.randn(vocab, ht, generator=generator, dtype=torch.float64))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk_size", [2, 4, 64])
def test_chunked_equals_full_logits_and_trl_kernel(beta, chunk_size):
    """Values and gradients: chunked == full logits == trl 1.16's `ChunkedDivergenceFunction` (its torch path)."""
    h_s, w_s, b_s, h_t, w_t = _heads()
    temperature = 0.8
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0, 1], dtype=torch.float64)

    def loss_of(divergence):
        return (divergence * mask).sum() / mask.sum()

    ours, entropy = chunked_divergence(h_s, h_t, lambda h: h @ w_s.T + b_s, lambda h: h @ w_t.T, beta,
                                       temperature, chunk_size)
    grads = torch.autograd.grad(loss_of(ours), (h_s, w_s))
    full, full_entropy = token_divergence(h_s @ w_s.T + b_s, h_t @ w_t.T, beta, temperature)
    torch.testing.assert_close(ours, full)
    torch.testing.assert_close(entropy, full_entropy)
    torch.testing.assert_close(grads, torch.autograd.grad(loss_of(full), (h_s, w_s)))
    theirs, their_entropy = ChunkedDivergenceFunction.apply(h_s.float(), w_s.float(), b_s.float(), h_t.float(),
                                                            w_t.float(), None, beta, temperature)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.float(), their_entropy, rtol=1e-5, atol=1e-5)


def test_chunked_softcap_and_scale_match_the_transformed_logits():
    h_s, w_s, _, h_t, w_t = _heads(seed=2)

    def capped(h):  # Gemma 2's soft cap after a logit scale, as the model's logits
        return 5.0 * torch.tanh(0.5 * (h @ w_s.T) / 5.0)

    ours, _ = chunked_divergence(h_s, h_t, capped, lambda h: h @ w_t.T, 0.5, 1.0, 3)
    theirs, _ = ChunkedDivergenceFunction.apply(h_s.float(), w_s.float(), None, h_t.float(), w_t.float(), None, 0.5,
                                                1.0, 0.5, 5.0)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-5, atol=1e-5)


def test_teacher_gets_no_gradient_and_empty_input_still_backpropagates():
    h_s, w_s, _, h_t, w_t = _heads()
    w_t.requires_grad_(True)
    divergence, _ = chunked_divergence(h_s, h_t, lambda h: h @ w_s.T, lambda h: h @ w_t.T, 1.0, 1.0, 4)
    divergence.sum().backward()
    assert w_t.grad is None and w_s.grad is not None and w_s.grad.abs().sum() > 0
    empty, _ = chunked_divergence(h_s[:0], h_t[:0], lambda h: h @ w_s.T, lambda h: h @ w_t.T, 1.0)
    assert empty.shape == (0,)
    reduce_divergence(empty, torch.ones(0)).backward()  # a zero-token micro-batch still has a backward


def test_identical_models_have_zero_divergence_and_beta_is_checked():
    h_s, w_s, _, _, _ = _heads()
    for beta in (0.0, 0.5, 1.0):
        divergence, _ = chunked_divergence(h_s, h_s.detach(), lambda h: h @ w_s.T, lambda h: h @ w_s.T, beta)
        torch.testing.assert_close(divergence, torch.zeros_like(divergence))
    with pytest.raises(ValueError, match="beta"):
        chunked_divergence(h_s, h_s, lambda h: h @ w_s.T, lambda h: h @ w_s.T, 1.5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hand_gradient_equals_autograd_through_trls_formula(beta, temperature):
    """token_divergence's hand-written gradient (any per-position weights) equals autograd through TRL's op-for-op
    formula, in float64, and passes torch's gradcheck."""
    torch.manual_seed(0)
    student = (torch.randn(5, 11, dtype=torch.float64) * 3).requires_grad_()
    teacher = torch.randn(5, 11, dtype=torch.float64) * 3
    weights = torch.rand(5, dtype=torch.float64)
    divergence, _ = token_divergence(student, teacher, beta, temperature)
    (divergence * weights).sum().backward()
    reference = student.detach().clone().requires_grad_()
    terms = divergence_per_element(torch.log_softmax(reference / temperature, -1),
                                   torch.log_softmax(teacher / temperature, -1), beta).sum(-1)
    (terms * weights).sum().backward()
    torch.testing.assert_close(divergence, terms, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(student.grad, reference.grad, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: token_divergence(z, teacher, beta, temperature)[0],
                                    (student.detach().clone().requires_grad_(),))


def test_hand_gradient_keeps_the_logits_dtype():
    student = torch.randn(3, 7, dtype=torch.bfloat16, requires_grad=True)
    divergence, entropy = token_divergence(student, torch.randn(3, 7, dtype=torch.bfloat16), 0.5)
    assert divergence.dtype == torch.float32 and not entropy.requires_grad
    divergence.sum().backward()
    assert student.grad.dtype == torch.bfloat16 and torch.isfinite(student.grad.float()).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(("scale", "softcap", "temperature", "bias"),
                         [(1.0, None, 1.0, False), (0.5, 3.0, 0.7, True)])
def test_linear_head_divergence_equals_autograd_through_the_full_logits(beta, scale, softcap, temperature, bias):
    """linear_head_divergence (chunks of 3 tokens, grads worked out in the forward) = token_divergence on the full
    logits: the sum, per-token values, entropy, and the gradients to the hidden states, weight and bias, also when
    the sum is scaled (as the trainer divides it by the step's tokens)."""
    from hf_rlhf.losses.distillation import linear_head_divergence

    torch.manual_seed(1)
    h_s, h_t = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    w_s, w_t = torch.randn(13, 5, dtype=torch.float64), torch.randn(13, 4, dtype=torch.float64)
    b_s = torch.randn(13, dtype=torch.float64) if bias else None

    def final(z):
        z = z * scale
        return z if softcap is None else softcap * torch.tanh(z / softcap)

    leaves = [t.clone().requires_grad_() for t in (h_s, w_s) + ((b_s,) if bias else ())]
    full, full_entropy = token_divergence(final(leaves[0] @ leaves[1].T + (leaves[2] if bias else 0)),
                                          final(h_t @ w_t.T), beta, temperature)
    (full.sum() / 3).backward()
    mine = [t.clone().requires_grad_() for t in (h_s, w_s) + ((b_s,) if bias else ())]
    total, divergence, entropy = linear_head_divergence(mine[0], mine[1], mine[2] if bias else None, h_t,
                                                        lambda h: final(h @ w_t.T), beta, temperature, scale,
                                                        softcap, chunk_size=3)
    (total / 3).backward()
    torch.testing.assert_close(total, full.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(divergence, full.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, full_entropy, rtol=1e-12, atol=1e-12)
    assert not divergence.requires_grad
    for got, expected in zip(mine, leaves):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-10, atol=1e-12)
