"""Masked statistics, log-probabilities and entropy from logits (`hf_rlhf.tensors`), against hand values."""

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import hf_rlhf
from hf_rlhf import tensors
from hf_rlhf.tensors import (
    entropy_from_logits,
    first_true_indices,
    left_padding,
    length_sorted_chunks,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    padding_bounds,
    rejoin_chunks,
)

X = torch.tensor([1.0, 2.0, 3.0, 100.0])
MASK = torch.tensor([1, 1, 1, 0])


def test_masked_mean_sum_var_by_hand():
    assert_close(masked_mean(X, MASK), torch.tensor(2.0))
    assert_close(masked_sum(X, MASK), torch.tensor(6.0))
    assert_close(masked_var(X, MASK), torch.tensor(1.0))  # ((-1)² + 0² + 1²) / (3 - 1)
    assert_close(masked_var(X, MASK, unbiased=False), torch.tensor(2.0 / 3.0))


def test_masked_reductions_along_a_dim():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0]))
    assert_close(masked_sum(x, mask, dim=1), torch.tensor([3.0, 15.0]))
    assert_close(masked_mean(x, mask, dim=0), torch.tensor([2.5, 3.5, 6.0]))


def test_bool_and_float_masks_agree_and_padding_garbage_never_leaks():
    x = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    for mask in (MASK.bool(), MASK.float()):
        assert_close(masked_mean(x, mask), torch.tensor(2.0))
        assert_close(masked_var(x, mask), torch.tensor(1.0))
        whitened = masked_whiten(x, mask)
        assert torch.isfinite(whitened).all() and whitened[3] == 0


def test_empty_mask_mean_is_nan_and_var_needs_enough_elements():
    assert masked_mean(X, torch.zeros(4)).isnan()
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, torch.tensor([1, 0, 0, 0]))
    with pytest.raises(ValueError, match="keeps 0"):
        masked_var(X, torch.zeros(4), unbiased=False)


def test_masked_whiten_by_hand():
    # mean 2, unbiased var 1 -> (x - 2) / 1 on the mask, 0 outside
    assert_close(masked_whiten(X, MASK), torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    assert_close(masked_whiten(X, MASK, shift_mean=False), torch.tensor([1.0, 2.0, 3.0, 0.0]))


def test_masked_whiten_gives_mean_0_var_1_over_the_mask():
    torch.manual_seed(0)
    x = torch.randn(4, 7, dtype=torch.float64) * 3 + 5
    mask = torch.rand(4, 7) > 0.3
    whitened = masked_whiten(x, mask)
    assert_close(masked_mean(whitened, mask), torch.tensor(0.0, dtype=torch.float64))
    assert_close(masked_var(whitened, mask), torch.tensor(1.0, dtype=torch.float64))
    assert (whitened[~mask] == 0).all()
    scaled = masked_whiten(x, mask, shift_mean=False)  # scale only: the mean is kept
    assert_close(masked_mean(scaled, mask), masked_mean(x, mask))


def test_logprobs_equal_log_softmax_gather_and_minus_cross_entropy():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    logprobs = logprobs_from_logits(logits, labels)
    assert logprobs.shape == (3, 5)
    assert_close(logprobs, logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    assert_close(logprobs, -F.cross_entropy(logits.transpose(1, 2), labels, reduction="none"))
    # and its gradient, since the policy loss backpropagates through it
    leaf = logits.clone().requires_grad_()
    logprobs_from_logits(leaf, labels).sum().backward()
    assert_close(leaf.grad, torch.autograd.grad(logits.requires_grad_().log_softmax(-1).gather(
        -1, labels.unsqueeze(-1)).sum(), logits)[0])


def test_logprobs_by_hand_and_dtypes():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert_close(logprobs_from_logits(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.25)]]))
    assert logprobs_from_logits(logits.double(), torch.tensor([[1]])).dtype == torch.float64
    # low precision logits are upcast: the result is float32 and matches float32 maths on the same inputs
    torch.manual_seed(0)
    low, labels = torch.randn(2, 4, 50).bfloat16() * 10, torch.randint(0, 50, (2, 4))
    out = logprobs_from_logits(low, labels)
    assert out.dtype == torch.float32
    assert_close(out, logprobs_from_logits(low.float(), labels))


def test_entropy_uniform_is_log_v_and_matches_definition():
    assert_close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert_close(entropy_from_logits(peaked), torch.zeros(1, 1), atol=1e-6, rtol=0)
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 9, dtype=torch.float64)
    p = logits.softmax(-1)
    assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))


