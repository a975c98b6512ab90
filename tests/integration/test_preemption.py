"""Preemption (issue 44, item 2): SIGTERM saves a checkpoint at the next step boundary and stops, the recipe then
exits 0 and `--resume_from_checkpoint latest` goes on from it; SIGKILLs at seeded moments (between steps, inside a
save, mid-rollout, during a tool call), each resumed from the latest checkpoint, end with the uninterrupted run's
weights and logged metrics, exactly.

The runs are bench/chaos.py's (forked children stopped at a patched point, see its docstring): here one SIGTERM per
trainer and three kills of GRPO with tools; the ten kills per trainer are the slow tier.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datasets import DatasetDict

from hf_rlhf.toy import prompt_dataset
from hf_rlhf.training.checkpoints import checkpoint_problem, latest_complete_checkpoint

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread (tests/conftest.py): forking is safe with one."""


@pytest.fixture
def chaos():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import chaos

        yield chaos
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.modules.pop("chaos", None)


def assert_same_run(result):
    assert result["max_weight_difference"] == 0.0
    assert result["steps_logged"] and result["metrics_not_equal"] == [] and result["max_metric_difference"] == 0.0
    assert {"loss", "grad_norm"} <= set(result["metric_names"])


def assert_clean_sigterm(result, run_dir):
    term = result["sigterm"]
    assert term["exit"] == 0, term  # trainer.preempted was set: a SIGTERM stop, not the end of the run
    # the stop came at the next step boundary after the moment (inside a save: the step after that save)
    assert term["moment"][1] <= term["checkpoint_step"] <= term["moment"][1] + 2 * 4, term
    assert term["next_attempt_resumed_from"] == term["checkpoint_step"] or result["kills"] == 0


@pytest.mark.parametrize("kind", ["dpo", "ppo", "grpo_tools"])
def test_sigterm_saves_at_the_next_step_and_the_resumed_run_is_exact(tmp_path, chaos, kind):
    result = chaos.chaos(kind, str(tmp_path), kills=0, seed=3)
    assert_clean_sigterm(result, tmp_path / "chaos")
    assert_same_run(result)


def test_three_kills_of_grpo_with_tools_then_resume_is_exact(tmp_path, chaos):
    result = chaos.chaos("grpo_tools", str(tmp_path), kills=3, seed=0)
    assert result["killed_exit_codes"] == [-signal.SIGKILL]
    assert {m[0] for m in result["moments"]} & {"mid-rollout", "during a tool call"}  # seed 0 draws a tool call
    assert_clean_sigterm(result, tmp_path / "chaos")
    assert_same_run(result)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ppo", "grpo_tools", "dpo"])
def test_ten_kills_and_a_sigterm_then_resume_is_exact(tmp_path, chaos, kind):
    result = chaos.chaos(kind, str(tmp_path), kills=10, seed=0)
    assert result["kills"] == 10 and result["killed_exit_codes"] == [-signal.SIGKILL]
    hit = {m[0] for m in result["moments"]}
    assert {"between steps", "inside a save"} <= hit and (kind == "dpo" or hit & {"mid-rollout", "during a tool call"})
    assert_clean_sigterm(result, tmp_path / "chaos")
    assert_same_run(result)


def test_the_handler_is_put_back_after_training(tmp_path, chaos):
    from hf_rlhf.training.preemption import SaveOnSigtermCallback

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        trainer = chaos.build("dpo", tmp_path / "out")
        trainer.args.max_steps, trainer.args.save_strategy = 1, "no"
        seen = []

        class During(chaos.StepTracker):
            def on_step_end(self, args, state, control, **kwargs):
                seen.append(signal.getsignal(signal.SIGTERM))

        trainer.add_callback(During())
        trainer.train()
        assert isinstance(seen[0].__self__, SaveOnSigtermCallback)  # installed while training
        assert signal.getsignal(signal.SIGTERM) is mine and trainer.preempted is None
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------------
# the recipe on the command line: SIGTERM -> checkpoint, results.json saying so, exit 0; then resume


PPO_ARGS = ["--reward_source", "function", "--reward_function", "hf_rlhf.toy:reward_fn",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--num_mini_batches", "2",
            "--num_ppo_epochs", "2", "--response_length", "6", "--learning_rate", "3e-3", "--sample_prompts", "0",
            "--eval_size", "4", "--per_device_eval_batch_size", "4", "--plot", "false", "--save_strategy", "steps",
            "--save_steps", "2", "--logging_steps", "1", "--lr_scheduler_type", "constant", "--report_to", "none",
            "--disable_tqdm", "true", "--seed", "0", "--num_threads", "1"]


def test_hf_rlhf_ppo_on_sigterm_writes_a_checkpoint_and_exits_0_then_resumes(tmp_path, tiny_model_dir):
    data = tmp_path / "prompts"
    DatasetDict(train=prompt_dataset(64, seed=0), test=prompt_dataset(4, seed=0, split="test")).save_to_disk(data)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "hf_rlhf.cli", "ppo", "--dataset_name", str(data), "--model_name_or_path",
               str(tiny_model_dir), "--output_dir", str(out), *PPO_ARGS]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([*command, "--max_steps", "1000"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2").is_dir():  # training is under way
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.poll() else ""
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:  # a run that ignored the signal
            run.kill()
            run.wait()
    assert run.returncode == 0, output
    results = json.loads((out / "results.json").read_text())
    stop = results["preempted"]
    assert stop["signal"] == "SIGTERM" and stop["checkpoint"] == str(out / f"checkpoint-{stop['step']}")
    assert f"[hf_rlhf] SIGTERM: stopped at step {stop['step']} with checkpoint {stop['checkpoint']}" in output
    assert latest_complete_checkpoint(str(out)) == stop["checkpoint"] and checkpoint_problem(stop["checkpoint"]) is None
    assert "after" not in results and not (out / "model.safetensors").exists()  # nothing saved or evaluated after it
    total = stop["step"] + 2
    done = subprocess.run([*command, "--max_steps", str(total), "--resume_from_checkpoint", "latest"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = json.loads((out / "results.json").read_text())
    assert "preempted" not in resumed and "after" in resumed
    steps = [h["step"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert steps == list(range(1, total + 1))
