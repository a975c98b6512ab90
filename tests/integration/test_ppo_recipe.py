"""recipes/ppo.py end to end at a tiny size: builds a missing SFT policy (recipes/sft.py in a subprocess), trains on
the verifiable reward, writes results.json and the curves PNG. No accuracy is asserted (a few steps of a tiny model)."""

import json
import os
from types import SimpleNamespace

import pytest
import yaml

from hf_rlhf.toy.chain import ToyChainArguments
from recipes import ppo as recipe

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def tiny_sft_config(tmp_path):
    with open(os.path.join(ROOT, "recipes", "configs", "sft_toy.yaml")) as f:
        config = yaml.safe_load(f)
    config.update(toy_model_size="tiny", toy_train_size=64, toy_test_size=8, max_steps=2, logging_steps=1,
                  per_device_train_batch_size=16, disable_tqdm=True)
    path = tmp_path / "sft_tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_toy_recipe_builds_the_policy_trains_and_reports(tmp_path, capsys):
    out, sft = tmp_path / "ppo", tmp_path / "sft"
    argv = ["--config", os.path.join(ROOT, "recipes", "configs", "ppo_toy.yaml"), "--output_dir", str(out),
            "--sft_model_path", str(sft), "--sft_config", tiny_sft_config(tmp_path), "--reward_source", "function",
            "--toy_train_size", "32", "--toy_test_size", "8", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1",
            "--rollout_batch_size", "8", "--num_ppo_epochs", "1", "--logging_steps", "2", "--max_steps", "4",
            "--sample_prompts", "2", "--sample_every", "2", "--disable_tqdm", "true"]
    results = recipe.main(argv)

    assert os.path.isfile(sft / "config.json")  # the missing SFT policy was built first
    with open(out / "results.json") as f:
        written = json.load(f)
    assert written["before"] == results["before"] and written["after"] == results["after"]
    for when in ("before", "after"):
        assert set(written[when]) == {"exact_match", "score"}
        assert 0.0 <= written[when]["exact_match"] <= 1.0
        # the verifiable reward is the exact-match check itself
        assert written[when]["score"] == pytest.approx(written[when]["exact_match"])
    assert set(written["exact_match_by_task"]) == {"before", "after"}
    kl = written["kl"]
    assert {"final", "mean_second_half", "target", "coef_final", "within_25pct_second_half"} <= set(kl)
    assert kl["target"] == pytest.approx(recipe.parse_recipe_args(
        (recipe.ScriptArguments, ToyChainArguments, recipe.ModelConfig, recipe.PPOConfig),
        ["--config", recipe.TOY_CONFIG], "unused")[-1].kl_target)
    assert set(written["timings"]) >= {"sft_s", "ppo_s", "eval_s"}

    png = written["plots"]["curves"]
    assert os.path.dirname(png) == str(out) and os.path.basename(png) == "ppo_curves.png"
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.isfile(out / "trainer_state.json") and os.path.isfile(out / "value" / "value_head.safetensors")
    with open(out / "completions.jsonl") as f:
        steps = sorted({json.loads(line)["step"] for line in f})
    assert steps == [0, 2, 4]

    printed = capsys.readouterr().out
    assert f"sft model: {sft} is missing; building it now" in printed
    assert "[hf_rlhf] PPO finished" in printed and f"plot (curves): {png}" in printed and "KL: final" in printed


def test_the_policy_needs_a_model_when_building_is_off(tmp_path):
    argv = ["--config", os.path.join(ROOT, "recipes", "configs", "ppo_toy.yaml"), "--output_dir",
            str(tmp_path / "ppo"), "--sft_model_path", str(tmp_path / "none"), "--build_missing", "false"]
    with pytest.raises(FileNotFoundError, match="no sft model at .*none; run recipes/sft.py first"):
        recipe.main(argv)


def test_a_real_run_needs_a_policy_and_a_reward_model(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+2="}\n')
    argv = ["--dataset_name", str(data), "--output_dir", str(tmp_path / "ppo")]
    with pytest.raises(ValueError, match="--model_name_or_path"):
        recipe.main(argv)
    with pytest.raises(ValueError, match="--reward_model_path"):
        recipe.main([*argv, "--model_name_or_path", "some/policy"])


def test_callbacks_for_a_fixed_and_an_adaptive_kl_coefficient():
    from hf_rlhf.callbacks import PlotCallback, SampleCompletionsCallback
    from hf_rlhf.cli.data_loading import PromptData

    script_args = SimpleNamespace(sample_prompts=2, sample_every=0, plot=True)
    data = PromptData(train=None, held_out={"prompt": ["1+2=", "3+4=", "5+6="]})
    for target, band in ((None, None), (2.0, (1.5, 2.5))):
        callbacks = recipe.build_callbacks(script_args, SimpleNamespace(kl_target=target, response_length=4), data)
        plot = next(c for c in callbacks if isinstance(c, PlotCallback))
        assert (plot.bands or {}).get("objective/kl") == band
        samples = next(c for c in callbacks if isinstance(c, SampleCompletionsCallback))
        assert samples.prompts == ["1+2=", "3+4="]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_estimator_alone_runs_the_toy_recipe(tmp_path, tiny_model_dir, estimator):
    """`accelerate launch recipes/ppo.py --advantage_estimator grpo` with no other option: num_generations takes TRL's
    8, the toy's reward function and sizes do the rest (here only shrunk to a few steps, with no G given)."""
    out = tmp_path / "out"
    results = recipe.main(["--advantage_estimator", estimator, "--sft_model_path", str(tiny_model_dir),
                           "--output_dir", str(out), "--toy_train_size", "64", "--toy_test_size", "8",
                           "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                           "--rollout_batch_size", "16", "--num_ppo_epochs", "1", "--max_steps", "2",
                           "--logging_steps", "1", "--sample_prompts", "0", "--plot", "false",
                           "--disable_tqdm", "true"])
    with open(out / "trainer_state.json") as f:
        logs = [h for h in json.load(f)["log_history"] if "objective/raw_scores" in h]
    assert len(logs) == 2 and all("loss/policy_avg" in h for h in logs)
    assert 0.0 <= results["after"]["exact_match"] <= 1.0
    assert not os.path.exists(out / "value")  # critic-free: no value function saved
