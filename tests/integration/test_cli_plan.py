"""`hf-rlhf plan`: the predicted memory table of a run, from a saved model's directory."""

import subprocess
import sys

import pytest

from hf_rlhf.cli.main import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from hf_rlhf.toy import build_toy_model, build_toy_tokenizer

    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_toy_tokenizer()
    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_plan_sft_prints_a_table(tiny_model_dir, capsys):
    status = main(["plan", "sft", "--model_name_or_path", tiny_model_dir, "--per_device_train_batch_size", "2",
                   "--max_length", "64", "--unit", "MiB"])
    out = capsys.readouterr().out
    assert status == 0
    for part in ("| weights |", "| gradients |", "| optimizer state |", "| activations |", "| logits |",
                 "**predicted peak**", "Total (predicted peak):"):
        assert part in out, out


def test_plan_grpo_has_a_generation_phase(tiny_model_dir, capsys):
    assert main(["plan", "grpo", "--model_name_or_path", tiny_model_dir, "--max_prompt_length", "16",
                 "--max_completion_length", "32", "--per_device_train_batch_size", "8", "--beta", "0.04"]) == 0
    out = capsys.readouterr().out
    assert "| kv cache |" in out and "| reference |" in out and "peak while generating" in out


def test_plan_command_line(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "hf_rlhf.cli", "plan", "dpo", "--model_name_or_path",
                           tiny_model_dir, "--max_length", "64", "--max_completion_length", "32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| reference |" in done.stdout and "predicted peak" in done.stdout


def test_plan_bad_model(tmp_path, capsys):
    assert main(["plan", "sft", "--model_name_or_path", str(tmp_path / "nothing")]) == 2
    assert "neither a named shape" in capsys.readouterr().out
