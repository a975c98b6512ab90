"""The DPO-family losses (`hf_rlhf.losses.dpo`) against TRL 1.16's own code on identical random tensors.

TRL computes its losses inside `DPOTrainer._compute_loss`, not in a separate function: the test calls that method
itself on a stand-in `self` (the attributes it reads) and a stand-in model whose output carries the per-token
log-probs, with precomputed reference log-probs in the batch. SimPO and ORPO are checked against
`trl.experimental.cpo.CPOTrainer.cpo_loss` and `trl.experimental.orpo.ORPOTrainer.odds_ratio_loss`.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import trl

from hf_rlhf.losses.dpo import (
    TRL_DPO_LOSS_TYPES,
    combined_loss,
    completion_logps,
    dpo_loss,
    f_divergence_scores,
    wpo_weights,
)

B, T, V = 6, 9, 11


class _Accel:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics


def _batch(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * B, T, V, generator=g, dtype=torch.float64).to(dtype)
    input_ids = torch.randint(0, V, (2 * B, T), generator=g)
    prompt = torch.randint(1, 4, (2 * B,), generator=g)
    ends = torch.randint(5, T + 1, (2 * B,), generator=g)
    pos = torch.arange(T)
    completion_mask = ((pos >= prompt[:, None]) & (pos < ends[:, None])).long()
    attention_mask = (pos < ends[:, None]).long()
    ref = (-torch.rand(2 * B, generator=g, dtype=torch.float64) * 20).to(dtype)
    return logits, input_ids, completion_mask, attention_mask, ref


def _trl_loss(loss_types, loss_weights=None, beta=0.1, label_smoothing=0.0, f_div="reverse_kl", alpha=0.5,
              use_weighting=False, ld_alpha=None, discopop_tau=0.05, seed=0, dtype=torch.float64):
    logits, input_ids, completion_mask, attention_mask, ref = _batch(seed, dtype)
    stats = completion_logps(logits, input_ids, completion_mask)
    outputs = SimpleNamespace(log_probs=stats["token_logps"], entropy=stats["entropy"],
                              mean_logits=stats["mean_logits"], is_top1=stats["is_top1"],
                              log_sum_sq_probs=stats["log_sum_sq_probs"])
    fake_self = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accel(), aux_loss_enabled=False, ld_alpha=ld_alpha,
        precompute_ref_logps=True, f_divergence_type=f_div, f_alpha_divergence_coef=alpha, loss_types=loss_types,
        loss_weights=loss_weights or [1.0] * len(loss_types), beta=beta, label_smoothing=label_smoothing,
        use_weighting=use_weighting, args=SimpleNamespace(discopop_tau=discopop_tau), _metrics=defaultdict(
            lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
              "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}

    def model(**kwargs):  # TRL masks labels itself; the per-token log-probs are ours, already masked
        return outputs

    loss = trl.DPOTrainer._compute_loss(fake_self, model, inputs, return_outputs=False)
    return loss, fake_self._metrics["train"], (logits, input_ids, completion_mask, ref)


def _ours(loss_types, loss_weights=None, beta=0.1, label_smoothing=0.0, f_div="reverse_kl", alpha=0.5,
          use_weighting=False, ld_alpha=None, discopop_tau=0.05, seed=0, dtype=torch.float64):
    logits, input_ids, completion_mask, _, ref = _batch(seed, dtype)
    s = completion_logps(logits, input_ids, completion_mask, ld_alpha=ld_alpha)
    chosen, rejected = s["logps"].chunk(2)
    lc, lr = s["lengths"].chunk(2)
    pair_weights = None
    if use_weighting:
        wc, wr = wpo_weights(s["token_logps"], s["log_sum_sq_probs"], s["mask"]).chunk(2)
        pair_weights = wc * wr
    return combined_loss(loss_types, loss_weights, chosen, rejected, ref[:B], ref[B:], beta=beta,
                         label_smoothing=label_smoothing, chosen_lengths=lc, rejected_lengths=lr,
                         discopop_tau=discopop_tau, f_divergence_type=f_div, f_alpha_divergence_coef=alpha,
                         pair_weights=pair_weights)


CASES = [dict(loss_types=[t]) for t in TRL_DPO_LOSS_TYPES] + [
    dict(loss_types=["robust"], label_smoothing=0.2), dict(loss_types=["exo_pair"], label_smoothing=1e-3),
    dict(loss_types=["aot"], label_smoothing=0.1), dict(loss_types=["sigmoid"], beta=0.5, label_smoothing=0.1),
    dict(loss_types=["sigmoid", "sft"], loss_weights=[0.8, 0.2]),
    dict(loss_types=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    dict(loss_types=["sigmoid"], f_div="forward_kl"), dict(loss_types=["hinge"], f_div="js_divergence"),
    dict(loss_types=["ipo"], f_div="alpha_divergence", alpha=0.3, dtype=torch.float32),
    dict(loss_types=["sigmoid"], use_weighting=True),
    dict(loss_types=["sigmoid"], ld_alpha=0.5), dict(loss_types=["discopop"], discopop_tau=0.5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c["loss_types"]) + "".join(
    f",{k}={v}" for k, v in c.items() if k != "loss_types"))
def test_loss_equals_trls_own_code(case):
    if case["loss_types"] == ["exo_pair"] and "label_smoothing" not in case:
        case = {**case, "label_smoothing": 1e-3}  # TRL's exo_pair takes log(ε): ε = 0 is infinite in both
    theirs, _, _ = _trl_loss(**case)
    ours = _ours(**case)
    diff = (theirs - ours).abs().item()
    print(f"max|diff| {case}: {diff:.3e}")
    assert diff < (1e-10 if case.get("dtype", torch.float64) == torch.float64 else 1e-6)  # TRL's alpha: fp32 only


def test_sigmoid_by_hand():
    c, r, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-1.0, -3.0, -2.0, -2.5))
    # DPO: -log σ(β((c - rc) - (r - rr))) = -log σ(0.1 * (1 - (-0.5))) = -log σ(0.15)
    expected = -F.logsigmoid(torch.tensor(0.15, dtype=torch.float64))
    assert torch.allclose(dpo_loss("sigmoid", c, r, rc, rr, beta=0.1), expected)
    assert torch.allclose(f_divergence_scores(torch.tensor([0.0]), "js_divergence"), torch.log(torch.tensor([1.0])))


def test_simpo_equals_trl_cpo():
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(1)
    c, r = -torch.rand(8, generator=g) * 30, -torch.rand(8, generator=g) * 30
    lc, lr = torch.randint(1, 20, (8,), generator=g).float(), torch.randint(1, 20, (8,), generator=g).float()
    fake = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=0.1,
                           accelerator=_Accel())
    theirs, _, _ = CPOTrainer.cpo_loss(fake, c / lc, r / lr)  # CPO averages per token for simpo
    ours = dpo_loss("simpo", c, r, None, None, beta=2.0, label_smoothing=0.1, chosen_lengths=lc, rejected_lengths=lr,
                    simpo_gamma=0.7)
    diff = (theirs - ours).abs().max().item()
    print(f"max|diff| simpo: {diff:.3e}")
    assert diff < 1e-6


def test_orpo_equals_trl_orpo():
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(2)
    c, r = -torch.rand(8, generator=g, dtype=torch.float64) * 30, -torch.rand(8, generator=g, dtype=torch.float64) * 30
    lc, lr = torch.randint(1, 20, (8,), generator=g).double(), torch.randint(1, 20, (8,), generator=g).double()
    fake = SimpleNamespace(beta=0.1, accelerator=_Accel())
    ratio_losses, _, _, _, _ = ORPOTrainer.odds_ratio_loss(fake, c / lc, r / lr)  # ORPO averages per token
    nll = -c.sum() / lc.sum()  # ORPO's cross-entropy over every chosen token of the batch
    theirs = nll - ratio_losses.mean()  # orpo_trainer: loss = policy_nll_loss - losses.mean()
    ours = dpo_loss("orpo", c, r, None, None, beta=0.1, chosen_lengths=lc, rejected_lengths=lr).mean()
    diff = (theirs - ours).abs().item()
    print(f"max|diff| orpo: {diff:.3e}")
    assert diff < 1e-6


def test_unknown_loss_type_is_an_error():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type='dpo'; expected one of"):
        dpo_loss("dpo", x, x, x, x)
    with pytest.raises(ValueError, match="loss_weights has 1 entries for 2 loss types"):
        combined_loss(["sigmoid", "sft"], [1.0], x, x, x, x, chosen_lengths=x + 1, rejected_lengths=x + 1)
