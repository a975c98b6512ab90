"""PPO with the four roles on one frozen base: policy adapter, value adapter + head, reward adapter + score head,
reference = adapters off (`hf_rlhf.rewards.adapter`, `hf_rlhf.models.value_adapter`), in full precision and 4-bit."""

import os
import shutil

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForSequenceClassification

from hf_rlhf import ModelConfig, RewardConfig, RewardTrainer
from hf_rlhf.models.adapters import adapter_scope
from hf_rlhf.models.value_adapter import VALUE_ADAPTER
from hf_rlhf.models.value_head import ValueHeadModel, backbone_of
from hf_rlhf.rewards.adapter import REWARD_ADAPTER, AdapterReward, RewardAdapter
from hf_rlhf.rewards.model import ModelReward
from hf_rlhf.toy import build_toy_model, preference_dataset, prompt_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

BASE_WEIGHT = "model.layers.0.self_attn.q_proj.base_layer.weight"  # a frozen base linear, as peft names it


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def _train_reward(base_dir, tokenizer, output_dir, model):
    torch.set_num_threads(1)
    args = RewardConfig(output_dir=output_dir, per_device_train_batch_size=8, max_steps=4, learning_rate=2e-2,
                        report_to="none", save_strategy="no", max_length=64, disable_tqdm=True, seed=0,
                        store_reward_stats=True)
    trainer = RewardTrainer(model, args=args, train_dataset=preference_dataset(32, seed=1),
                            processing_class=tokenizer,
                            model_config=ModelConfig(model_name_or_path=base_dir, use_peft=True, lora_r=4,
                                                     lora_alpha=8, lora_dropout=0.1))
    trainer.train()
    trainer.save_model()
    return output_dir


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, base_dir, tokenizer):
    """A LoRA sequence-classification reward adapter (score head saved through modules_to_save)."""
    return _train_reward(base_dir, tokenizer, str(tmp_path_factory.mktemp("rm")), base_dir)


def make_args(output_dir, **kw):
    defaults = dict(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_ppo_epochs=2, response_length=6, max_steps=4, logging_steps=1, save_strategy="no",
                    report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True, temperature=1.0)
    defaults.update(kw)
    return PPOConfig(**defaults)


def lora_model_config(base_dir, **kw):
    return ModelConfig(model_name_or_path=base_dir, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, **kw)


def separate_reward(base_dir, reward_dir, tokenizer) -> ModelReward:
    """The reward adapter loaded the usual way: a PeftModel on its own copy of the base."""
    from peft import PeftModel

    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    return ModelReward(PeftModel.from_pretrained(base, reward_dir), tokenizer)


def sample_texts(prompts, n=6):
    # completions of several lengths, right and wrong, so that left padding is exercised
    rows = prompts.select(range(n))
    completions = [a if i % 2 else a + "9" * i for i, a in enumerate(rows["answer"])]
    return list(rows["prompt"]), completions


def trainable_names(trainer):
    return {n for n, p in trainer.model.named_parameters() if p.requires_grad}


def ppo_trainer(base_dir, reward, tmp_path, tokenizer, prompts, **kw):
    model_config = kw.pop("model_config", None) or lora_model_config(base_dir)
    return PPOTrainer(base_dir, reward, args=make_args(tmp_path / "out", **kw.pop("args", {})),
                      train_dataset=prompts, processing_class=tokenizer, model_config=model_config, **kw)


# ---------------------------------------------------------------------------------------------------
# (a) one base, shared and frozen; only the policy adapter and the value function train


