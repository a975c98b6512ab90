"""`estimate_advantages` (where the KL goes for each estimator), the estimator options of `PPOConfig`, and the
experience loader's prompt groups (`num_generations`): lengths and resume fast-forward."""

from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf.rl.advantages import gae, per_token_rewards
from hf_rlhf.rl.critic_free import grpo_advantages, reinforce_pp_advantages, rloo_advantages
from hf_rlhf.rl.estimators import estimate_advantages
from hf_rlhf.rollout.experience import Experience
from hf_rlhf.rollout.loader import ExperienceLoader
from hf_rlhf.tensors import masked_whiten
from hf_rlhf.trainers.ppo_config import PPOConfig


def _options(**kw):
    defaults = dict(advantage_estimator="gae", num_generations=1, scale_rewards="group", normalize_advantages=False,
                    kl_in_loss=False, gamma=1.0, lam=0.95, whiten_rewards=False, whiten_advantages=True)
    return SimpleNamespace(**{**defaults, **kw})


@pytest.fixture
def rollout():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    kl = torch.randn(4, 4) * mask
    return torch.tensor([1.0, 0.0, 0.5, 2.0]), kl, mask, torch.randn(4, 4) * mask


def test_gae_is_the_ppo_computation(rollout):
    scores, kl, mask, values = rollout
    rewards, advantages, returns = estimate_advantages(_options(), scores, kl, mask, values, 0.1)
    expected_rewards = per_token_rewards(scores, kl, mask, 0.1)
    expected_adv, expected_returns = gae(expected_rewards, values, mask, 1.0, 0.95)
    assert_close(rewards, expected_rewards)
    assert_close(returns, expected_returns)
    assert_close(advantages, masked_whiten(expected_adv, mask))


def test_grpo_and_rloo_penalise_the_score_before_the_baseline(rollout):
    scores, kl, mask, values = rollout
    penalised = scores - 0.1 * (kl * mask).sum(1)
    for name, expected in [("grpo", grpo_advantages(penalised, 2)), ("rloo", rloo_advantages(penalised, 2))]:
        rewards, advantages, returns = estimate_advantages(_options(advantage_estimator=name, num_generations=2),
                                                           scores, kl, mask, values, 0.1)
        assert_close(advantages, expected.unsqueeze(1) * mask)  # one advantage on every token of the sequence
        assert_close(returns, penalised.unsqueeze(1) * mask)
        assert_close(rewards.sum(1), penalised)


def test_reinforce_pp_and_its_baseline(rollout):
    scores, kl, mask, values = rollout
    for name, groups in [("reinforce_pp", None), ("reinforce_pp_baseline", 2)]:
        _, advantages, returns = estimate_advantages(_options(advantage_estimator=name, num_generations=2),
                                                     scores, kl, mask, values, 0.1)
        expected_adv, expected_returns = reinforce_pp_advantages(scores, kl, mask, 0.1, 1.0, groups)
        assert_close(advantages, expected_adv)
        assert_close(returns, expected_returns)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_kl_in_loss_takes_the_kl_out_of_the_rewards(rollout, name):
    scores, kl, mask, values = rollout
    options = _options(advantage_estimator=name, num_generations=2)
    in_loss = estimate_advantages(_options(**{**vars(options), "kl_in_loss": True}), scores, kl, mask, values, 0.3)
    no_kl = estimate_advantages(options, scores, kl, mask, values, 0.0)
    penalised = estimate_advantages(options, scores, kl, mask, values, 0.3)
    for got, expected in zip(in_loss, no_kl):
        assert_close(got, expected)
    assert not torch.allclose(penalised[1], no_kl[1])  # the control: β reaches the advantages when in the reward


# ---------------------------------------------------------------------------------------------------
# PPOConfig


def _config(tmp_path, **kw):
    return PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     report_to="none", **kw)


def test_config_defaults_are_ppo(tmp_path):
    args = _config(tmp_path)
    assert (args.advantage_estimator, args.num_generations, args.loss_type, args.kl_in_loss) == ("gae", 1, "dapo",
                                                                                                False)
    assert not args.critic_free and args.prompts_per_rollout == args.rollout_batch_size == 4
    grpo = _config(tmp_path, advantage_estimator="grpo", num_generations=4, rollout_batch_size=8)
    assert grpo.critic_free and grpo.prompts_per_rollout == 2 and grpo.num_mini_batches == 2


