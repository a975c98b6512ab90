"""PPOTrainer end to end on the toy world: rewards, callbacks, exact resume, dropout, LoRA, other tokenizers, errors."""

import logging
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from hf_rlhf.data import DataValidationError
from hf_rlhf.rewards import RewardError
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, prompt_dataset, reward_fn, sft_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

TRL_METRICS = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
               "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/num_eos_tokens", "objective/kl_coef"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def make_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_ppo_epochs=1, response_length=6, max_steps=2, logging_steps=1, save_strategy="no",
                    report_to="none", learning_rate=3e-3, seed=0, disable_tqdm=True, temperature=1.0)
    defaults.update(kw)
    return PPOConfig(**defaults)


def step_logs(trainer, after: int = 0) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h and h["step"] > after}


def digit_reward(prompts, completions, **kwargs):
    """A reward that varies with the random policy's text (the toy answers are never right at first)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def count_generate(model, counter: list):
    original = model.generate

    def generate(*args, **kwargs):
        counter.append(1)
        return original(*args, **kwargs)

    model.generate = generate
    return model


# ---------------------------------------------------------------------------------------------------
# (1) a Python reward function trains


def test_function_reward_trains_and_logs_trl_metrics(tmp_path, tokenizer, prompts):
    seen = []

    def recording_reward(prompts, completions, **kwargs):
        seen.append(kwargs)
        return reward_fn(prompts, completions, **kwargs)

    policy = build_toy_model(tokenizer)
    args = make_args(tmp_path, max_steps=4, num_ppo_epochs=2, kl_coef=0.1)
    trainer = PPOTrainer(policy, recording_reward, args=args, train_dataset=prompts, processing_class=tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert "value_head.weight" in changed and any(n.startswith("policy.model.layers") for n in changed)
    logs = step_logs(trainer)
    assert sorted(logs) == [1, 2, 3, 4]
    for log in logs.values():
        assert set(TRL_METRICS) <= set(log), set(TRL_METRICS) - set(log)
        assert log["objective/kl_coef"] == pytest.approx(0.1)  # fixed controller
    assert seen and set(seen[0]) == {"answer"} and len(seen[0]["answer"]) == args.rollout_batch_size

    # the policy saves as a plain causal LM that reloads; the value head goes to value/
    trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(tmp_path / "final" / "value" / "value_head.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for name, param in reloaded.state_dict().items():
        torch.testing.assert_close(param, trainer.model.policy.state_dict()[name])


# ---------------------------------------------------------------------------------------------------
# (2) every Trainer callback event


class EventRecorder(TrainerCallback):
    EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
              "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_save", "on_epoch_end",
              "on_train_end")

    def __init__(self):
        self.seen = []
        for event in self.EVENTS:
            setattr(self, event, lambda *args, _event=event, **kwargs: self.seen.append(_event))


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_every_callback_event_fires(tmp_path, tokenizer, prompts, estimator):
    recorder = EventRecorder()
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, **ESTIMATORS[estimator])
    trainer = PPOTrainer(build_toy_model(tokenizer), reward_fn, args=args, train_dataset=prompts,
                         processing_class=tokenizer, callbacks=[recorder])
    trainer.train()
    assert set(recorder.seen) == set(EventRecorder.EVENTS)
    assert recorder.seen.count("on_substep_end") == 2  # gradient_accumulation_steps=2: one substep per step


# ---------------------------------------------------------------------------------------------------
# (3) resume = an uninterrupted run, with no rollout regenerated


# the estimators' options for the runs below: G = 2 samples per prompt, each with its own KL placement and loss_type
ESTIMATORS = {
    "gae": {},
    "grpo": dict(advantage_estimator="grpo", num_generations=2, kl_in_loss=True, kl_estimator="k3", loss_type="grpo"),
    "rloo": dict(advantage_estimator="rloo", num_generations=2, normalize_advantages=True, loss_type="bnpo"),
    "reinforce_pp": dict(advantage_estimator="reinforce_pp", loss_type="dr_grpo"),
    "reinforce_pp_baseline": dict(advantage_estimator="reinforce_pp_baseline", num_generations=2),
}


def _resume_trainer(output_dir, tokenizer, prompts, counter, estimator="gae", **kw):
    # 16 prompts (8 with 2 samples each) / rollouts of 4 rows = 4 rollouts per epoch; a rollout = 2 mini-batches x 2
    # ppo epochs = 4 steps
    options = ESTIMATORS[estimator]
    if options.get("num_generations", 1) > 1:
        prompts = prompts.select(range(len(prompts) // options["num_generations"]))
    args = PPOConfig(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     num_mini_batches=2, num_ppo_epochs=2, response_length=6, max_steps=20, logging_steps=1,
                     save_strategy="steps", save_steps=2, report_to="none", learning_rate=3e-3, seed=0,
                     disable_tqdm=True, temperature=1.0, kl_target=0.5, kl_horizon=40,
                     reward_normalization="running", **options, **kw)
    policy = count_generate(build_toy_model(tokenizer), counter)
    return PPOTrainer(policy, digit_reward, args=args, train_dataset=prompts, processing_class=tokenizer)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_resume_logs_exactly_what_an_uninterrupted_run_logs(tmp_path, tokenizer, prompts, estimator):
    calls = []
    full = _resume_trainer(tmp_path / "full", tokenizer, prompts, calls, estimator)
    full.train()
    reference = step_logs(full)
    assert sorted(reference) == list(range(1, 21)) and len(calls) == 5  # 20 steps / 4 per rollout
    assert len({log["objective/kl_coef"] for log in reference.values()}) == 5  # adaptive: a new β each rollout

    # checkpoint -> (restore flag, rollouts generated after resuming)
    cases = {4: (False, 4),    # at a rollout boundary: the next rollout is new
             6: (False, 3),    # mid-rollout: that rollout comes from the checkpoint, not regenerated
             18: (True, 0)}    # mid-rollout in the second epoch, callbacks restored by the Trainer itself
    for step, (restore_flag, expected_calls) in cases.items():
        run_dir = tmp_path / f"resume-{step}"
        shutil.copytree(tmp_path / "full" / f"checkpoint-{step}", run_dir / f"checkpoint-{step}")
        calls.clear()
        resumed = _resume_trainer(run_dir, tokenizer, prompts, calls, estimator,
                                  restore_callback_states_from_checkpoint=restore_flag)
        resumed.train(resume_from_checkpoint=True)
        logs = step_logs(resumed, after=step)
        assert sorted(logs) == list(range(step + 1, 21))
        for s, log in logs.items():
            expected = {k: v for k, v in reference[s].items()}
            assert log == expected, f"resumed from checkpoint-{step}, step {s}"
        assert len(calls) == expected_calls, f"resumed from checkpoint-{step}"
        # β came back from the checkpoint (it is not the initial 0.05)
        assert logs[step + 1]["objective/kl_coef"] != pytest.approx(0.05)

    # a mid-rollout checkpoint without its experience file cannot resume silently
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "full" / "checkpoint-6", broken / "checkpoint-6")
    os.remove(broken / "checkpoint-6" / "ppo_experience_rank0.pt")
    with pytest.raises(FileNotFoundError, match="ppo_experience_rank0.pt"):
        _resume_trainer(broken, tokenizer, prompts, [], estimator).train(resume_from_checkpoint=True)


# ---------------------------------------------------------------------------------------------------
# (4) dropout is off in the policy: the first ratio of a rollout is 1


def _with_attention_dropout(model, p):
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p
    model.config.attention_dropout = p
    return model


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_first_minibatch_ratio_is_one_with_dropout_off(tmp_path, tokenizer, prompts, disable_dropout):
    policy = _with_attention_dropout(build_toy_model(tokenizer), 0.5)
    args = make_args(tmp_path, max_steps=1, gradient_accumulation_steps=1, disable_dropout=disable_dropout)
    trainer = PPOTrainer(policy, reward_fn, args=args, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    first = step_logs(trainer)[1]
    if disable_dropout:
        assert first["policy/approxkl_avg"] < 1e-10 and first["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    else:  # the control: with dropout on in training, the old (eval-mode) log-probs differ at once
        assert first["policy/approxkl_avg"] > 1e-4


# ---------------------------------------------------------------------------------------------------
# (5) LoRA policy: the reference is the policy with adapters disabled


def test_lora_policy_reference_is_adapters_off(tmp_path, tokenizer, prompts):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1, task_type="CAUSAL_LM")
    args = make_args(tmp_path, max_steps=4, num_ppo_epochs=2, save_strategy="steps", save_steps=1)
    trainer = PPOTrainer(build_toy_model(tokenizer), reward_fn, args=args, train_dataset=prompts,
                         processing_class=tokenizer, peft_config=lora)
    assert trainer.ref_model is None  # no frozen copy: the base weights are the reference
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    logs = step_logs(trainer)
    assert logs[1]["objective/kl"] == 0.0  # LoRA's B starts at 0: policy == reference at the first rollout
    assert logs[3]["objective/kl"] != 0.0
    for name, param in trainer.model.named_parameters():
        if name.startswith("policy.") and "lora_" not in name:
            assert torch.equal(param, base[name]), name  # the frozen base never moves

    # the reference log-probs are the untouched base model's
    policy, fresh = trainer.model.policy, build_toy_model(tokenizer)
    ids = tokenizer(["12+3="], return_tensors="pt")["input_ids"]
    with torch.no_grad(), policy.disable_adapter():
        torch.testing.assert_close(policy(input_ids=ids).logits, fresh(input_ids=ids).logits)

    # checkpoints hold the adapter (not the base), and resuming mid-rollout from one is exact
    assert os.path.isfile(tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors")
    assert not os.path.isfile(tmp_path / "out" / "checkpoint-2" / "model.safetensors")
    shutil.copytree(tmp_path / "out" / "checkpoint-3", tmp_path / "resume" / "checkpoint-3")
    resumed = PPOTrainer(build_toy_model(tokenizer), reward_fn, args=make_args(
        tmp_path, output_dir=str(tmp_path / "resume"), max_steps=4, num_ppo_epochs=2, save_strategy="steps",
        save_steps=1), train_dataset=prompts, processing_class=tokenizer, peft_config=lora)
    resumed.train(resume_from_checkpoint=True)
    assert step_logs(resumed, after=3)[4] == logs[4]


# ---------------------------------------------------------------------------------------------------
# (6) a reward model with a different tokenizer


def _reversed_char_tokenizer():
    """A character tokenizer unlike the toy one: other special tokens, reversed character ids, no chat template."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    chars = sorted(set(string.printable), reverse=True)
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", pad_token="[PAD]",
                                   unk_token="[UNK]", model_max_length=256)