def test_one_base_ppo_trains_only_the_policy_and_value_adapters(tmp_path, base_dir, reward_dir, tokenizer, prompts):
    trainer = ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts, value_model="adapter",
                          args=dict(value_learning_rate=1e-2))
    policy, source = trainer.model.policy, trainer.reward_source
    assert isinstance(source, AdapterReward) and source.policy is policy and trainer.ref_model is None
    assert set(policy.peft_config) == {"default", VALUE_ADAPTER, REWARD_ADAPTER}
    assert source.reward_stats is not None  # reward_stats.json of the adapter directory

    # one copy of the base: every role reads the same storage
    weight = policy.base_model.model.get_parameter(BASE_WEIGHT)
    roles = {"policy": policy, "reward": source.policy, "value": trainer.model.policy}
    assert {name: backbone_of(m).get_parameter(BASE_WEIGHT.removeprefix("model.")).data_ptr()
            for name, m in roles.items()} == dict.fromkeys(roles, weight.data_ptr())
    nbytes = {n: p.numel() * p.element_size() for n, p in trainer.model.named_parameters()}
    base_bytes = sum(b for n, b in nbytes.items() if "lora_" not in n and not n.startswith("value_head"))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in (trainer.model, source.head) for t in m.state_dict().values()}
    small = sum(nbytes.values()) - base_bytes + sum(p.numel() * 4 for p in source.head.parameters())
    assert sum(storages.values()) - small < 1.05 * base_bytes  # no second copy of the base anywhere

    trainable = trainable_names(trainer)
    assert trainable and all(".default." in n or f".{VALUE_ADAPTER}." in n or n.startswith("value_head.")
                             for n in trainable)
    assert any(f".{VALUE_ADAPTER}." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    head_before = source.head.weight.detach().clone()
    texts = sample_texts(prompts)
    rewards_before = source(*texts)

    trainer.train()
    value_ids = {id(p) for n, p in trainer.model.named_parameters() if f".{VALUE_ADAPTER}." in n or "value_head" in n}
    value_groups = [g for g in trainer.optimizer.param_groups if g["initial_lr"] == 1e-2]
    assert {id(p) for g in value_groups for p in g["params"]} == value_ids  # the value adapter gets the value lr
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(h["objective/raw_scores"])) for h in logs)

    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "nothing trained"
    assert changed <= trainable  # the base and the reward adapter never move
    assert any(".lora_B.default." in n for n in changed) and any(f".lora_B.{VALUE_ADAPTER}." in n for n in changed)
    assert "value_head.weight" in changed
    assert torch.equal(policy.base_model.model.get_parameter(BASE_WEIGHT), before["policy.base_model.model." +
                                                                                  BASE_WEIGHT])
    assert torch.equal(source.head.weight, head_before)
    # the scores are still the reward model's, whatever the policy adapter became
    assert_close(source(*texts), rewards_before)

    # no leak: the policy adapter is active, and only the trainables require grad
    assert policy.active_adapter == "default" and trainable_names(trainer) == trainable
    source(*texts)
    assert policy.active_adapter == "default" and trainable_names(trainer) == trainable


def test_adapter_scope_restores_the_adapter_and_requires_grad_on_error(base_dir, reward_dir, tokenizer, tmp_path,
                                                                        prompts):
    trainer = ppo_trainer(base_dir, f"adapter:{reward_dir}", tmp_path, tokenizer, prompts, value_model="adapter")
    policy = trainer.model.policy
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    for adapter in (REWARD_ADAPTER, VALUE_ADAPTER, None):
        with pytest.raises(RuntimeError, match="inside"):
            with adapter_scope(policy, adapter):
                assert policy.active_adapter == (adapter or "default")
                raise RuntimeError("inside")
        assert policy.active_adapter == "default"
        assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags


def test_value_adapter_trains_after_a_peft_switch_outside_adapter_scope(tmp_path, base_dir, tokenizer, prompts):
    # peft's own disable_adapter() leaves only the active adapter requiring grad on exit; the value adapter must
    # still be in the optimizer and get gradients (before the fix it was silently frozen: no 4-bit base needed)
    trainer = ppo_trainer(base_dir, lambda prompts, completions, **kw: [float(len(c)) for c in completions],
                          tmp_path, tokenizer, prompts, value_model="adapter", args=dict(max_steps=1, num_ppo_epochs=1))
    policy = trainer.model.policy
    value_names = {n for n in trainable_names(trainer) if f".{VALUE_ADAPTER}." in n}
    assert value_names
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with torch.no_grad(), policy.disable_adapter():
        policy(input_ids=torch.tensor([tokenizer.encode(prompts[0]["prompt"])]))

    trainer.train()
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    params = dict(trainer.model.named_parameters())
    assert {id(params[n]) for n in value_names} <= in_optimizer
    assert any(not torch.equal(params[n], before[n]) for n in value_names if ".lora_B." in n)
    assert value_names <= trainable_names(trainer) and policy.active_adapter == "default"


