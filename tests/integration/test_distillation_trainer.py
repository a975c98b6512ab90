"""DistillationTrainer end to end on the toy world: it trains the student toward the teacher, logs TRL's metrics,
chunked == full logits, lmbda's dataset completions, the LoRA base as teacher, exact resume, bad inputs."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_rlhf import DistillationConfig, DistillationTrainer
from hf_rlhf.data import DataValidationError
from hf_rlhf.toy import build_toy_model, prompt_dataset, sft_dataset

pytestmark = pytest.mark.integration

TRL_METRICS = {"loss", "grad_norm", "learning_rate", "entropy", "num_tokens", "step_time", "completions/mean_length",
               "completions/min_length", "completions/max_length", "completions/clipped_ratio",
               "completions/mean_terminated_length", "completions/min_terminated_length",
               "completions/max_terminated_length"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def make_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_completion_length=6, max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                    learning_rate=3e-3, seed=0, disable_tqdm=True, beta=0.5)
    defaults.update(kw)
    return DistillationConfig(**defaults)


def step_logs(trainer, after: int = 0) -> dict[int, dict]:
    return {h["step"]: {k: v for k, v in h.items() if k != "step_time"}
            for h in trainer.state.log_history if "loss" in h and h["step"] > after}


def fixed_batch(tokenizer):
    """Prompts and right-padded completions in TRL's key layout (what `compute_loss` also takes)."""
    rows = sft_dataset(4, seed=3)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    completions = [tokenizer(r["completion"], add_special_tokens=False)["input_ids"] for r in rows]
    q, c = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    return {"prompt_ids": torch.tensor([[pad] * (q - len(p)) + p for p in prompts]),
            "prompt_mask": torch.tensor([[0] * (q - len(p)) + [1] * len(p) for p in prompts]),
            "completion_ids": torch.tensor([x + [pad] * (c - len(x)) for x in completions]),
            "completion_mask": torch.tensor([[1] * len(x) + [0] * (c - len(x)) for x in completions])}


def divergence_on(trainer, batch) -> float:
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item()


def test_trains_toward_the_teacher_and_logs_trl_metrics(tmp_path, tokenizer, prompts):
    teacher = build_toy_model(tokenizer, seed=1)
    trainer = DistillationTrainer(build_toy_model(tokenizer, seed=0), teacher, args=make_args(tmp_path, max_steps=8),
                                  train_dataset=prompts, processing_class=tokenizer)
    batch = fixed_batch(tokenizer)
    before = divergence_on(trainer, batch)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    trainer.train()
    after = divergence_on(trainer, batch)
    assert after < before * 0.9, (before, after)  # the student moved toward the teacher on text it never sampled
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_before.items())  # frozen
    logs = step_logs(trainer)
    assert sorted(logs) == list(range(1, 9))
    for log in logs.values():
        assert TRL_METRICS - {"step_time"} <= set(log), TRL_METRICS - set(log)
        assert log["on_policy"] == 1.0 and log["loss"] >= 0
    assert any("step_time" in h for h in trainer.state.log_history)
    assert logs[8]["num_tokens"] > logs[1]["num_tokens"]  # a running total, as TRL's