def test_reward_model_with_its_own_tokenizer(tmp_path, tokenizer, prompts):
    reward_tokenizer = _reversed_char_tokenizer()
    reward_model = build_toy_reward_model(reward_tokenizer)
    reward_model.config.reward_mean, reward_model.config.reward_std = 0.25, 2.0  # as RewardTrainer stores them
    seen = []
    reward_model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"]),
                                           with_kwargs=True)
    args = make_args(tmp_path, max_steps=2, reward_normalization="model_stats")
    trainer = PPOTrainer(build_toy_model(tokenizer), reward_model, args=args, train_dataset=prompts,
                         processing_class=tokenizer, reward_processing_class=reward_tokenizer)
    trainer.train()

    texts = [reward_tokenizer.decode(row, skip_special_tokens=False) for batch in seen for row in batch]
    texts = [t.replace("[PAD]", "") for t in texts]  # left padding
    assert all(t.startswith("[CLS]") and t.endswith("[SEP]") for t in texts)
    # [CLS] prompt + completion [SEP], in the reward tokenizer's ids
    assert all(any(t.removeprefix("[CLS]").startswith(p) for p in prompts["prompt"]) for t in texts)
    assert tokenizer.convert_tokens_to_ids("1") != reward_tokenizer.convert_tokens_to_ids("1")  # re-tokenized
    log = step_logs(trainer)[1]
    assert log["objective/scores"] == pytest.approx((log["objective/raw_scores"] - 0.25) / 2.0, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# value model (b), value learning rate, PPO-ptx, conversational prompts


def test_value_model_value_lr_ptx_and_conversational_prompts(tmp_path, tokenizer):
    value_model = build_toy_reward_model(tokenizer, seed=1)
    args = make_args(tmp_path, max_steps=2, value_learning_rate=1e-2, ptx_coef=0.5)
    trainer = PPOTrainer(build_toy_model(tokenizer), reward_fn, args=args,
                         train_dataset=prompt_dataset(8, seed=1, conversational=True), processing_class=tokenizer,
                         value_model=value_model, ptx_dataset=sft_dataset(8, seed=2))
    trainer.train()
    log = step_logs(trainer)[2]
    assert log["loss/ptx_avg"] > 0 and torch.isfinite(torch.tensor(log["loss"]))
    value_ids = {id(p) for p in value_model.parameters()}
    value_groups = [g for g in trainer.optimizer.param_groups if any(id(p) in value_ids for p in g["params"])]
    assert value_groups and all(g["initial_lr"] == 1e-2 for g in value_groups)
    assert all(id(p) in value_ids for g in value_groups for p in g["params"])
    trainer.save_model(str(tmp_path / "final"))
    assert os.path.isfile(tmp_path / "final" / "value" / "model.safetensors")


# ---------------------------------------------------------------------------------------------------
# (7) bad input, with clear errors


def test_prompts_longer_than_max_prompt_length(tmp_path, tokenizer, prompts):
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts["prompt"]]
    limit = sorted(lengths)[len(lengths) // 2]
    with pytest.raises(DataValidationError, match=r"row \d+, field 'prompt': expected at most max_prompt_length="):
        PPOTrainer(build_toy_model(tokenizer), reward_fn, args=make_args(tmp_path, max_prompt_length=limit),
                   train_dataset=prompts, processing_class=tokenizer)
    dropped = PPOTrainer(build_toy_model(tokenizer), reward_fn, train_dataset=prompts, processing_class=tokenizer,
                         args=make_args(tmp_path, max_prompt_length=limit, prompt_overlong_policy="drop"))
    assert len(dropped.train_dataset) == sum(n <= limit for n in lengths)
    cut = PPOTrainer(build_toy_model(tokenizer), reward_fn, train_dataset=prompts, processing_class=tokenizer,
                     args=make_args(tmp_path, max_prompt_length=limit, prompt_overlong_policy="truncate"))
    assert max(len(ids) for ids in cut.train_dataset["input_ids"]) == limit


def boom(prompts, completions, **kwargs):
    return [1.0 / 0 for _ in completions]


def nan_in_row_1(prompts, completions, **kwargs):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


def too_few(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


@pytest.mark.parametrize("reward, message", [
    (boom, r"reward function 'boom' raised ZeroDivisionError"),
    (nan_in_row_1, r"reward function 'nan_in_row_1' returned nan for row 1 \(prompt .*\).*\[dataset row \d+\]"),
    (too_few, r"reward function 'too_few' returned 3 scores for 4 completions"),
])
def test_bad_reward_functions_raise_clear_errors(tmp_path, tokenizer, prompts, reward, message):
    trainer = PPOTrainer(build_toy_model(tokenizer), reward, args=make_args(tmp_path, max_steps=1),
                         train_dataset=prompts, processing_class=tokenizer)
    with pytest.raises(RewardError, match=message):
        trainer.train()


def test_responses_that_never_stop_get_the_missing_eos_penalty(tmp_path, tokenizer, prompts, caplog):
    args = make_args(tmp_path, max_steps=1, missing_eos_penalty=1.5,
                     generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]})
    trainer = PPOTrainer(build_toy_model(tokenizer), lambda prompts, completions, **kw: [1.0] * len(completions),
                         args=args, train_dataset=prompts, processing_class=tokenizer)
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        trainer.train()
    log = step_logs(trainer)[1]
    assert log["val/num_eos_tokens"] == 0
    assert log["objective/raw_scores"] == 1.0 and log["objective/scores"] == pytest.approx(-0.5)
    assert "no response of this rollout produced the stop token" in caplog.text


def test_configuration_errors(tmp_path, tokenizer, prompts):
    with pytest.raises(ValueError, match="rollout_batch_size=6 must be a positive multiple of"):
        make_args(tmp_path, rollout_batch_size=6, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kl_ctl'"):
        make_args(tmp_path, kl_ctl=0.1)
    with pytest.raises(ValueError, match=r"PPOConfig.kl_estimator='abs'; expected one of \['k1', 'k2', 'k3'\]"):
        make_args(tmp_path, kl_estimator="abs")
    with pytest.raises(ValueError, match="reward_normalization='model_stats' needs reward_mean / reward_std"):
        PPOTrainer(build_toy_model(tokenizer), reward_fn, args=make_args(tmp_path, reward_normalization="model_stats"),
                   train_dataset=prompts, processing_class=tokenizer)
    with pytest.raises(ValueError, match="one rollout takes rollout_batch_size / num_generations x processes = 32 x 1 "
                                         "prompts"):
        PPOTrainer(build_toy_model(tokenizer), reward_fn, args=make_args(tmp_path, rollout_batch_size=32),
                   train_dataset=prompts, processing_class=tokenizer).train()
