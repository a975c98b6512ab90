"""`hf_rlhf.DistillationTrainer` against `trl.DistillationTrainer` (1.16) on the same tiny fp32 models and data.

Asserted: the loss of one batch (TRL's key layout) agrees to 1e-5 for forward KL, JSD and reverse KL at a
temperature, with and without `num_items_in_batch`, and so does the logged entropy; a 3-step run with greedy
completions (`generation_kwargs={"do_sample": False}`, so both sample the same text) logs the same loss at every
step, and the same metric names (hf_rlhf adds `on_policy`, lmbda's share of student-sampled rollouts).
"""

import pytest
import torch
from datasets import Dataset

pytestmark = pytest.mark.integration

trl = pytest.importorskip("trl")
import hf_rlhf  # noqa: E402
from hf_rlhf.toy import build_toy_model, build_toy_tokenizer, prompt_dataset  # noqa: E402

TRAINER_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
                "epoch", "step"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer = build_toy_tokenizer()
    paths = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        paths[name] = str(tmp_path_factory.mktemp(name))
        build_toy_model(tokenizer, seed=seed).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return tokenizer, paths


def make(lib, tmp_path, models, prompts, **kw):
    tokenizer, paths = models
    options = dict(output_dir=str(tmp_path / lib.__name__), per_device_train_batch_size=2,
                   gradient_accumulation_steps=2, max_completion_length=6, max_steps=3, logging_steps=1,
                   save_strategy="no", report_to="none", learning_rate=1e-2, seed=0, disable_tqdm=True,
                   bf16=False, gradient_checkpointing=False, use_cpu=True,
                   model_init_kwargs={"dtype": "float32", "device_map": None},
                   teacher_model_init_kwargs={"dtype": "float32", "device_map": None})
    options.update(kw)
    return lib.DistillationTrainer(model=paths["student"], teacher_model=paths["teacher"],
                                   args=lib.DistillationConfig(**options), train_dataset=prompts,
                                   processing_class=tokenizer)


def batch(tokenizer):
    rows = [("12+7=", "19"), ("reverse abc:", "cba"), ("max 3 9 4:", "9 and more")]
    prompts = [tokenizer(p)["input_ids"] for p, _ in rows]
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] for _, c in rows]
    q, c, pad = max(map(len, prompts)), max(map(len, completions)), tokenizer.pad_token_id
    return {"prompt_ids": torch.tensor([[pad] * (q - len(p)) + p for p in prompts]),
            "prompt_mask": torch.tensor([[0] * (q - len(p)) + [1] * len(p) for p in prompts]),
            "completion_ids": torch.tensor([x + [pad] * (c - len(x)) for x in completions]),
            "completion_mask": torch.tensor([[1] * len(x) + [0] * (c - len(x)) for x in completions])}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_one_batch_loss_and_entropy_equal_trl(tmp_path, models, beta):
    prompts = prompt_dataset(8, seed=0)
    inputs = batch(models[0])
    results = {}
    for lib in (trl, hf_rlhf):
        trainer = make(lib, tmp_path, models, prompts, beta=beta, temperature=0.7)
        trainer.model.train()
        losses = [trainer.compute_loss(trainer.model, inputs, num_items_in_batch=n) for n in (None, torch.tensor(9))]
        assert losses[0].requires_grad
        entropy = (trainer._metrics["train"]["entropy"][-1] if lib is trl else
                   trainer.metrics["train"].totals(trainer.accelerator)["entropy"])
        results[lib.__name__] = ([loss.item() for loss in losses], entropy)
    (trl_losses, trl_entropy), (our_losses, our_entropy) = results["trl"], results["hf_rlhf"]
    assert our_losses == pytest.approx(trl_losses, rel=1e-5, abs=1e-6)
    assert our_entropy[0] / our_entropy[1] == pytest.approx(trl_entropy, rel=1e-5)


def test_greedy_run_logs_trl_losses_and_metric_names(tmp_path, models):
    # the 4 prompts are one generation (2 x 2): every step sees them all, whatever order each library draws
    prompts = Dataset.from_list([dict(r) for r in prompt_dataset(4, seed=0)])
    logs = {}
    for lib in (trl, hf_rlhf):
        trainer = make(lib, tmp_path, models, prompts, beta=0.5, generation_kwargs={"do_sample": False})
        trainer.train()
        logs[lib.__name__] = [h for h in trainer.state.log_history if "loss" in h]
    ours, theirs = logs["hf_rlhf"], logs["trl"]
    assert [h["step"] for h in ours] == [h["step"] for h in theirs] == [1, 2, 3]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
        for name in ("completions/mean_length", "completions/clipped_ratio", "num_tokens"):
            assert a[name] == pytest.approx(b[name]), name
        assert set(a) - TRAINER_KEYS == (set(b) - TRAINER_KEYS) | {"on_policy"}