@pytest.mark.parametrize("options, message", [
    (dict(advantage_estimator="ppo"), r"PPOConfig.advantage_estimator='ppo'; expected one of \['gae'"),
    (dict(advantage_estimator="grpo", num_generations=1), "needs num_generations >= 2"),  # None: 8 (TRL)
    (dict(advantage_estimator="rloo", num_generations=1), "needs num_generations >= 2"),
    (dict(advantage_estimator="grpo", num_generations=3), r"rollout_batch_size=4 \(completions per rollout\) must "
                                                          "be a multiple of num_generations=3"),
    (dict(advantage_estimator="grpo", num_generations=2, scale_rewards="std"),
     r"PPOConfig.scale_rewards='std'; expected one of \['group', 'batch', 'none'\]"),
    (dict(loss_type="token"), r"PPOConfig.loss_type='token'; expected one of \['grpo', 'bnpo', 'dapo', 'dr_grpo', "
                              r"'cispo', 'sapo', 'luspo', 'vespo'\]"),
    (dict(kl_in_loss=True), "kl_in_loss is for the critic-free estimators"),
    (dict(advantage_estimator="reinforce_pp_baseline", num_generations=2, gamma=0.9), "needs gamma = 1"),
    (dict(advantage_estimator="rloo", num_generations=2, value_learning_rate=1e-3), "no value function"),
])
def test_config_errors(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **options)


def test_plain_reinforce_pp_takes_one_generation(tmp_path):
    assert _config(tmp_path, advantage_estimator="reinforce_pp").num_generations == 1


# ---------------------------------------------------------------------------------------------------
# ExperienceLoader with num_generations


def _fake_experience(rows, indices):
    n = len(rows)
    ids = torch.tensor(indices).unsqueeze(1)
    ones = torch.ones(n, 1)
    experience = Experience(ids, ones.long(), ids, ones.long(), *(ones.clone() for _ in range(3)), ones[:, 0],
                            *(ones.clone() for _ in range(3)))
    return experience, {"rows": float(n)}


def _loader(dataset, calls, global_step=0, **kw):
    def make(rows, indices):
        calls.append(list(indices))
        return _fake_experience(rows, indices)

    return ExperienceLoader(dataset, make, rollout_batch_size=8, micro_batch_size=2, num_ppo_epochs=2, seed=0,
                            get_global_step=lambda: global_step, **kw)


def test_loader_repeats_each_prompt_in_consecutive_rows_and_counts_completions():
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(12)], "input_ids": [[i] for i in range(12)]})
    calls = []
    loader = _loader(dataset, calls, num_generations=4)
    # 12 prompts / 2 per rollout = 6 rollouts; each 8 rows x 2 epochs / micro-batches of 2 = 8 micro-batches
    assert loader.prompts_per_rollout == 2 and loader.rollouts_per_epoch == 6 and len(loader) == 48
    batches = list(loader)
    assert len(batches) == 48 and len(calls) == 6
    for indices in calls:
        assert len(indices) == 8 and all(len(set(indices[g:g + 4])) == 1 for g in (0, 4))  # groups of 4, in a row
    seen = sorted(i for indices in calls for i in indices[::4])
    assert seen == list(range(12))  # every prompt once per epoch

    # two ranks: each takes whole groups, and together they sample what one process samples
    ranks = [[], []]
    for rank in (0, 1):
        list(_loader(dataset, ranks[rank], process_index=rank, num_processes=2, num_generations=4))
    one = _loader(dataset, [], num_generations=4)
    assert [ranks[0][r][::4] + ranks[1][r][::4] for r in range(3)] == [
        one.rollout_indices(0, 2 * r) + one.rollout_indices(0, 2 * r + 1) for r in range(3)]


def test_loader_resume_skips_whole_rollouts_without_generating():
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(12)], "input_ids": [[i] for i in range(12)]})
    full_calls, resumed_calls = [], []
    full = [batch["query_ids"].tolist() for batch in _loader(dataset, full_calls, num_generations=4)]
    # global step 8 with one micro-batch per step = the start of the 2nd rollout (8 micro-batches per rollout)
    resumed = [batch["query_ids"].tolist() for batch in _loader(dataset, resumed_calls, 8, num_generations=4)]
    assert resumed == full[8:] and resumed_calls == full_calls[1:]


def test_loader_rejects_a_rollout_that_does_not_split_into_groups():
    with pytest.raises(ValueError, match="rollout_batch_size=8 is not a multiple of num_generations=3"):
        _loader([{"input_ids": [1]}] * 8, [], num_generations=3)
