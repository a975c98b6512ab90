"""The `hf-rlhf` command line (`hf_rlhf.cli.main`): the subcommands run the recipes' own `main()` (the same
results.json), hand accelerate launch's options over as `trl` does, and a bad invocation is one line, not a
traceback."""

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
import yaml

from hf_rlhf.cli import launch
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.main import available_commands, main
from recipes import ppo, reward, sft

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "recipes", "configs")
ENV = {**os.environ, "PYTHONPATH": ROOT}
# a few steps of each toy recipe
TINY = {
    "sft": ["--toy_train_size", "64", "--toy_test_size", "8", "--toy_model_size", "tiny", "--max_steps", "2",
            "--per_device_train_batch_size", "16", "--logging_steps", "1", "--disable_tqdm", "true"],
    "reward": ["--toy_train_size", "64", "--toy_test_size", "32", "--toy_model_size", "tiny", "--max_steps", "2",
               "--per_device_train_batch_size", "16", "--logging_steps", "1", "--disable_tqdm", "true"],
    "ppo": ["--toy_train_size", "32", "--toy_test_size", "8", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--rollout_batch_size", "8", "--num_ppo_epochs", "1",
            "--logging_steps", "2", "--max_steps", "2", "--sample_prompts", "0", "--plot", "false",
            "--disable_tqdm", "true"],
}
# what differs between two runs of the same recipe: wall times and throughputs
VOLATILE = {"timings", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def stable(results: dict, *paths: str) -> dict:
    """results.json without wall times, and with the run's own paths replaced."""
    text = json.dumps(results)
    for i, path in enumerate(paths):
        text = text.replace(str(path), f"<path{i}>")
    out = json.loads(text)
    out.pop("timings", None)
    out["train"] = {k: v for k, v in out.get("train", {}).items() if k not in VOLATILE}
    return out


def read(path) -> dict:
    with open(os.path.join(path, "results.json")) as f:
        return json.load(f)


# --- bad invocations: one line, exit 2 (a bad input found by a recipe: exit 1, as the recipe) -----------------


def test_unknown_command_is_one_line_with_the_list(capsys):
    assert main(["spt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[hf_rlhf] error: unknown command 'spt'; did you mean sft? "
                   f"(commands: {', '.join(available_commands())})"]


def test_unknown_option_names_the_closest_valid_one(capsys):
    assert main(["ppo", "--lerning_rate", "1e-4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "[hf_rlhf] error: unknown option --lerning_rate (did you mean --learning_rate?)"


def test_config_with_an_equals_sign_and_a_short_option(tmp_path):
    """`--config=x.yaml` reads the file as `--config x.yaml` does; a short option the recipe lacks is one line too."""
    out = tmp_path / "out"
    assert main(["sft", f"--config={os.path.join(CONFIGS, 'sft_toy.yaml')}", *TINY["sft"], "--output_dir", str(out)]) \
        == 0
    assert read(out)["task"] == "toy"
    with pytest.raises(SystemExit, match=r"^\[hf_rlhf\] error: unknown option -t \(--help lists the options\)$"):
        main(["sft", "-t", "x"])


def test_missing_config_file(capsys, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert main(["sft", "--config", missing]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"[hf_rlhf] error: --config {missing}: no such file"


def test_unknown_key_in_the_config_file(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("lerning_rate: 0.001\n")
    with pytest.raises(SystemExit) as e:
        main(["sft", "--config", str(config)])
    assert str(e.value) == f"[hf_rlhf] error: unknown key 'lerning_rate' in {config} (did you mean learning_rate?)"


def test_unknown_accelerate_config_name(capsys, monkeypatch):
    for name in launch.LAUNCHED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["ppo", "--accelerate_config", "zero9"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "[hf_rlhf] error: --accelerate_config zero9: neither a file nor one of ddp, deepspeed_zero2, deepspeed_zero3, "
        "deepspeed_zero3_offload, fsdp")


def test_chain_is_the_toy_task(capsys):
    assert main(["chain", "--dataset_name", "my/prompts"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "[hf_rlhf] error: hf-rlhf chain runs the embedded toy task; on your own data and models run hf-rlhf sft, ")


def test_a_bad_invocation_prints_no_traceback():
    done = subprocess.run([sys.executable, "-m", "hf_rlhf.cli", "ppo", "--lerning_rate", "1e-4"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode == 2
    assert "[hf_rlhf] error: unknown option --lerning_rate (did you mean --learning_rate?)" in done.stderr
    assert "Traceback" not in done.stderr
    # the recipe itself says the same, as its own one line (exit 1, as its other option errors)
    with pytest.raises(SystemExit) as e:
        run_recipe(lambda: sft.main(["--max_stepz", "3"]))
    assert str(e.value) == "[hf_rlhf] error: unknown option --max_stepz (did you mean --max_steps?)"


def test_the_console_scripts_point_at_the_commands():
    import importlib

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"hf-rlhf": "hf_rlhf.cli.main:main", "hf-rlhf-merge": "hf_rlhf.models.merge:main"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


# --- help and env ---------------------------------------------------------------------------------------------


def test_help_lists_every_command_on_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("chain", "sft", "reward", "ppo", "distill", "merge", "env"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert ("dpo" in available_commands()) == os.path.isfile(os.path.join(ROOT, "recipes", "dpo.py"))


def test_a_recipe_with_a_main_becomes_a_command(tmp_path, monkeypatch):
    """`dpo` is listed, and runs, once recipes/dpo.py defines main(): nothing to register."""
    import hf_rlhf.cli.recipes

    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "sft.py").write_text("def main(argv=None):\n    return {}\n")
    monkeypatch.setattr(hf_rlhf.cli.recipes, "CHECKOUT_RECIPES", str(folder))
    assert "dpo" not in available_commands()
    (folder / "dpo.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass ScriptArguments:\n    beta: float = 0.1\n\n\n"
        "CALLS = []\n\n\ndef main(argv=None):\n    CALLS.append(argv)\n    return {}\n")
    assert "dpo" in available_commands()
    assert main(["dpo", "--beta", "0.5"]) == 0
    assert sys.modules["_hf_rlhf_recipes.dpo"].CALLS == [["--beta", "0.5"]]
    assert main(["dpo", "--betta", "0.5"]) == 2  # its options are known from its dataclasses


def test_ppo_help_groups_the_options_by_config_class(capsys):
    assert main(["ppo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-rlhf ppo ")
    headings = ["ScriptArguments (recipes.ppo):", "ToyChainArguments (hf_rlhf.toy.chain):",
                "ModelConfig (hf_rlhf.trainers.model_config):", "PPOConfig (hf_rlhf.trainers.ppo_config):"]
    at = [out.index(h) for h in headings]
    assert at == sorted(at)
    listed = {opt: out.index(f"\n  {opt} ") for opt in ("--reward_model_path", "--build_missing", "--lora_r",
                                                        "--kl_target")}  # an option's entry, not the usage line
    assert at[0] < listed["--reward_model_path"] < at[1] < listed["--build_missing"] < at[2] < listed["--lora_r"] \
        < at[3] < listed["--kl_target"]
    assert "--accelerate_config" in out


def test_kto_is_a_command_with_ktoconfig_options(capsys):
    assert "kto" in available_commands()
    assert main(["kto", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-rlhf kto ") and "KTOConfig (hf_rlhf.trainers.kto_config):" in out
    for option in ("--desirable_weight", "--undesirable_weight", "--loss_type", "--toy_rejected_slip_rate"):
        assert f"\n  {option} " in out, option
    assert main(["kto", "--desirable_wieght", "1.0"]) == 2  # an unknown option is an error


def test_env_prints_the_versions_and_the_device(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes"):
        assert f"- {name} version: {version(name)}" in out
    assert "- accelerator(s): cpu" in out


# --- accelerate launch ----------------------------------------------------------------------------------------


def test_launch_options_are_handed_to_accelerate_launch(monkeypatch, capsys):
    """As `trl sft --num_processes 2 --accelerate_config zero3 ...`: accelerate's options (a recipe option wins a
    name both have) go to `accelerate launch -m hf_rlhf.cli <command>`, the rest to the recipe, order kept."""
    for name in launch.LAUNCHED_ENV:
        monkeypatch.delenv(name, raising=False)
    launched = {}
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: launched.update(vars(args)))
    assert main(["ppo", "--num_processes", "2", "--learning_rate", "1e-4", "--accelerate_config", "ddp",
                 "--gradient_accumulation_steps", "2", "--mixed_precision=no", "--use_peft"]) == 0
    assert launched["num_processes"] == 2 and launched["mixed_precision"] == "no"
    assert launched["config_file"] == os.path.join(ROOT, "recipes", "accelerate", "ddp.yaml")
    assert launched["module"] and launched["training_script"] == "hf_rlhf.cli"
    assert launched["training_script_args"] == ["ppo", "--learning_rate", "1e-4", "--gradient_accumulation_steps",
                                                 "2", "--use_peft"]
    ddp = os.path.join(ROOT, "recipes", "accelerate", "ddp.yaml")
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"[hf_rlhf] accelerate launch --config_file {ddp} --num_processes 2 --mixed_precision=no --module hf_rlhf.cli "
        "ppo --learning_rate 1e-4 --gradient_accumulation_steps 2 --use_peft")


def test_inside_a_launched_process_the_recipe_runs_here():
    assert launch.should_launch(["--num_processes", "1"], {}) is True
    assert launch.should_launch([], {"ACCELERATE_MIXED_PRECISION": "no"}) is False
    assert launch.should_launch(["--num_processes", "2"], {"WORLD_SIZE": "2"}) is False


def test_accelerate_launch_runs_the_cli_module(tmp_path, tiny_model_dir):
    """`accelerate launch -m hf_rlhf.cli ppo ...`, one process: the recipe runs in the launched process."""
    out = tmp_path / "ppo"
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "no",
         "-m", "hf_rlhf.cli", "ppo", "--sft_model_path", str(tiny_model_dir), "--output_dir", str(out),
         *TINY["ppo"]], capture_output=True, text=True, env={**ENV, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = read(out)
    assert written["policy"] == str(tiny_model_dir) and written["task"] == "toy"
    assert {"exact_match", "score"} <= set(written["after"])
    assert "[hf_rlhf] PPO finished" in done.stdout


# --- the same results.json as the recipes ---------------------------------------------------------------------


@pytest.mark.parametrize("name, recipe", [("sft", sft), ("reward", reward)])
def test_sft_and_reward_write_the_recipes_results(tmp_path, name, recipe):
    config = os.path.join(CONFIGS, f"{name}_toy.yaml")
    # the reward model from a fresh toy model (no SFT model at that path)
    common = ["--config", config, *TINY[name], *(["--sft_model_path", str(tmp_path / "none")] if name == "reward"
                                                  else [])]
    a, b = tmp_path / "recipe", tmp_path / "cli"
    recipe.main([*common, "--output_dir", str(a)])
    assert main([name, *common, "--output_dir", str(b)]) == 0
    assert stable(read(a), a) == stable(read(b), b)
    assert read(b)["after"]


def test_ppo_writes_the_recipes_results(tmp_path, tiny_model_dir):
    common = ["--config", os.path.join(CONFIGS, "ppo_toy.yaml"), "--sft_model_path", str(tiny_model_dir),
              *TINY["ppo"]]
    a, b = tmp_path / "recipe", tmp_path / "cli"
    ppo.main([*common, "--output_dir", str(a)])
    assert main(["ppo", *common, "--output_dir", str(b)]) == 0
    assert stable(read(a), a) == stable(read(b), b)
    assert {"exact_match", "score"} <= set(read(b)["after"])


# --- the main job: the RLHF chain -----------------------------------------------------------------------------


def tiny_config(tmp_path, name: str, **changes) -> str:
    with open(os.path.join(CONFIGS, f"{name}_toy.yaml")) as f:
        config = yaml.safe_load(f)
    config.update({"toy_model_size": "tiny", "toy_test_size": 8, "max_steps": 2, "logging_steps": 1,
                   "per_device_train_batch_size": 16, "disable_tqdm": True, **changes})
    path = tmp_path / f"{name}_tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_build_in_this_process_is_the_recipes_own_run_bit_for_bit(tmp_path):
    """A single-process chain builds a missing SFT policy in its own process (`build_with_recipe`), without a
    child's start (~15 s of imports): the same model as the recipe run on its own on the same threads."""
    import torch

    from hf_rlhf.toy.chain import build_with_recipe

    config = tiny_config(tmp_path, "sft", toy_train_size=64, max_steps=8)
    script = os.path.join(ROOT, "recipes", "sft.py")
    alone, here = tmp_path / "alone", tmp_path / "here"
    subprocess.run([sys.executable, script, "--config", config, "--output_dir", str(alone)],
                   env={**ENV, "OMP_NUM_THREADS": "2"}, check=True, capture_output=True)
    build_with_recipe(script, ["--config", config, "--output_dir", str(here)], threads=2)
    assert torch.get_num_threads() == 1  # this test's thread, restored
    assert (here / "model.safetensors").read_bytes() == (alone / "model.safetensors").read_bytes()
    assert read(here)["after"] == read(alone)["after"]


def test_the_chain_builds_sft_and_reward_then_ppo_and_says_what_next(tmp_path, capsys):
    sft_dir, reward_dir, out = tmp_path / "sft", tmp_path / "reward", tmp_path / "ppo"
    argv = ["chain", "--sft_model_path", str(sft_dir), "--sft_config", tiny_config(tmp_path, "sft", toy_train_size=64),
            "--reward_model_path", str(reward_dir),
            "--reward_config", tiny_config(tmp_path, "reward", toy_train_size=64, toy_test_size=32),
            "--output_dir", str(out), *TINY["ppo"], "--plot", "true", "--build_threads", "1"]
    assert main(argv) == 0
    assert os.path.isfile(sft_dir / "config.json") and os.path.isfile(reward_dir / "config.json")
    written = read(out)
    assert written["reward"] == f"reward model {reward_dir}" and written["policy"] == str(sft_dir)
    assert set(written["timings"]) >= {"sft_s", "reward_s", "ppo_s", "eval_s"}
    text = capsys.readouterr().out
    before, after = written["before"]["exact_match"], written["after"]["exact_match"]
    assert f"exact match (held out, greedy): {before:.4f} -> {after:.4f}" in text
    for path in (out, out / "results.json", out / "ppo_curves.png", sft_dir, reward_dir):
        assert str(path) in text
    assert "hf-rlhf ppo --model_name_or_path outputs/sft-qwen2.5-0.5b" in text
