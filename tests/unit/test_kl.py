"""KL estimators and KL controllers (`hf_rlhf.rl.kl`), against hand values and a toy closed loop."""

import json
import math

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.rl.kl import AdaptiveKLController, FixedKLController, kl_penalty

LOGP = torch.tensor([[math.log(0.5)]])
REF = torch.tensor([[math.log(0.25)]])


def test_estimators_by_hand():
    # log π/π_ref = log 2; r = π_ref/π = 0.5
    assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([[math.log(2)]]))
    assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.5 * math.log(2) ** 2]]))
    assert_close(kl_penalty(LOGP, REF, "k3"), torch.tensor([[0.5 - 1 - math.log(0.5)]]))  # r - 1 - log r
    assert_close(kl_penalty(LOGP, REF), kl_penalty(LOGP, REF, "k1"))  # default


def test_k3_is_never_negative_and_all_vanish_when_the_policies_agree():
    torch.manual_seed(0)
    logp, ref = torch.randn(8, 16) * 3, torch.randn(8, 16) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k1") < 0).any()  # k1 is unbiased, not positive
    for estimator in ("k1", "k2", "k3"):
        assert (kl_penalty(logp, logp, estimator) == 0).all()


def test_unknown_estimator_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'kl'.*k1, k2, k3"):
        kl_penalty(LOGP, REF, "kl")


def test_k3_is_clamped_as_openrlhf_and_only_k3():
    # log π/π_ref = -15, -1, 0, 3: k3 = e^{15} - 16 = 3.3e6 before the clamp; e - 2; 0; e^{-3} + 2
    logp = torch.tensor([[-16.0, -2.0, -1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -1.0, -1.0, -4.0]], dtype=torch.float64)
    unclamped = torch.tensor([[math.exp(15) - 16, math.e - 2, 0.0, math.exp(-3) + 2]], dtype=torch.float64)
    assert_close(kl_penalty(logp, ref, "k3", clamp=None), unclamped)
    assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[10.0, math.e - 2, 0.0, math.exp(-3) + 2]],
                                                          dtype=torch.float64))  # default clamp 10
    assert_close(kl_penalty(logp, ref, "k3", clamp=2.0), unclamped.clamp(max=2.0))
    # k1 and k2 keep their values (TRL does not clamp them)
    assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[-15.0, -1.0, 0.0, 3.0]], dtype=torch.float64))
    assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[112.5, 0.5, 0.0, 4.5]], dtype=torch.float64))


def test_ppo_config_kl_clamp_is_checked():
    from hf_rlhf.trainers.ppo_config import PPOConfig

    assert PPOConfig(output_dir="out", report_to="none").kl_clamp == 10.0
    with pytest.raises(ValueError, match="kl_clamp must be > 0 or None"):
        PPOConfig(output_dir="out", report_to="none", kl_clamp=0.0)


def test_k1_and_k3_average_to_the_true_kl_on_samples():
    p, q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64), torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(p, 100_000, replacement=True, generator=generator)
    logp, ref = p.log()[tokens], q.log()[tokens]
    for estimator in ("k1", "k3"):
        assert_close(kl_penalty(logp, ref, estimator).mean(), true_kl, atol=0.01, rtol=0)


def test_adaptive_controller_sequence_by_hand():
    controller = AdaptiveKLController(0.1, target=6, horizon=10000)
    controller.update(12.0, 256)  # e = 12/6 - 1 = 1 -> clipped to 0.2
    expected = 0.1 * (1 + 0.2 * 256 / 10000)
    assert controller.value == pytest.approx(expected)
    controller.update(6.6, 256)  # e = 0.1, inside the clip
    expected *= 1 + 0.1 * 256 / 10000
    assert controller.value == pytest.approx(expected)
    controller.update(torch.tensor(3.0), 512)  # e = -0.5 -> clipped to -0.2; a tensor KL is accepted
    expected *= 1 - 0.2 * 512 / 10000
    assert controller.value == pytest.approx(expected)
    controller.update(6.0, 256)  # on target: unchanged
    assert controller.value == pytest.approx(expected)


def test_adaptive_controller_direction_and_clipping():
    def after(kl):
        controller = AdaptiveKLController(0.1, target=6, horizon=1000)
        controller.update(kl, 100)
        return controller.value

    assert after(5.0) < 0.1 < after(7.0)
    assert after(1000.0) == pytest.approx(after(7.2)) == pytest.approx(0.1 * 1.02)  # e clipped at +0.2
    assert after(0.0) == pytest.approx(after(4.8)) == pytest.approx(0.1 * 0.98)  # e clipped at -0.2
    assert after(float("nan")) == after(float("inf")) == 0.1  # a non-finite KL leaves β alone


def test_state_dict_round_trip_continues_the_same_sequence():
    controller = AdaptiveKLController(0.1, target=6, horizon=10000)
    for kl in (12.0, 9.0, 2.0):
        controller.update(kl, 256)
    restored = AdaptiveKLController(0.5, target=6, horizon=10000)
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))  # plain, serialisable
    assert restored.value == controller.value
    controller.update(7.0, 64)
    restored.update(7.0, 64)
    assert restored.value == controller.value


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(1000.0, 256)
    assert controller.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05


@pytest.mark.parametrize("args", [(0.1, 0, 100), (0.1, 6, 0), (0.1, -1, 100), (-0.1, 6, 100)])
def test_adaptive_controller_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        AdaptiveKLController(*args)
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


@pytest.mark.parametrize("init", [0.05, 0.8])
def test_closed_loop_converges_to_the_target(init):
    # toy environment: the policy drifts until KL = c / β, so β* = c / target = 0.2
    target, c = 6.0, 1.2
    controller = AdaptiveKLController(init, target=target, horizon=10000)
    kls = []
    for _ in range(1000):
        kls.append(c / controller.value)
        controller.update(kls[-1], 256)
    assert controller.value == pytest.approx(c / target, rel=1e-3)
    assert abs(kls[-1] - target) < abs(kls[0] - target) / 100
    gaps = [abs(kl - target) for kl in kls]
    assert all(b <= a + 1e-12 for a, b in zip(gaps, gaps[1:]))  # no overshoot: steps are small
