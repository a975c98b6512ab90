"""recipes/distill.py end to end at a tiny size: teacher and student given as saved toy models, the table's four
exact matches in results.json, the student reloadable; a missing prerequisite with build_missing off is named."""

import json
import os

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
    results = recipe.main(["--output_dir", out, "--sft_model_path", models["teacher"], "--student_model_path",
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
    recipe.main(["--output_dir", out, "--sft_model_path", models["teacher"], "--student_layers", "0,2", *TINY,
                 "--compare_sft", "false"])
    student, teacher = (AutoModelForCausalLM.from_pretrained(p) for p in (out + "/student_init", models["teacher"]))
    assert student.config.num_hidden_layers == 2 and teacher.config.num_hidden_layers == 4
    assert (student.model.layers[1].self_attn.q_proj.weight == teacher.model.layers[2].self_attn.q_proj.weight).all()


def test_missing_teacher_without_build_is_named(tmp_path, models):
    with pytest.raises(FileNotFoundError, match="no model at .*nowhere; run recipes/sft.py"):
        recipe.main(["--output_dir", str(tmp_path / "out"), "--sft_model_path", str(tmp_path / "nowhere"),
                     "--build_missing", "false", *TINY])
