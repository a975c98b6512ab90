"""The KTO losses (`hf_rlhf.losses.kto`) on hand-computed tensors, and against trl 1.16's own code on the same tensors.

TRL computes the KTO loss inside `KTOTrainer._compute_loss`: the test calls that method on a stand-in `self` (the
attributes it reads) and a stand-in model whose output carries the per-token log-probs of the batch's sequences
(matched, and the mismatched KL ones), with precomputed reference log-probs in the batch.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import trl

from hf_rlhf.losses.kto import kl_reference_point, kto_loss, uses_kl_reference_point


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_kto_loss_by_hand():
    logps, ref = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -1.0, -3.0])
    labels = torch.tensor([True, False, True])
    loss, losses, rewards = kto_loss(logps, ref, labels, torch.tensor(0.2), beta=0.5, desirable_weight=2.0,
                                     undesirable_weight=0.5)
    # r = [0.5, -1, 0]; desirable 1 - σ(β(r - z0)), undesirable 1 - σ(β(z0 - r))
    expected = [2.0 * (1 - _sigmoid(0.5 * 0.3)), 0.5 * (1 - _sigmoid(0.5 * 1.2)), 2.0 * (1 - _sigmoid(0.5 * -0.2))]
    torch.testing.assert_close(losses, torch.tensor(expected))
    torch.testing.assert_close(loss, torch.tensor(sum(expected) / 3))
    torch.testing.assert_close(rewards, torch.tensor([0.25, -0.5, 0.0]))


def test_apo_zero_unpaired_by_hand():
    logps, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    _, losses, _ = kto_loss(logps, ref, torch.tensor([True, False]), None, beta=0.5, loss_type="apo_zero_unpaired")
    torch.testing.assert_close(losses, torch.tensor([1 - _sigmoid(0.25), _sigmoid(-0.5)]))
    assert not uses_kl_reference_point("apo_zero_unpaired") and uses_kl_reference_point("kto")


def test_gradient_pushes_desirable_up_and_undesirable_down():
    logps = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _, _ = kto_loss(logps, torch.tensor([-1.0, -1.0]), torch.tensor([True, False]), torch.tensor(0.0))
    loss.backward()
    assert logps.grad[0] < 0 < logps.grad[1]  # descent raises the desirable log-prob, lowers the undesirable one


def test_kl_reference_point_by_hand():
    z0 = kl_reference_point(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -2.0, -2.0]))
    torch.testing.assert_close(z0, torch.tensor((1.0 + 0.0 + 1.5) / 3))
    assert kl_reference_point(torch.tensor([-3.0]), torch.tensor([-1.0])) == 0  # clamped at 0
    # over ranks: the mean of each rank's mean (TRL's gather), then the clamp
    other_rank = torch.tensor([-0.5])
    z0 = kl_reference_point(torch.tensor([-1.0]), torch.tensor([-2.0]), gather=lambda t: torch.cat([t, other_rank]))
    torch.testing.assert_close(z0, torch.tensor(0.25))
    x = torch.tensor([-1.0], requires_grad=True)
    assert not kl_reference_point(x, torch.tensor([-2.0])).requires_grad


class _Accel:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x.reshape(-1) if torch.is_tensor(x) and x.ndim == 0 else x


def _padded(g, n, t, v):
    ids = torch.randint(0, v, (n, t), generator=g)
    prompt = torch.randint(1, 4, (n,), generator=g)
    ends = torch.randint(5, t + 1, (n,), generator=g)
    pos = torch.arange(t)
    return ids, (pos < ends[:, None]).long(), ((pos >= prompt[:, None]) & (pos < ends[:, None])).long()


def _token_logps(g, ids, completion_mask):
    return -torch.rand(ids.shape[0], ids.shape[1] - 1, generator=g, dtype=torch.float64) * 3 * completion_mask[:, 1:]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)])
@pytest.mark.parametrize("labels", [[1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
def test_loss_equals_trls_own_code(loss_type, weights, labels):
    g = torch.Generator().manual_seed(0)
    n, t, v = len(labels), 9, 11
    ids, mask, completion = _padded(g, n, t, v)
    kl_ids, kl_mask, kl_completion = _padded(g, n, t, v)
    logps, kl_logps = _token_logps(g, ids, completion), _token_logps(g, kl_ids, kl_completion)
    ref, ref_kl = -torch.rand(n, generator=g, dtype=torch.float64) * 20, -torch.rand(n, generator=g) * 20
    ref_kl = ref_kl.double()

    def model(input_ids, **kwargs):
        token_logps = kl_logps if input_ids is kl_ids else logps
        return SimpleNamespace(log_probs=token_logps, entropy=torch.zeros_like(token_logps),
                               mean_logits=torch.zeros_like(token_logps))

    calculate_kl = uses_kl_reference_point(loss_type)
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": completion,
             "label": torch.tensor(labels, dtype=torch.bool), "ref_logps": ref}
    if calculate_kl:
        batch.update(KL_input_ids=kl_ids, KL_attention_mask=kl_mask, KL_completion_mask=kl_completion,
                     ref_KL_logps=ref_kl)
    fake_self = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accel(), aux_loss_enabled=False, beta=0.1,
        loss_type=loss_type, desirable_weight=weights[0], undesirable_weight=weights[1], calculate_KL=calculate_kl,
        precompute_ref_logps=True, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    fake_self._compute_kl_logps = lambda m, b: trl.KTOTrainer._compute_kl_logps(fake_self, m, b)
    theirs = trl.KTOTrainer._compute_loss(fake_self, model, batch, return_outputs=False)

    kl = kl_reference_point(kl_logps.sum(-1), ref_kl) if calculate_kl else None
    ours, _, rewards = kto_loss(logps.sum(-1), ref, batch["label"], kl, beta=0.1, loss_type=loss_type,
                                desirable_weight=weights[0], undesirable_weight=weights[1])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    chosen = batch["label"]
    assert fake_self._metrics["train"]["rewards/chosen"][0] == pytest.approx(rewards[chosen].mean().item(), abs=1e-12)
    if calculate_kl:
        assert fake_self._metrics["train"]["kl"][0] == pytest.approx(kl.item(), abs=1e-12)
