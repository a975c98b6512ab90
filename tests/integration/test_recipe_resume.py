"""The recipes resume: `--resume_from_checkpoint true` (or `latest`, or a path) after a run stopped at a checkpoint
reads as the uninterrupted run: the same results.json keys and values (train_loss over the whole run), SFT's
num_tokens going on from the checkpoint, PPO's completions log without a repeated block (issue 13, item 2); and a
non-finite stop in a recipe writes a results.json that says so, saves and evaluates nothing and exits non-zero.

The interrupted run is the same command stopped early with `max_steps` (a constant learning rate, so the schedule
does not depend on where the run stops); the kill -9 variants of resume are in test_faults.py.
"""

import json
import math
import os

import pytest
from datasets import DatasetDict

from hf_rlhf import SFTTrainer
from hf_rlhf.cli.resume import resume_argument
from hf_rlhf.toy import prompt_dataset, sft_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig  # noqa: F401  (the recipes' config, imported for the parser's types)
from recipes import ppo as ppo_recipe
from recipes import reward as reward_recipe
from recipes import sft as sft_recipe

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1", "--lr_scheduler_type", "constant",
          "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]
VARYING = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}  # wall-clock figures


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def read(path):
    with open(path) as f:
        return json.load(f)


def logs(path):
    return {h["step"]: h for h in read(path)["log_history"] if "loss" in h}


def assert_same_results(reference: dict, resumed: dict):
    assert set(reference) == set(resumed)
    assert set(reference["train"]) == set(resumed["train"])
    for key, value in reference["train"].items():
        if key not in VARYING:
            assert resumed["train"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    for part in set(reference) - {"train", "timings", "plots"}:
        assert resumed[part] == pytest.approx(reference[part], rel=1e-6) if isinstance(reference[part], dict) \
            and all(isinstance(v, float) for v in reference[part].values()) else resumed[part] == reference[part], part


def run_three_ways(main, argv, tmp_path, steps, stop_at):
    """(uninterrupted results, resumed results, their output dirs): the resumed run stopped at `stop_at` first."""
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    reference = main([*argv, "--output_dir", full, "--max_steps", str(steps)])
    main([*argv, "--output_dir", cut, "--max_steps", str(stop_at)])
    resumed = main([*argv, "--output_dir", cut, "--max_steps", str(steps), "--resume_from_checkpoint", "true"])
    assert read(os.path.join(cut, "results.json")) == json.loads(json.dumps(resumed, default=float))
    return reference, resumed, full, cut


def test_resume_argument():
    assert resume_argument("True") == resume_argument("latest") == resume_argument(True) == "latest"
    assert resume_argument(None) is None and resume_argument("false") is None
    with pytest.raises(FileNotFoundError, match="--resume_from_checkpoint nowhere: no such checkpoint folder"):
        resume_argument("nowhere")


def test_sft_recipe_resumed_reads_as_the_uninterrupted_run(tmp_path, tiny_model_dir):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_dataset(48, seed=1)))
    argv = ["--dataset_name", str(data), "--model_name_or_path", str(tiny_model_dir), "--per_device_train_batch_size",
            "4", "--learning_rate", "1e-3", "--max_length", "48", *COMMON]
    reference, resumed, full, cut = run_three_ways(sft_recipe.main, argv, tmp_path, steps=6, stop_at=3)
    assert_same_results(reference, resumed)
    # the whole run's logs, num_tokens included, as the uninterrupted run's (checkpoint-6 of each)
    ref_logs, cut_logs = logs(f"{full}/checkpoint-6/trainer_state.json"), logs(f"{cut}/checkpoint-6/trainer_state.json")
    assert sorted(ref_logs) == sorted(cut_logs) == [1, 2, 3, 4, 5, 6]
    for step, h in ref_logs.items():
        assert cut_logs[step]["num_tokens"] == h["num_tokens"], step
        assert cut_logs[step]["loss"] == pytest.approx(h["loss"], rel=1e-6), step
    assert ref_logs[6]["num_tokens"] > ref_logs[3]["num_tokens"] > 0


def test_reward_recipe_resumed_reads_as_the_uninterrupted_run(tmp_path):
    argv = ["--config", os.path.join(ROOT, "recipes", "configs", "reward_toy.yaml"), "--sft_model_path",
            str(tmp_path / "no-sft"), "--toy_train_size", "64", "--toy_test_size", "16", "--toy_model_size", "tiny",
            "--per_device_train_batch_size", "8", *COMMON]
    reference, resumed, _, cut = run_three_ways(reward_recipe.main, argv, tmp_path, steps=6, stop_at=4)
    assert_same_results(reference, resumed)
    assert sorted(n for n in os.listdir(cut) if n.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-4",
                                                                               "checkpoint-6"]