def test_chunked_lm_head_equals_the_full_logits(tmp_path, tokenizer, prompts):
    runs = {}
    for chunked in (False, True):
        trainer = DistillationTrainer(build_toy_model(tokenizer, seed=0), build_toy_model(tokenizer, seed=1),
                                      args=make_args(tmp_path / str(chunked), chunked_lm_head=chunked),
                                      train_dataset=prompts, processing_class=tokenizer)
        assert (trainer.heads is not None) == chunked
        trainer.train()
        runs[chunked] = trainer
    full, chunked = step_logs(runs[False]), step_logs(runs[True])
    for step in full:
        assert chunked[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-5, abs=1e-7)
        assert chunked[step]["grad_norm"] == pytest.approx(full[step]["grad_norm"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_beta_picks_the_kl_direction(tmp_path, tokenizer, prompts, beta):
    from hf_rlhf.losses.distillation import token_divergence
    from hf_rlhf.models.policy_value import response_logits

    trainer = DistillationTrainer(build_toy_model(tokenizer, seed=0), build_toy_model(tokenizer, seed=1),
                                  args=make_args(tmp_path, beta=beta, temperature=0.8), train_dataset=prompts,
                                  processing_class=tokenizer)
    b = fixed_batch(tokenizer)
    part = (b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"])
    with torch.no_grad():
        student = response_logits(trainer.model, *part)[0] / 0.8
        teacher = response_logits(trainer.teacher_model, *part)[0] / 0.8
    keep = b["completion_mask"].bool()
    p_s, p_t = student[keep].log_softmax(-1), teacher[keep].log_softmax(-1)
    kl = (p_t.exp() * (p_t - p_s)).sum(-1) if beta == 0 else (p_s.exp() * (p_s - p_t)).sum(-1)
    assert divergence_on(trainer, b) == pytest.approx(kl.mean().item(), rel=1e-5)
    assert token_divergence(student[keep] * 0.8, teacher[keep] * 0.8, beta, 0.8)[0].mean().item() == pytest.approx(
        kl.mean().item(), rel=1e-5)


def test_lmbda_mixes_dataset_completions_reproducibly(tmp_path, tokenizer):
    rows = sft_dataset(16, seed=1)  # prompt + completion rows
    calls = []

    def run(name, lmbda):
        model = build_toy_model(tokenizer, seed=0)
        original = model.generate
        model.generate = lambda *a, **k: calls.append(name) or original(*a, **k)
        trainer = DistillationTrainer(model, build_toy_model(tokenizer, seed=1),
                                      args=make_args(tmp_path / name, lmbda=lmbda, max_steps=6),
                                      train_dataset=rows, processing_class=tokenizer)
        trainer.train()
        return [log["on_policy"] for log in step_logs(trainer).values()], step_logs(trainer)

    never, logs = run("never", 0.0)
    assert never == [0.0] * 6 and "never" not in calls  # the dataset's completions only: no generation
    assert all(log["completions/clipped_ratio"] == 0.0 for log in logs.values())
    mixed, logs_a = run("mixed", 0.5)
    assert 0 < sum(mixed) < 6 and calls.count("mixed") == sum(mixed)
    again, logs_b = run("again", 0.5)
    assert again == mixed and logs_a == logs_b  # the draws are seeded: the same run twice


def test_lora_student_distils_from_its_own_base_with_adapters_off(tmp_path, tokenizer, base_dir, prompts):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = DistillationTrainer(base_dir, base_dir, args=make_args(tmp_path), train_dataset=prompts,
                                  processing_class=tokenizer, peft_config=lora)
    assert trainer.teacher_model is None  # one copy of the weights: the base is the teacher
    batch = fixed_batch(tokenizer)
    assert divergence_on(trainer, batch) == pytest.approx(0.0, abs=1e-7)  # LoRA starts as the identity
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    with torch.no_grad():  # move the adapters: the student now differs from its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    ours = divergence_on(trainer, batch)
    copy = DistillationTrainer(policy, AutoModelForCausalLM.from_pretrained(base_dir), args=make_args(tmp_path / "c"),
                               train_dataset=prompts, processing_class=tokenizer)
    assert copy.teacher_model is not None
    assert ours > 1e-4 and ours == pytest.approx(divergence_on(copy, batch), rel=1e-5)
    trainer.train()
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in step_logs(trainer).values())


def _resume_run(output_dir, tokenizer, counter, **kw):
    # 16 prompts / rollouts of 8 = 2 rollouts per epoch, each 4 optimizer steps of 2 rows: checkpoint-6 cuts a rollout
    args = make_args(output_dir, output_dir=str(output_dir), gradient_accumulation_steps=1, rollout_batch_size=8,
                     max_steps=12, save_strategy="steps", save_steps=2, lmbda=0.7, **kw)
    student = build_toy_model(tokenizer, seed=0)
    original = student.generate
    student.generate = lambda *a, **k: counter.append(1) or original(*a, **k)
    return DistillationTrainer(student, build_toy_model(tokenizer, seed=1), args=args,
                               train_dataset=sft_dataset(16, seed=1), processing_class=tokenizer)


def test_resume_is_exact_mid_rollout_without_regenerating(tmp_path, tokenizer):
    calls = []
    full = _resume_run(tmp_path / "full", tokenizer, calls)
    full.train()
    reference = step_logs(full)
    assert sorted(reference) == list(range(1, 13))
    for step in (4, 6):
        run_dir = tmp_path / f"resume-{step}"
        shutil.copytree(tmp_path / "full" / f"checkpoint-{step}", run_dir / f"checkpoint-{step}")
        calls.clear()
        resumed = _resume_run(run_dir, tokenizer, calls)
        resumed.train(resume_from_checkpoint=True)
        logs = step_logs(resumed, after=step)
        assert logs == {s: reference[s] for s in range(step + 1, 13)}, f"resumed from checkpoint-{step}"
    on_policy_after_6 = reference[9]["on_policy"] + reference[12]["on_policy"]  # rollouts 3 (steps 9-12): new
    assert len(calls) == on_policy_after_6  # the cut rollout (steps 5-8) came from the checkpoint


def test_bad_inputs_are_named_before_any_model_loads(tmp_path, tokenizer, base_dir, prompts, monkeypatch):
    import hf_rlhf.trainers.distillation_trainer as module

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(module.PPOTrainer, "__init__", no_loading)
    monkeypatch.setattr(module, "load_model", no_loading)
    other = tmp_path / "other-vocab"
    LlamaConfig(vocab_size=211, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32).save_pretrained(other)
    with pytest.raises(ValueError, match="vocab_size"):
        DistillationTrainer(base_dir, str(other), args=make_args(tmp_path), train_dataset=prompts)
    with pytest.raises(OSError, match="teacher model"):
        DistillationTrainer(base_dir, str(tmp_path / "missing"), args=make_args(tmp_path), train_dataset=prompts)
    rows = [dict(r) for r in sft_dataset(4, seed=1)]
    rows[2]["completion"] = " "
    with pytest.raises(DataValidationError, match="row 2, field 'completion'"):
        DistillationTrainer(base_dir, base_dir, args=make_args(tmp_path, lmbda=0.5), train_dataset=rows)
    with pytest.raises(DataValidationError, match="'completion' column"):
        DistillationTrainer(base_dir, base_dir, args=make_args(tmp_path, lmbda=0.5), train_dataset=prompts)
    with pytest.raises(DataValidationError, match="row 1"):
        DistillationTrainer(base_dir, base_dir, args=make_args(tmp_path), train_dataset=[{"prompt": "a"},
                                                                                        {"prompt": ""}])
    with pytest.raises(ValueError, match="teacher_model_init_kwargs"):
        args = make_args(tmp_path, teacher_model_init_kwargs={"dtype": "float32"})
        DistillationTrainer(base_dir, object(), args=args, train_dataset=prompts)
    with pytest.raises(ValueError, match="needs a teacher"):
        DistillationTrainer(base_dir, args=make_args(tmp_path), train_dataset=prompts)


@pytest.mark.parametrize(("options", "message"), [
    (dict(beta=1.5), "beta must be in"), (dict(lmbda=-0.1), "lmbda must be in"),
    (dict(use_vllm=True), "use_vllm=True is not supported: vLLM"),
    (dict(model_init_kwargs={"revision": "main"}), r"\['revision'\] not supported"),
    (dict(max_completion_length=8, response_length=9), "one option under TRL's and PPOConfig's names"),
])
def test_config_refuses_by_name(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **options)


def test_config_converts_trl_options(tmp_path):
    args = make_args(tmp_path, max_completion_length=9, min_p=0.1, repetition_penalty=1.2, vllm_mode="server",
                     model_init_kwargs='{"dtype": "float32", "device_map": null}')
    assert args.response_length == args.max_completion_length == 9
    assert args.generation_kwargs == {"min_p": 0.1, "repetition_penalty": 1.2}
    assert args.model_init_kwargs == {"dtype": "float32", "device_map": None}
    assert args.old_logprobs_in_loss and not args.uses_reference


def test_evaluate_samples_the_eval_prompts(tmp_path, tokenizer, prompts):
    teacher = build_toy_model(tokenizer, seed=1)
    eval_rows = prompt_dataset(6, seed=5, split="test")
    trainer = DistillationTrainer(build_toy_model(tokenizer, seed=0), teacher,
                                  args=make_args(tmp_path, eval_strategy="steps", eval_steps=2, max_steps=2),
                                  train_dataset=prompts, eval_dataset={"a": eval_rows, "b": eval_rows},
                                  processing_class=tokenizer)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_a_loss" in h]
    assert evals and evals[0]["eval_a_loss"] > 0 and evals[0]["eval_a_entropy"] > 0
    self_distilled = DistillationTrainer(teacher, build_toy_model(tokenizer, seed=1), args=make_args(tmp_path / "s"),
                                         train_dataset=prompts, processing_class=tokenizer)
    assert self_distilled.evaluate(eval_rows)["eval_loss"] == pytest.approx(0.0, abs=1e-6)