# ---------------------------------------------------------------------------------------------------
# (b) the one-base reward is the reward model's


def test_one_base_rewards_equal_a_separate_reward_model(tmp_path, base_dir, reward_dir, tokenizer, prompts):
    trainer = ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts)
    texts = sample_texts(prompts)
    separate = separate_reward(base_dir, reward_dir, tokenizer)
    expected = separate(*texts)
    assert expected.std() > 0  # the texts get different rewards
    assert_close(trainer.reward_source(*texts), expected, atol=1e-5, rtol=0)
    base_only = ModelReward(AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1), tokenizer)
    assert not torch.allclose(base_only(*texts), expected, atol=1e-3)  # the adapter matters

    # conversational rows go through the chat template on both paths
    chat = prompt_dataset(4, seed=5, conversational=True)
    completions = [[{"role": "assistant", "content": a}] for a in chat["answer"]]
    assert_close(trainer.reward_source(list(chat["prompt"]), completions),
                 separate(list(chat["prompt"]), completions), atol=1e-5, rtol=0)


def test_value_head_reward_adapter_equals_its_value_head_model(tmp_path, base_dir, tokenizer, prompts):
    from transformers import AutoModelForCausalLM

    model = ValueHeadModel(AutoModelForCausalLM.from_pretrained(base_dir))
    reward_dir = _train_reward(base_dir, tokenizer, str(tmp_path / "vh-rm"), model)
    trainer = ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts)
    texts = sample_texts(prompts)
    expected = ModelReward(ValueHeadModel.from_pretrained(reward_dir), tokenizer)(*texts)
    assert_close(trainer.reward_source(*texts), expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------
# checkpoints: the policy adapter alone as the policy, the value adapter + head loadable, resume exact


def test_one_base_checkpoints_save_the_trained_adapters_and_resume_exactly(tmp_path, base_dir, reward_dir,
                                                                            tokenizer, prompts):
    args = dict(save_strategy="steps", save_steps=1)
    trainer = ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts, value_model="adapter",
                          args=args)
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert sorted(os.listdir(checkpoint / "value")) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "value_head.safetensors"]
    assert not os.path.exists(checkpoint / REWARD_ADAPTER)  # the frozen reward adapter is not re-saved

    # the saved value function reloads as a ValueHeadModel giving the trainer's values
    trainer.save_model(str(tmp_path / "final"))
    value = ValueHeadModel.from_pretrained(str(tmp_path / "final" / "value")).eval()
    ids = tokenizer(["12+3=15"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).token_values
        assert_close(value(input_ids=ids).values, expected)

    # resume mid-rollout: the same logs as the uninterrupted run
    shutil.copytree(checkpoint, tmp_path / "resume" / "checkpoint-3")
    resumed = PPOTrainer(base_dir, RewardAdapter(reward_dir), args=make_args(tmp_path / "resume", **args),
                         train_dataset=prompts, processing_class=tokenizer, value_model="adapter",
                         model_config=lora_model_config(base_dir))
    resumed.train(resume_from_checkpoint=True)
    assert {h["step"]: h for h in resumed.state.log_history if "loss" in h}[4] == logs[4]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_one_base_critic_free_trains_the_policy_adapter_alone_and_resumes_exactly(tmp_path, base_dir, reward_dir,
                                                                                   tokenizer, prompts, estimator):
    """A critic-free estimator on one base: policy adapter + reward adapter, no value adapter or head anywhere."""
    args = dict(advantage_estimator=estimator, num_generations=1 if estimator == "reinforce_pp" else 2,
                save_strategy="steps", save_steps=1)
    trainer = ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts, args=args)
    policy = trainer.model.policy
    assert set(policy.peft_config) == {"default", REWARD_ADAPTER} and trainer.model.value_head is None
    trainable = trainable_names(trainer)
    assert trainable and all(".default." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed <= trainable and any(".lora_B.default." in n for n in changed)
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert "loss/value_avg" not in logs[4]

    checkpoint = tmp_path / "out" / "checkpoint-3"  # mid-rollout: 2 optimizer steps per rollout
    assert os.path.isfile(checkpoint / "adapter_model.safetensors") and os.path.isfile(
        checkpoint / "ppo_experience_rank0.pt")
    assert not os.path.exists(checkpoint / "value") and not os.path.exists(checkpoint / REWARD_ADAPTER)
    shutil.copytree(checkpoint, tmp_path / "resume" / "checkpoint-3")
    resumed = PPOTrainer(base_dir, RewardAdapter(reward_dir), args=make_args(tmp_path / "resume", **args),
                         train_dataset=prompts, processing_class=tokenizer, model_config=lora_model_config(base_dir))
    resumed.train(resume_from_checkpoint=True)
    assert {h["step"]: h for h in resumed.state.log_history if "loss" in h}[4] == logs[4]


# ---------------------------------------------------------------------------------------------------
# (c) the same on a 4-bit base


def test_one_base_ppo_on_a_4bit_base_trains_on_cpu(tmp_path, base_dir, reward_dir, tokenizer, prompts):
    bnb = pytest.importorskip("bitsandbytes")
    model_config = lora_model_config(base_dir, load_in_4bit=True)
    trainer = ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts, value_model="adapter",
                          model_config=model_config, args=dict(max_steps=2, num_ppo_epochs=1))
    policy = trainer.model.policy
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules())
    # bitsandbytes >= 0.49 repacks a 4-bit weight's storage for its CPU kernel at the first forward, so the packed
    # uint8 tensors are compared through what they compute: the reference (every adapter off) on fixed tokens
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if not p.requires_grad and not isinstance(p, bnb.nn.Params4bit)}
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    probe = torch.tensor([tokenizer.encode(prompts[0]["prompt"])])

    def reference_logits():
        with torch.no_grad(), adapter_scope(policy, None):  # peft's raw switch: test_value_adapter_trains_after_...
            return policy(input_ids=probe).logits

    reference_before = reference_logits()
    texts = sample_texts(prompts)
    rewards_before = trainer.reward_source(*texts)
    # 4-bit rounding moves the reward a little from the full-precision reward model, not a lot
    full = separate_reward(base_dir, reward_dir, tokenizer)(*texts)
    assert (rewards_before - full).abs().max() < 0.5

    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    after = dict(trainer.model.named_parameters())
    assert frozen and all(torch.equal(after[n], p) for n, p in frozen.items())  # reward adapter (and norms) unchanged
    assert_close(reference_logits(), reference_before, rtol=0, atol=0)  # the 4-bit base computes what it did
    assert any(not torch.equal(after[n], p) for n, p in trainable.items() if ".lora_B.default." in n)
    assert any(not torch.equal(after[n], p) for n, p in trainable.items() if f".lora_B.{VALUE_ADAPTER}." in n)
    assert_close(trainer.reward_source(*texts), rewards_before)
    assert policy.active_adapter == "default" and {n for n, p in after.items() if p.requires_grad} == set(trainable)