@pytest.mark.parametrize("chunk_elements", [1, 2 * 5 * 11 + 3, 1 << 24])
def test_logprobs_and_entropy_the_same_for_any_row_chunking(monkeypatch, chunk_elements):
    # one row at a time (a real vocabulary), two and a bit rows (a short last chunk), the whole batch at once
    torch.manual_seed(0)
    full = torch.randn(5, 7, 11)
    logits, labels = full[:, 1:6], torch.randint(0, 11, (5, 5))  # a strided view, as a response slice of logits
    one_row = [logprobs_from_logits(logits[i:i + 1], labels[i:i + 1]) for i in range(5)]
    one_row_entropy = [entropy_from_logits(logits[i:i + 1]) for i in range(5)]
    monkeypatch.setattr(tensors, "LOGITS_CHUNK_ELEMENTS", chunk_elements)
    rows = max(1, chunk_elements // (5 * 11))
    assert tensors.logit_rows_per_chunk(logits) == rows == tensors.logit_rows_per_chunk(logits[:0])
    assert [len(c) for c in logits.split(rows)] == [min(rows, 5 - i) for i in range(0, 5, rows)]
    leaf = logits.clone().requires_grad_()
    logprobs = logprobs_from_logits(leaf, labels)
    assert torch.equal(logprobs, torch.cat(one_row))  # each row reduces over its own entries: the same floats
    assert torch.equal(entropy_from_logits(logits), torch.cat(one_row_entropy))
    (logprobs.sum() + entropy_from_logits(leaf).sum()).backward()
    reference = logits.clone().requires_grad_()
    p = reference.softmax(-1)
    (reference.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).sum() - (p * p.log()).sum()).backward()
    assert_close(leaf.grad, reference.grad)
    assert logprobs_from_logits(logits[:0], labels[:0]).shape == (0, 5)


def test_first_true_indices():
    bools = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    assert first_true_indices(bools).tolist() == [1, 4, 0]


def test_padding_bounds_keep_every_real_token():
    query_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert left_padding(query_mask) == 2
    assert padding_bounds(query_mask, response_mask) == (2, 3)
    q_start, r_end = padding_bounds(query_mask, response_mask)
    assert query_mask[:, q_start:].sum() == query_mask.sum() and response_mask[:, :r_end].sum() == response_mask.sum()
    # nothing to cut, and the empty cases: no prompt token keeps every column, no response token keeps one column
    assert padding_bounds(torch.ones(2, 3), torch.ones(2, 4)) == (0, 4)
    assert padding_bounds(torch.zeros(2, 3), torch.zeros(2, 4)) == (0, 1)


def test_length_sorted_chunks_cover_every_row_once_in_length_order():
    lengths = torch.tensor([5, 2, 9, 2, 7, 5, 1])
    chunks = length_sorted_chunks(lengths, 3)
    assert [c.tolist() for c in chunks] == [[6, 1, 3], [0, 5, 4], [2]]  # ties (2, 2 and 5, 5) keep row order
    assert sorted(torch.cat(chunks).tolist()) == list(range(7))
    assert [c.tolist() for c in length_sorted_chunks(lengths, 10)] == [[6, 1, 3, 0, 5, 4, 2]]


def test_rejoin_chunks_pads_to_the_width_and_puts_rows_back():
    chunks = [torch.tensor([2, 0]), torch.tensor([1])]
    parts = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0, 4.0]])]  # rows 2, 0 (width 1), then row 1 (width 2)
    assert rejoin_chunks(parts, chunks, 3, value=-1.0).tolist() == [[2.0, -1.0, -1.0], [3.0, 4.0, -1.0],
                                                                     [1.0, -1.0, -1.0]]
    hidden = [torch.ones(2, 1, 4), torch.full((1, 2, 4), 5.0)]  # (n, w, H): dimension 1 padded, H kept
    out = rejoin_chunks(hidden, chunks, 2)
    assert out.shape == (3, 2, 4) and out[1].eq(5.0).all() and out[0, 1].eq(0).all() and out[2, 0].eq(1).all()


def test_pure_math_imports_torch_only():
    # read the imports rather than import in a subprocess: a second `import torch` would cost seconds
    package = Path(hf_rlhf.__file__).parent
    allowed = {"__future__", "math", "torch", "hf_rlhf", "collections", "dataclasses", "typing", "functools"}
    # the rollout, loader and trainer-side files drive models; only the math must stay light
    math_files = [*(package / "rl").glob("*.py"), *(package / "losses").glob("*.py")]
    for path in [package / "tensors.py", *math_files]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            assert {name.split(".")[0] for name in names} <= allowed, f"{path.name} imports {names}"