def test_ppo_recipe_resumed_reads_as_the_uninterrupted_run(tmp_path, tiny_model_dir):
    data = tmp_path / "prompts"
    DatasetDict(train=prompt_dataset(16, seed=0), test=prompt_dataset(4, seed=0, split="test")).save_to_disk(data)
    argv = ["--dataset_name", str(data), "--model_name_or_path", str(tiny_model_dir), "--reward_source", "function",
            "--reward_function", "hf_rlhf.toy:reward_fn", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
            "--response_length", "6", "--temperature", "1.0", "--kl_target", "0.5", "--kl_horizon", "40",
            "--reward_normalization", "running", "--learning_rate", "3e-3", "--sample_prompts", "2",
            "--sample_every", "2", "--eval_size", "4", "--per_device_eval_batch_size", "4", "--plot", "false", *COMMON]
    # a rollout is 4 optimizer steps: the run stops at 6, inside the second rollout
    reference, resumed, full, cut = run_three_ways(ppo_recipe.main, argv, tmp_path, steps=8, stop_at=6)
    assert_same_results(reference, resumed)
    with open(os.path.join(full, "completions.jsonl")) as f:
        expected = f.read()
    with open(os.path.join(cut, "completions.jsonl")) as f:
        got = f.read()
    assert [json.loads(line)["step"] for line in got.splitlines()] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]
    assert got == expected


# ---------------------------------------------------------------------------------------------------
# a non-finite stop inside a recipe


def nan_at(trainer_class, nan_step):
    class NaNAt(trainer_class):
        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step + 1 == nan_step:
                return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")
            return out

    return NaNAt


def test_sft_recipe_after_a_nonfinite_stop_saves_nothing_and_exits_with_the_message(tmp_path, tiny_model_dir,
                                                                                     monkeypatch):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_dataset(48, seed=1)))
    monkeypatch.setattr(sft_recipe, "SFTTrainer", nan_at(SFTTrainer, 3))
    evaluated = []
    monkeypatch.setattr(SFTTrainer, "evaluate", lambda *a, **k: evaluated.append(1) or {})
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        sft_recipe.main(["--dataset_name", str(data), "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                         str(out), "--max_steps", "6", "--per_device_train_batch_size", "4", "--max_length", "48",
                         *COMMON])
    message = str(e.value.code)
    assert message.startswith("[hf_rlhf] training stopped at step 3: ") and "is not finite" in message
    assert f"the last good checkpoint is {out / 'checkpoint-2'}" in message
    results = read(out / "results.json")
    stopped = results["stopped"]
    assert stopped["step"] == 3 and math.isnan(stopped["value"])
    assert stopped["last_good_checkpoint"] == str(out / "checkpoint-2")
    assert "after" not in results and results["train"]["nonfinite_stop_step"] == 3
    assert not os.path.exists(out / "model.safetensors") and not evaluated


def test_ppo_recipe_after_a_nonfinite_stop_does_not_evaluate_the_policy(tmp_path, tiny_model_dir, monkeypatch):
    data = tmp_path / "prompts"
    DatasetDict(train=prompt_dataset(16, seed=0), test=prompt_dataset(4, seed=0, split="test")).save_to_disk(data)
    monkeypatch.setattr(ppo_recipe, "PPOTrainer", nan_at(ppo_recipe.PPOTrainer, 2))
    calls = []
    real = ppo_recipe.evaluate_completions
    monkeypatch.setattr(ppo_recipe, "evaluate_completions", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="training stopped at step 2"):
        ppo_recipe.main(["--dataset_name", str(data), "--model_name_or_path", str(tiny_model_dir), "--reward_source",
                         "function", "--reward_function", "hf_rlhf.toy:reward_fn", "--output_dir", str(out),
                         "--per_device_train_batch_size", "2", "--num_mini_batches", "2", "--num_ppo_epochs", "1",
                         "--response_length", "4", "--max_steps", "4", "--eval_size", "4", "--sample_prompts", "0",
                         "--plot", "false", *COMMON])
    assert calls == [1]  # before training only
    results = read(out / "results.json")
    assert results["stopped"]["step"] == 2 and "after" not in results and "before" in results
    assert not os.path.exists(out / "policy") and not os.path.exists(out / "model.safetensors")
