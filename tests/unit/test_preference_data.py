"""Preference-pair formats, validation, tokenization and the over-long policy (`hf_rlhf.data.preference`)."""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset

from hf_rlhf.data import (
    DataValidationError,
    detect_preference_format,
    prepare_preference_dataset,
    validate_preference_dataset,
)
from hf_rlhf.data.options import DataOptions, PreferenceDataOptions
from hf_rlhf.toy import build_toy_tokenizer
from hf_rlhf.trainers.reward_config import RewardConfig


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


def args(**kw):
    defaults = dict(max_length=64, overlong_policy="drop", use_margin=None, eos_token=None, chat_template_path=None,
                    dataset_num_proc=None)
    defaults.update(kw)
    return PreferenceDataOptions(**defaults)


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


EXPLICIT = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "9-1=", "chosen": "8", "rejected": "7"}]


def test_detect_formats():
    assert detect_preference_format(EXPLICIT) == "explicit_prompt"
    assert detect_preference_format([{"chosen": "1+2=3", "rejected": "1+2=4"}]) == "implicit_prompt"
    conv = [{"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("4")}]
    assert detect_preference_format(conv) == "conversational_explicit_prompt"
    conv_implicit = [{"chosen": user("1+2=") + assistant("3"), "rejected": user("1+2=") + assistant("4")}]
    assert detect_preference_format(Dataset.from_list(conv_implicit)) == "conversational_implicit_prompt"
    assert detect_preference_format([{"chosen_ids": [1, 2], "rejected_ids": [1, 3]}]) == "tokenized"


def test_missing_rejected_column_names_the_field():
    with pytest.raises(DataValidationError, match="field 'rejected'.*'chosen' and 'rejected' columns") as err:
        detect_preference_format(Dataset.from_list([{"prompt": "1+2=", "chosen": "3"}]))
    assert err.value.field == "rejected"


def test_missing_rejected_in_one_row_names_the_row(tok):
    rows = [EXPLICIT[0], {"prompt": "2+2=", "chosen": "4"}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'rejected': expected a non-empty string, "
                                                  r"got nothing \(the field is missing\)"):
        prepare_preference_dataset(rows, tok, args())


def test_chosen_equal_to_rejected_is_an_error(tok):
    rows = [EXPLICIT[0], {"prompt": "2+2=", "chosen": "4", "rejected": "4"}]
    with pytest.raises(DataValidationError, match="row 1, field 'rejected': expected a response different from "
                                                  "'chosen'"):
        prepare_preference_dataset(rows, tok, args())
    with pytest.raises(DataValidationError, match="row 0, field 'rejected_ids'"):
        validate_preference_dataset([{"chosen_ids": [1, 2], "rejected_ids": [1, 2]}], "tokenized")


@pytest.mark.parametrize("field", ["prompt", "chosen", "rejected"])
def test_empty_strings_are_errors(tok, field):
    rows = [EXPLICIT[0], dict(EXPLICIT[1], **{field: ""})]
    with pytest.raises(DataValidationError, match=f"row 1, field '{field}': expected a non-empty string, got ''"):
        prepare_preference_dataset(rows, tok, args())


def test_bad_messages_name_the_message(tok):
    rows = [{"prompt": user("1+2="), "chosen": assistant("3"), "rejected": [{"role": "robot", "content": "4"}]}]
    with pytest.raises(DataValidationError, match=r"row 0, field 'rejected\[0\].role'"):
        prepare_preference_dataset(rows, tok, args())
    rows = [{"prompt": user("1+2="), "chosen": assistant("3"), "rejected": user("4")}]
    with pytest.raises(DataValidationError, match="row 0, field 'rejected': expected at least one 'assistant'"):
        prepare_preference_dataset(rows, tok, args())


@pytest.mark.parametrize("margin", ["0.5", None, True, float("nan"), [1.0]])
def test_non_numeric_margin_is_an_error(tok, margin):
    rows = [dict(EXPLICIT[0], margin=1.0), dict(EXPLICIT[1], margin=margin)]
    with pytest.raises(DataValidationError, match="row 1, field 'margin': expected a finite number"):
        prepare_preference_dataset(rows, tok, args())


def test_margin_column_use(tok):
    rows = [dict(EXPLICIT[0], margin=1), dict(EXPLICIT[1], margin=0.5)]
    assert prepare_preference_dataset(rows, tok, args())["margin"] == [1.0, 0.5]
    assert "margin" not in prepare_preference_dataset(rows, tok, args(use_margin=False)).column_names
    with pytest.raises(DataValidationError, match="field 'margin': expected a 'margin' column"):
        prepare_preference_dataset(EXPLICIT, tok, args(use_margin=True))


def test_plain_text_gets_bos_and_eos_and_explicit_equals_implicit(tok):
    explicit = prepare_preference_dataset(EXPLICIT, tok, args())
    implicit = prepare_preference_dataset(
        [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in EXPLICIT], tok, args())
    assert explicit["chosen_ids"] == implicit["chosen_ids"]
    assert explicit["rejected_ids"] == implicit["rejected_ids"]
    ids = explicit[0]["chosen_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "1+2=3"
    # an eos already there is not doubled
    with_eos = prepare_preference_dataset([dict(EXPLICIT[0], chosen="3" + tok.eos_token)], tok, args())
    assert with_eos[0]["chosen_ids"] == ids


def test_conversational_uses_the_chat_template(tok):
    rows = [{"prompt": user("1+2="), "chosen": assistant("3"), "rejected": assistant("4")}]
    out = prepare_preference_dataset(rows, tok, args())
    assert tok.decode(out[0]["chosen_ids"]) == "<|bos|><|user|>1+2=<|assistant|>3<|eos|>"
    implicit = [{"chosen": user("1+2=") + assistant("3"), "rejected": user("1+2=") + assistant("4")}]
    assert prepare_preference_dataset(implicit, tok, args())["chosen_ids"] == out["chosen_ids"]


def test_tokenized_rows_pass_through_with_checks(tok):
    out = prepare_preference_dataset([{"chosen_ids": [1, 5, 2], "rejected_ids": [1, 6, 2]}], tok, args())
    assert out[0] == {"chosen_ids": [1, 5, 2], "rejected_ids": [1, 6, 2]}
    with pytest.raises(DataValidationError, match="row 0, field 'chosen_ids': expected a non-empty list"):
        prepare_preference_dataset([{"chosen_ids": [], "rejected_ids": [1]}], tok, args())


LONG = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},                # 7 tokens each side: fits
    {"prompt": "count a in abcabcaa=", "chosen": "4", "rejected": "5"},  # 23: the difference is at token 22
    {"prompt": "sort cba=", "chosen": "abc", "rejected": "cab"},       # 14: differs at token 11
]


def test_overlong_drop_is_the_default_and_is_logged(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        out, stats = prepare_preference_dataset(LONG, tok, args(max_length=12), return_stats=True)
    assert len(out) == 1 and stats == {"n_rows": 3, "n_truncated": 0, "n_dropped": 2}
    assert "2 of 3 examples longer than max_length=12 were dropped" in caplog.text


def test_overlong_truncate_keeps_pairs_that_still_differ(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        out, stats = prepare_preference_dataset(LONG, tok, args(max_length=12, overlong_policy="truncate"),
                                                return_stats=True)
    # row 1 cut at 12 tokens loses its answers (identical sides): dropped; row 2 still differs: kept, cut
    assert stats == {"n_rows": 3, "n_truncated": 1, "n_dropped": 1}
    assert [len(x) for x in out["chosen_ids"]] == [7, 12]
    assert out[1]["chosen_ids"] != out[1]["rejected_ids"]
    assert "1 of 3 examples longer than max_length=12 were truncated" in caplog.text
    assert "were dropped" in caplog.text


def test_overlong_error_names_the_row(tok):
    with pytest.raises(DataValidationError, match=r"row 1, field 'chosen/rejected': expected at most "
                                                  r"max_length=12 tokens.*2 of 3 rows.*got 23 tokens"):
        prepare_preference_dataset(LONG, tok, args(max_length=12, overlong_policy="error"))


def test_input_dataset_is_not_modified(tok):
    data = Dataset.from_list(EXPLICIT)
    prepare_preference_dataset(data, tok, args())
    assert data.column_names == ["prompt", "chosen", "rejected"] and data[0] == EXPLICIT[0]


# ---------------------------------------------------------------------------------------------------
# Options: a RewardConfig, a PreferenceDataOptions or a plain DataOptions


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_plain_data_options_give_the_reward_config_tokens(tok, tmp_path, policy):
    rows = [dict(row, margin=float(i)) for i, row in enumerate(LONG)]
    shared = dict(max_length=12, overlong_policy=policy, dataset_num_proc=None)
    config = RewardConfig(output_dir=str(tmp_path), report_to=[], **shared)
    from_config, config_stats = prepare_preference_dataset(rows, tok, config, return_stats=True)
    plain, plain_stats = prepare_preference_dataset(rows, tok, DataOptions(**shared), return_stats=True)
    assert plain.to_list() == from_config.to_list() and plain_stats == config_stats
    assert config_stats["n_dropped"] >= 1 and "margin" in plain.column_names  # use_margin=None: the column is used


def test_reward_config_and_plain_options_keep_their_own_overlong_default(tok, tmp_path):
    assert RewardConfig(output_dir=str(tmp_path), report_to=[]).overlong_policy == "drop"
    assert PreferenceDataOptions().overlong_policy == "drop" and DataOptions().overlong_policy == "truncate"


def test_options_must_be_data_options(tok):
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="options must be a DataOptions .* got SimpleNamespace"):
        prepare_preference_dataset(EXPLICIT, tok, SimpleNamespace(max_length=64, overlong_policy="drop"))