# ---------------------------------------------------------------------------------------------------
# errors


def test_one_base_configuration_errors(tmp_path, base_dir, reward_dir, tokenizer, prompts):
    with pytest.raises(ValueError, match="a RewardAdapter runs on the policy's own base, so the policy must be a LoRA"):
        PPOTrainer(build_toy_model(tokenizer), RewardAdapter(reward_dir), args=make_args(tmp_path / "a"),
                   train_dataset=prompts, processing_class=tokenizer)
    with pytest.raises(ValueError, match="value_model='adapter' puts the value function on the policy's base"):
        PPOTrainer(build_toy_model(tokenizer), lambda prompts, completions, **kw: [0.0] * len(completions),
                   args=make_args(tmp_path / "b"), train_dataset=prompts, processing_class=tokenizer,
                   value_model="adapter")
    with pytest.raises(ValueError, match="does not work with activation_checkpointing"):
        ppo_trainer(base_dir, RewardAdapter(reward_dir), tmp_path, tokenizer, prompts, value_model="adapter",
                    args=dict(activation_checkpointing=True))
    with pytest.raises(FileNotFoundError, match="is not a LoRA reward adapter directory"):
        ppo_trainer(base_dir, RewardAdapter(str(tmp_path)), tmp_path, tokenizer, prompts)
