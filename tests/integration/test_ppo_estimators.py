"""PPOTrainer with the critic-free estimators (GRPO, RLOO, REINFORCE++): no value function built or stepped, prompt
groups on the rollout, function and model rewards, the KL as a loss term with the controller's β."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_rlhf.toy import build_toy_model, build_toy_reward_model
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

CRITIC_FREE = {
    "grpo": dict(num_generations=4),
    "rloo": dict(num_generations=4),
    "reinforce_pp": dict(num_generations=1),
    "reinforce_pp_baseline": dict(num_generations=4),
}
VALUE_METRICS = ("loss/value_avg", "val/clipfrac_avg")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def make_args(tmp_path, estimator, **kw):
    # a rollout: 8 rows (8 / G prompts) = 2 mini-batches of 2 x 2 micro-batches; 2 optimizer steps per rollout
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    rollout_batch_size=8, num_ppo_epochs=1, response_length=6, max_steps=2, logging_steps=1,
                    save_strategy="no", report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True,
                    temperature=1.0, advantage_estimator=estimator, **CRITIC_FREE[estimator])
    defaults.update(kw)
    return PPOConfig(**defaults)


def digit_reward(prompts, completions, **kwargs):
    """A reward that varies with the random policy's text (the toy answers are never right at first)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def step_logs(trainer) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


@pytest.mark.parametrize("source", ["function", "model"])
@pytest.mark.parametrize("estimator", list(CRITIC_FREE))
def test_critic_free_trains_the_policy_alone(tmp_path, tokenizer, prompts, estimator, source):
    seen = []
    if source == "function":
        def reward(prompts, completions, **kwargs):
            seen.append(list(prompts))
            return digit_reward(prompts, completions)
    else:
        reward = build_toy_reward_model(tokenizer, seed=3)
        reward.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].tolist()),
                                         with_kwargs=True)
    args = make_args(tmp_path, estimator)
    trainer = PPOTrainer(build_toy_model(tokenizer), reward, args=args, train_dataset=prompts,
                         processing_class=tokenizer, reward_processing_class=tokenizer)
    module = trainer.model
    assert module.value_head is None and module.value_model is None and module.value_parameter_names() == set()
    # the policy's own names (as trl.GRPOTrainer.model's): one set of parameters, no wrapper prefix
    assert dict(module.named_parameters()) == dict(module.policy.named_parameters())
    assert module.state_dict().keys() == module.policy.state_dict().keys()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.train()

    # every optimised parameter is the policy's, and the policy moved
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in module.policy.parameters() if p.requires_grad}
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("model.layers") for n in changed)
    logs = step_logs(trainer)
    assert sorted(logs) == [1, 2]
    for log in logs.values():
        assert not set(VALUE_METRICS) & set(log)
        assert {"loss/policy_avg", "policy/approxkl_avg", "objective/kl", "objective/scores"} <= set(log)
        assert all(torch.isfinite(torch.tensor(v)) for v in log.values() if isinstance(v, float))

    # one scoring call per rollout (the reward model: one forward), its rows in groups of G identical prompts
    group = args.num_generations
    assert len(seen) == 1 and len(seen[0]) == 8
    if source == "function":
        assert all(seen[0][g] == seen[0][g - g % group] for g in range(8))
        if group > 1:
            assert seen[0][0] != seen[0][group]  # the control: the next group is another prompt

    # the saved output is the policy alone, reloadable; nothing of a value function is written
    trainer.save_model(str(tmp_path / "final"))
    assert not os.path.exists(tmp_path / "final" / "value")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for name, param in reloaded.state_dict().items():
        torch.testing.assert_close(param, module.policy.state_dict()[name])


def test_kl_in_loss_is_beta_times_the_token_kl(tmp_path, tokenizer, prompts):
    """A constant reward gives GRPO zero advantages, so the loss is the KL term alone: β·(token mean of k3)."""
    args = make_args(tmp_path, "grpo", max_steps=4, kl_in_loss=True, kl_estimator="k3", kl_coef=0.3,
                     kl_target=0.5, kl_horizon=8)
    reference = build_toy_model(tokenizer, seed=1)  # another model: the KL is not 0 at the first step
    trainer = PPOTrainer(build_toy_model(tokenizer), lambda prompts, completions, **kw: [1.0] * len(completions),
                         args=args, train_dataset=prompts, processing_class=tokenizer, ref_model=reference)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = step_logs(trainer)
    assert logs[1]["objective/kl_coef"] == pytest.approx(0.3)
    assert logs[3]["objective/kl_coef"] != pytest.approx(0.3)  # the adaptive controller still steers β
    for log in logs.values():
        assert log["loss/policy_avg"] == 0.0 and log["loss/kl_avg"] > 0
        assert log["loss"] == pytest.approx(log["objective/kl_coef"] * log["loss/kl_avg"], rel=1e-4)
        assert log["objective/scores"] == 1.0  # the penalty is not in the reward
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # pulled towards the ref


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_loss_types_reduce_the_same_per_token_loss(tmp_path, tokenizer, prompts, loss_type):
    """One micro-batch per step (no accumulation): each loss_type's first logged loss matches its formula."""
    captured = {}
    args = make_args(tmp_path, "rloo", max_steps=1, gradient_accumulation_steps=1, rollout_batch_size=4,
                     num_generations=2, loss_type=loss_type)
    trainer = PPOTrainer(build_toy_model(tokenizer), digit_reward, args=args, train_dataset=prompts,
                         processing_class=tokenizer)
    original = trainer.compute_loss

    def compute_loss(model, inputs, *a, **kw):
        captured["mask"] = inputs["response_mask"].clone()
        captured["advantages"] = inputs["advantages"].clone()
        return original(model, inputs, *a, **kw)

    trainer.compute_loss = compute_loss
    trainer.train()
    # first step, ratio 1: the per-token loss is -A; reduce it by hand
    mask, per_token = captured["mask"].float(), -captured["advantages"] * captured["mask"]
    expected = {"grpo": (per_token.sum(1) / mask.sum(1)).mean(), "bnpo": per_token.sum() / mask.sum(),
                "dapo": per_token.sum() / mask.sum(), "dr_grpo": per_token.sum() / (mask.shape[0] * 6)}[loss_type]
    assert step_logs(trainer)[1]["loss"] == pytest.approx(float(expected), abs=1e-6)


def test_critic_free_refuses_a_value_model(tmp_path, tokenizer, prompts):
    with pytest.raises(ValueError, match="advantage_estimator='grpo' uses no value function"):
        PPOTrainer(build_toy_model(tokenizer), digit_reward, args=make_args(tmp_path, "grpo"), train_dataset=prompts,
                   processing_class=tokenizer, value_model="adapter")
