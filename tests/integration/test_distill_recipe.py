"""recipes/distill.py end to end at a tiny size: teacher and student given as saved toy models, the table's four
exact matches in results.json, the student reloadable; the PPO teacher built from the SFT policy when missing; a
missing prerequisite with build_missing off is named."""

import json
import os
import shutil

import pytest
from transformers import AutoModelForCausalLM

from hf_rlhf.toy import build_toy_model
from recipes import distill as recipe

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--toy_train_size", "32", "--toy_test_size", "16", "--max_steps", "2", "--per_device_train_batch_size", "8",
        "--logging_steps", "1", "--disable_tqdm", "true", "--lmbda", "0.5"]


@pytest.fixture
def models(tmp_path, tokenizer):
    paths = {}
    for name, size, seed in (("teacher", "small", 1), ("student", "tiny", 0)):
        paths[name] = str(tmp_path / name)
        build_toy_model(tokenizer, size, seed=seed).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def test_toy_run_writes_the_table_to_results_json(tmp_path, models, capsys):
    out = str(tmp_path / "out")
    results = recipe.main(["--output_dir", out, "--ppo_model_path", models["teacher"], "--student_model_path",
                           models["student"], *TINY])
    with open(os.path.join(out, "results.json")) as f:
        written = json.load(f)
    for key in ("teacher", "before", "after", "sft_on_teacher_outputs"):
        assert 0.0 <= written[key]["exact_match"] <= 1.0 and written[key] == results[key], key
    assert written["train"]["train_loss"] >= 0 and written["timings"] == {"teacher_build_s": 0.0}
    assert "| student, SFT on the teacher's answers |" in capsys.readouterr().out
    AutoModelForCausalLM.from_pretrained(out)


def test_the_default_student_is_the_teacher_with_some_layers(tmp_path, models):
    out = str(tmp_path / "out")
    recipe.main(["--output_dir", out, "--toy_teacher", "sft", "--sft_model_path", models["teacher"],
                 "--student_layers", "0,2", *TINY, "--compare_sft", "false"])
    student, teacher = (AutoModelForCausalLM.from_pretrained(p) for p in (out + "/student_init", models["teacher"]))
    assert student.config.num_hidden_layers == 2 and teacher.config.num_hidden_layers == 4
    assert (student.model.layers[1].self_attn.q_proj.weight == teacher.model.layers[2].self_attn.q_proj.weight).all()


@pytest.mark.parametrize("teacher, script", [("ppo", "ppo.py"), ("sft", "sft.py")])
def test_missing_teacher_without_build_is_named(tmp_path, models, teacher, script):
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"no model at .*nowhere; run recipes/{script}"):
        recipe.main(["--output_dir", str(tmp_path / "out"), "--toy_teacher", teacher, "--sft_model_path", nowhere,
                     "--ppo_model_path", nowhere, "--build_missing", "false", *TINY])


def test_a_missing_ppo_teacher_is_built_from_the_sft_policy(tmp_path, models, monkeypatch):
    """The PPO recipe is asked for the teacher at `ppo_model_path`, from the given SFT policy and SFT config."""
    built = []

    def build(script, argv, threads=None):
        built.append((os.path.basename(script), argv))
        shutil.copytree(models["teacher"], argv[argv.index("--output_dir") + 1])

    monkeypatch.setattr(recipe, "build_with_recipe", build)
    teacher = str(tmp_path / "ppo")
    results = recipe.main(["--output_dir", str(tmp_path / "out"), "--ppo_model_path", teacher, "--sft_model_path",
                           models["student"], "--sft_config", "my_sft.yaml", "--student_model_path", models["student"],
                           *TINY, "--compare_sft", "false"])
    (script, argv), = built
    assert script == "ppo.py" and argv[argv.index("--config") + 1].endswith("configs/ppo_toy.yaml")
    assert argv[argv.index("--output_dir") + 1] == teacher
    assert argv[argv.index("--sft_model_path") + 1] == models["student"]
    assert argv[argv.index("--sft_config") + 1] == "my_sft.yaml"
    assert results["teacher_path"] == teacher and results["timings"]["teacher_build_s"] >= 0
