"""Bad inputs through the recipes: every class fails before any model is loaded, with a message naming the file,
line, row and field (issue 13, item 4), and the PPO recipe's missing options name the option (issue 14, item 8).

The files here are this module's own cases of each class; the loading of a model is replaced by a failure, so a
test passes only when the error comes first.
"""

import json
import logging
import os
import re
import subprocess
import sys

import pytest

import hf_rlhf.models.loading
from hf_rlhf.cli.errors import RecipeOptionError
from hf_rlhf.data import DataFileError, DataValidationError
from hf_rlhf.rollout.loader import prepare_prompt_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from recipes import ppo as ppo_recipe
from recipes import reward as reward_recipe
from recipes import sft as sft_recipe

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNKNOWN = "你好世界再见朋友"  # not in the toy tokenizer's alphabet: every character is <|unk|>


class ModelLoaded(AssertionError):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model (or building a trainer, which loads one) fails the test."""
    def refuse(*args, **kwargs):
        raise ModelLoaded("a model was loaded before the input error")

    monkeypatch.setattr(hf_rlhf.models.loading, "load_model", refuse)
    monkeypatch.setattr(reward_recipe, "RewardTrainer", refuse)
    monkeypatch.setattr(ppo_recipe, "PPOTrainer", refuse)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft(tmp_path, data, model, *extra):
    return sft_recipe.main(["--dataset_name", data, "--model_name_or_path", str(model), "--output_dir",
                            str(tmp_path / "out"), "--max_steps", "1", "--report_to", "none", *extra])


def reward(tmp_path, data, model, *extra):
    return reward_recipe.main(["--dataset_name", data, "--model_name_or_path", str(model), "--output_dir",
                               str(tmp_path / "out"), "--max_steps", "1", "--report_to", "none", *extra])


def ppo(tmp_path, data, model, *extra):
    return ppo_recipe.main(["--dataset_name", data, "--model_name_or_path", str(model), "--output_dir",
                            str(tmp_path / "out"), "--reward_source", "function", "--reward_function",
                            "hf_rlhf.toy:reward_fn", "--max_steps", "1", "--report_to", "none", *extra])


GOOD_SFT = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "2+2=", "completion": "4"},
            {"prompt": "3+2=", "completion": "5"}]


# ---------------------------------------------------------------------------------------------------
# file level


def test_an_empty_file(tmp_path, tiny_model_dir, no_model):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(DataFileError, match=r"empty\.jsonl: expected at least one row, got an empty file"):
        sft(tmp_path, str(data), tiny_model_dir)
    data.write_text("\n  \n")  # blank lines only
    with pytest.raises(DataFileError, match="expected at least one row"):
        sft(tmp_path, str(data), tiny_model_dir)


def test_a_truncated_json_line_names_its_line(tmp_path, tiny_model_dir, no_model):
    data = tmp_path / "cut.jsonl"
    data.write_text(json.dumps(GOOD_SFT[0]) + "\n\n" + json.dumps(GOOD_SFT[1]) + "\n" + '{"prompt": "3+2=", "compl')
    with pytest.raises(DataFileError, match=r"cut\.jsonl, line 4: expected a JSON object, got invalid JSON"):
        sft(tmp_path, str(data), tiny_model_dir)


def test_a_json_document_with_an_error_names_its_line(tmp_path, tiny_model_dir, no_model):
    data = tmp_path / "doc.json"
    data.write_text('[\n{"prompt": "1+2=", "completion": "3"},\n{"prompt": "2+2=" "completion": "4"}\n]')
    with pytest.raises(DataFileError, match=r"doc\.json, line 3: expected a JSON document"):
        sft(tmp_path, str(data), tiny_model_dir)


def test_a_mixed_type_column_errors_at_its_own_row(tmp_path, tiny_model_dir, no_model):
    rows = [*GOOD_SFT, {"prompt": "4+2=", "completion": 6}, {"prompt": "5+2=", "completion": "7"}]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataValidationError, match=r"mixed\.jsonl, line 4, row 3, field 'completion': expected a "
                                                  r"non-empty string, got 6 \(int\)") as e:
        sft(tmp_path, data, tiny_model_dir)
    assert e.value.row == 3 and e.value.field == "completion"


def test_a_mixed_type_margin_errors_at_its_own_row(tmp_path, tiny_model_dir, no_model):
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": m} for m in (1.0, 2, "0.5", 1.5)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataValidationError, match=r"line 3, row 2, field 'margin': expected a finite number"):
        reward(tmp_path, data, tiny_model_dir)


# ---------------------------------------------------------------------------------------------------
# row level


def test_whitespace_only_text_names_row_and_field(tmp_path, tiny_model_dir, no_model):
    data = write_jsonl(tmp_path / "blank.jsonl", [*GOOD_SFT, {"prompt": "6+2=", "completion": " \n\t "}])
    with pytest.raises(DataValidationError, match=r"row 3, field 'completion': expected text that is not only "
                                                  "whitespace"):
        sft(tmp_path, data, tiny_model_dir)
    messages = [{"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]},
                {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "4"}]}]
    data = write_jsonl(tmp_path / "blank_chat.jsonl", messages)
    with pytest.raises(DataValidationError, match=r"row 1, field 'messages\[0\].content': expected a user turn "
                                                  "with text"):
        sft(tmp_path, data, tiny_model_dir)


def test_text_the_tokenizer_cannot_represent_warns_or_errors_when_strict(tmp_path, tiny_model_dir, monkeypatch,
                                                                        caplog):
    rows = [*GOOD_SFT, {"prompt": UNKNOWN, "completion": "3"}]
    data = write_jsonl(tmp_path / "unk.jsonl", rows)
    loaded = []
    monkeypatch.setattr(hf_rlhf.models.loading, "load_model", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(
        ModelLoaded("reached the model")))
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"), pytest.raises(ModelLoaded):
        sft(tmp_path, data, tiny_model_dir)
    assert "1 of 4 rows have more than 10% unknown tokens ('<|unk|>'), first row 3" in caplog.text
    loaded.clear()
    with pytest.raises(DataValidationError, match=r"row 3, field 'prompt\+completion': expected text the tokenizer "
                                                  r"can represent .*got 8 of \d+ tokens unknown"):
        sft(tmp_path, data, tiny_model_dir, "--strict", "true")
    assert not loaded


def test_conversational_pairs_whose_prompts_differ(tmp_path, tiny_model_dir, no_model):
    def turn(role, content):
        return {"role": role, "content": content}

    good = {"chosen": [turn("user", "1+2="), turn("assistant", "3")],
            "rejected": [turn("user", "1+2="), turn("assistant", "4")]}
    bad = {"chosen": [turn("user", "2+2="), turn("assistant", "4")],
           "rejected": [turn("user", "2+3="), turn("assistant", "5")]}
    data = write_jsonl(tmp_path / "pairs.jsonl", [good, bad])
    with pytest.raises(DataValidationError, match=r"row 1, field 'rejected': expected the same messages as 'chosen' "
                                                  r"up to the last assistant turn .* index 0"):
        reward(tmp_path, data, tiny_model_dir)
    not_an_answer = {"chosen": [turn("user", "1+2="), turn("assistant", "3")],
                     "rejected": [turn("user", "1+2="), turn("assistant", "3"), turn("user", "sure?")]}
    data = write_jsonl(tmp_path / "pairs2.jsonl", [good, not_an_answer])
    with pytest.raises(DataValidationError, match=r"row 1, field 'rejected\[2\].role': expected 'assistant'"):
        reward(tmp_path, data, tiny_model_dir)


def test_ppo_prompts_ending_with_an_assistant_turn(tmp_path, tiny_model_dir, no_model):
    rows = [{"prompt": [{"role": "user", "content": "1+2="}]},
            {"prompt": [{"role": "user", "content": "1+3="}, {"role": "assistant", "content": "4"}]}]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataValidationError, match=r"row 1, field 'prompt\[1\].role': expected a prompt that ends "
                                                  "with a user"):
        ppo(tmp_path, data, tiny_model_dir)


# ---------------------------------------------------------------------------------------------------
# PPO prompt length: default limit from the model's positions, and the documented policies


def test_a_prompt_longer_than_the_model_positions_is_an_error_up_front(tmp_path, tiny_model_dir, no_model):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+" * 150 + "1=", "answer": "151"}]  # 303 > 256 - 8
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataValidationError, match=r"row 1, field 'prompt': expected at most 248 \(max_prompt_length "
                                                  r"unset: the model's 256 positions minus response_length=8\) "
                                                  r"tokens .* got 30\d tokens"):
        ppo(tmp_path, data, tiny_model_dir, "--response_length", "8")
    with pytest.raises(ValueError, match=r"max_prompt_length \(300\) \+ response_length \(8\) must fit in the "
                                         r"model's 256 positions"):
        ppo(tmp_path, data, tiny_model_dir, "--response_length", "8", "--max_prompt_length", "300")


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_prompt_overlong_policies_are_counted(tokenizer, caplog, policy, tmp_path):
    rows = [{"prompt": "1+2="}, {"prompt": "1+" * 20 + "1="}, {"prompt": "2+2="}, {"prompt": "3+" * 30 + "1="}]
    args = PPOConfig(output_dir=str(tmp_path), response_length=8, prompt_overlong_policy=policy)
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        out = prepare_prompt_dataset(rows, tokenizer, args, max_positions=20)  # limit 12 tokens
    verb = "dropped" if policy == "drop" else "truncated"
    assert f"2 of 4 prompts longer than 12 (max_prompt_length unset: the model's 20 positions minus " \
           f"response_length=8) were {verb}" in caplog.text
    lengths = [len(ids) for ids in out["input_ids"]]
    assert lengths == ([5, 5] if policy == "drop" else [5, 12, 5, 12])
    if policy == "truncate":  # the last tokens are kept
        full = prepare_prompt_dataset(rows, tokenizer, PPOConfig(output_dir=str(tmp_path)))
        assert out["input_ids"][1] == full["input_ids"][1][-12:]


# ---------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("option, value, message", [
    ("--learning_rate", "-0.001", "SFTConfig.learning_rate must be >= 0, got -0.001"),
    ("--per_device_train_batch_size", "0", "SFTConfig.per_device_train_batch_size must be >= 1, got 0"),
    ("--max_length", "0", "SFTConfig.max_length must be >= 1, got 0"),
    ("--gradient_accumulation_steps", "-2", "SFTConfig.gradient_accumulation_steps must be >= 1, got -2"),
])
def test_options_out_of_range_fail_while_parsing(tmp_path, tiny_model_dir, no_model, option, value, message):
    data = write_jsonl(tmp_path / "ok.jsonl", GOOD_SFT)
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        sft(tmp_path, data, tiny_model_dir, option, value)


# ---------------------------------------------------------------------------------------------------
# the PPO recipe's missing options (issue 14, item 8)


def test_ppo_a_policy_without_a_dataset_names_the_missing_option(tmp_path, no_model):
    with pytest.raises(RecipeOptionError, match="--model_name_or_path my/policy needs --dataset_name"):
        ppo_recipe.main(["--model_name_or_path", "my/policy", "--output_dir", str(tmp_path / "out")])


def test_ppo_a_users_policy_and_prompts_without_a_reward(tmp_path, tiny_model_dir, no_model):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+2="}])
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", data, "--output_dir", str(tmp_path)]
    with pytest.raises(RecipeOptionError, match="needs a reward: give --reward_model_path"):
        ppo_recipe.main(argv)
    with pytest.raises(RecipeOptionError, match="--reward_source function needs --reward_function"):
        ppo_recipe.main([*argv, "--reward_source", "function"])
    assert not os.path.exists(tmp_path / "outputs")  # no fall back to the toy task's paths


# ---------------------------------------------------------------------------------------------------
# on the command line: the message, not a traceback


def test_the_command_line_prints_the_message_and_exits_non_zero(tmp_path, tiny_model_dir):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "sft.py"), "--dataset_name", str(data),
                           "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert f"[hf_rlhf] error: {data}: expected at least one row, got an empty file" in done.stderr
    assert "Traceback" not in done.stderr


def test_ppo_trainer_checks_its_prompts_before_it_loads_the_policy(tmp_path, no_model):
    from hf_rlhf import PPOTrainer

    prompts = [[{"role": "user", "content": "3+4="}],
               [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]]
    args = PPOConfig(output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=2)
    with pytest.raises(DataValidationError, match=r"row 1, field 'prompt\[1\]\.role'.*got 'assistant'"):
        PPOTrainer(str(tmp_path / "policy"), lambda prompts, completions, **kw: [0.0] * len(prompts), args=args,
                   train_dataset=[{"prompt": p} for p in prompts])


@pytest.mark.parametrize("trainer", ["sft", "reward"])
def test_sft_and_reward_trainers_check_rows_before_they_load_the_model(tmp_path, no_model, trainer):
    from hf_rlhf import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

    if trainer == "sft":
        rows = [{"prompt": "3+4=", "completion": "7"}, {"prompt": "2+2=", "completion": "   "}]
        build = lambda: SFTTrainer(str(tmp_path / "model"), SFTConfig(output_dir=str(tmp_path / "out"),  # noqa: E731
                                                                      report_to="none"), train_dataset=rows)
    else:
        rows = [{"prompt": "3+4=", "chosen": "7", "rejected": "8"}, {"prompt": "2+2=", "chosen": "4", "rejected": ""}]
        build = lambda: RewardTrainer(str(tmp_path / "model"), RewardConfig(output_dir=str(tmp_path / "out"),  # noqa: E731
                                                                            report_to="none"), train_dataset=rows)
    with pytest.raises(DataValidationError, match=r"row 1, field '(completion|rejected)'"):
        build()


@pytest.mark.parametrize("spec,message", [
    ("no_colon", "--reward_function needs 'package.module:function' (the reward"),
    ("no_such_module_xyz:f", "--reward_function no_such_module_xyz:f: cannot import 'no_such_module_xyz'"),
    ("hf_rlhf.toy:no_such_function", "module 'hf_rlhf.toy' has no function 'no_such_function'"),
])
def test_ppo_a_bad_reward_function_is_one_line(tmp_path, tiny_model_dir, no_model, spec, message):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+2="}])
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", data, "--output_dir", str(tmp_path),
            "--reward_source", "function", "--reward_function", spec]
    with pytest.raises(RecipeOptionError, match=re.escape(message)):
        ppo_recipe.main(argv)
