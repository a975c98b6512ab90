"""Dataset formats, validation and tokenization (`hf_rlhf.data`), with a character-level test tokenizer."""

from __future__ import annotations

import copy
import logging
import pickle
import string

import pytest
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

from hf_rlhf.data import (
    DataValidationError,
    detect_format,
    ensure_pad_token,
    prepare_sft_dataset,
    resolve_chat_template,
    validate_sft_dataset,
)
from hf_rlhf.data.options import DataOptions, SFTDataOptions
from hf_rlhf.trainers.sft_config import SFTConfig

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
# ChatML with the assistant content and its end-of-turn inside {% generation %} markers.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def build_tokenizer(merges=(), bos=True, pad=True, chat_template=CHAT_TEMPLATE):
    """Character-level BPE (plus `merges`) that prepends <s> by default, like Llama's tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(string.printable))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>" if pad else None, chat_template=chat_template)


@pytest.fixture
def tokenizer():
    return build_tokenizer()


def sft_args(**overrides):
    args = dict(dataset_text_field="text", max_length=None, overlong_policy="truncate", chat_template_path=None,
                eos_token=None, pad_token=None, completion_only_loss=None, assistant_only_loss=False,
                dataset_num_proc=None)
    return SFTDataOptions(**{**args, **overrides})


def masked_text(tokenizer, row, mask="completion_mask"):
    ids = [t for t, m in zip(row["input_ids"], row[mask]) if m]
    return tokenizer.decode(ids)


def conv(user, assistant):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


# ---------------------------------------------------------------------------------------------------
# Format detection


@pytest.mark.parametrize(
    "rows, expected",
    [
        ([{"text": "hello"}], "text"),
        ([{"prompt": "a", "completion": "b"}], "prompt_completion"),
        ([{"messages": conv("hi", "yo")}], "conversational"),
        ([{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}],
         "conversational_prompt_completion"),
    ],
)
def test_detect_format(rows, expected):
    assert detect_format(rows) == expected
    assert detect_format(Dataset.from_list(rows)) == expected


def test_detect_format_custom_text_field():
    assert detect_format([{"body": "x"}], text_field="body") == "text"


def test_detect_format_unknown_columns_names_found_and_expected():
    with pytest.raises(DataValidationError) as err:
        detect_format([{"question": "a", "answer": "b"}])
    msg = str(err.value)
    assert "'question'" in msg and "'answer'" in msg
    assert "'messages'" in msg and "'prompt'" in msg and "'completion'" in msg and "'text'" in msg


@pytest.mark.parametrize("empty", [[], Dataset.from_dict({"text": []})])
def test_empty_dataset(empty):
    with pytest.raises(DataValidationError, match="dataset is empty"):
        detect_format(empty)


# ---------------------------------------------------------------------------------------------------
# Row validation: each bad input names its row and field


def test_error_message_format_and_attributes():
    rows = [{"prompt": "p", "completion": "c"}] * 3 + [{"prompt": "p", "completion": ""}]
    with pytest.raises(DataValidationError) as err:
        validate_sft_dataset(rows, "prompt_completion")
    assert str(err.value) == "row 3, field 'completion': expected a non-empty string, got ''"
    assert (err.value.row, err.value.field, err.value.expected) == (3, "completion", "a non-empty string")


def test_missing_field():
    rows = [{"prompt": "p", "completion": "c"}, {"prompt": "p"}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'completion'.*missing"):
        validate_sft_dataset(rows, "prompt_completion")


def test_none_value():
    ds = Dataset.from_dict({"prompt": ["p", "p", None], "completion": ["c", "c", "c"]})
    with pytest.raises(DataValidationError, match=r"row 2, field 'prompt': expected a non-empty string, got None"):
        validate_sft_dataset(ds, "prompt_completion")


def test_empty_text():
    with pytest.raises(DataValidationError, match=r"row 1, field 'body'.*got ''"):
        validate_sft_dataset([{"body": "x"}, {"body": ""}], "text", text_field="body")


def test_non_string_completion_in_dataset():
    ds = Dataset.from_dict({"prompt": ["p", "q"], "completion": [1, 2]})
    with pytest.raises(DataValidationError, match=r"row 0, field 'completion'.*got 1 \(int\)"):
        validate_sft_dataset(ds, "prompt_completion")


def test_non_string_message_content():
    rows = [{"messages": conv("hi", "yo")}, {"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": 5}]}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'messages\[1\]\.content': expected a string, got 5"):
        validate_sft_dataset(rows, "conversational")


def test_unknown_role():
    rows = [{"messages": conv("hi", "yo")}] * 2 + [{"messages": [{"role": "bot", "content": "hi"}]}]
    with pytest.raises(DataValidationError, match=r"row 2, field 'messages\[0\]\.role'.*'assistant'.*got 'bot'"):
        validate_sft_dataset(rows, "conversational")


def test_message_not_a_dict():
    with pytest.raises(DataValidationError, match=r"row 0, field 'messages\[0\]': expected a message dict"):
        validate_sft_dataset([{"messages": ["hello"]}], "conversational")


def test_empty_messages_list():
    rows = [{"messages": conv("hi", "yo")}, {"messages": []}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'messages': expected a non-empty list"):
        validate_sft_dataset(rows, "conversational")


def test_conversational_completion_without_assistant():
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "yo"}]}]
    with pytest.raises(DataValidationError, match=r"row 0, field 'completion': expected at least one 'assistant'"):
        validate_sft_dataset(rows, "conversational_prompt_completion")


def test_conversational_prompt_that_is_a_string():
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "a"}]},
            {"prompt": "hi", "completion": [{"role": "assistant", "content": "a"}]}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'prompt': expected a non-empty list"):
        validate_sft_dataset(rows, "conversational_prompt_completion")


def test_validation_runs_before_tokenization(tokenizer):
    # the bad row is the last one: no row may be tokenized before it is found
    rows = [{"prompt": "p", "completion": "c"}] * 5 + [{"prompt": "p", "completion": None}]
    calls = []
    tokenizer_call = type(tokenizer).__call__
    type(tokenizer).__call__ = lambda self, *a, **k: calls.append(a) or tokenizer_call(self, *a, **k)
    try:
        with pytest.raises(DataValidationError, match="row 5, field 'completion'"):
            prepare_sft_dataset(rows, tokenizer, sft_args())
    finally:
        type(tokenizer).__call__ = tokenizer_call
    assert calls == []


def test_error_pickles_for_worker_processes():
    err = DataValidationError(4, "prompt", "a non-empty string", None)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) == "row 4, field 'prompt': expected a non-empty string, got None"
    plain = pickle.loads(pickle.dumps(DataValidationError(1, "x", "y")))
    assert str(plain) == "row 1, field 'x': expected y"


# ---------------------------------------------------------------------------------------------------
# Tokenizer set-up


def test_no_pad_token_falls_back_to_eos_with_a_warning(caplog):
    tok = build_tokenizer(pad=False)
    with caplog.at_level("WARNING", logger="hf_rlhf"):
        ensure_pad_token(tok, None)
    assert tok.pad_token == tok.eos_token and tok.pad_token_id == tok.eos_token_id
    assert "no pad token: padding with its eos token" in caplog.text
    caplog.clear()
    ensure_pad_token(tok, None)  # a tokenizer that has one now is left as it is, silently
    assert not caplog.text


def test_no_pad_and_no_eos_token_is_an_error():
    tok = build_tokenizer(pad=False)
    tok.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        ensure_pad_token(tok, None)


def test_pad_token_from_config():
    tok = build_tokenizer(pad=False)
    ensure_pad_token(tok, "<unk>")
    assert tok.pad_token == "<unk>" and tok.pad_token_id == tok.convert_tokens_to_ids("<unk>")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        ensure_pad_token(tok, "<nope>")


def test_resolve_chat_template_from_file_and_directory(tmp_path):
    (tmp_path / "t.jinja").write_text(PLAIN_TEMPLATE)
    tok = build_tokenizer(chat_template=None)
    resolve_chat_template(tok, str(tmp_path / "t.jinja"))
    assert tok.chat_template == PLAIN_TEMPLATE

    build_tokenizer().save_pretrained(tmp_path / "tok")
    resolve_chat_template(tok, str(tmp_path / "tok"))
    assert tok.chat_template == CHAT_TEMPLATE
    with pytest.raises(FileNotFoundError):
        resolve_chat_template(tok, str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------------
# Tokenization of the four formats


def test_text_format_exact_ids(tokenizer):
    out = prepare_sft_dataset([{"text": "hi"}, {"text": "yo</s>"}], tokenizer, sft_args())
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ["<s>", "h", "i", "</s>"]]
    assert out[0]["input_ids"] == ids
    assert out.column_names == ["input_ids"]
    assert out[1]["input_ids"].count(tokenizer.eos_token_id) == 1  # eos already there: not doubled


def test_prompt_completion_mask(tokenizer):
    out = prepare_sft_dataset([{"prompt": "Q: 2+2?", "completion": " A: 4"}], tokenizer, sft_args())
    row = out[0]
    assert set(out.column_names) == {"input_ids", "completion_mask"}
    assert row["input_ids"][0] == tokenizer.bos_token_id and row["input_ids"].count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(row["input_ids"]) == "<s>Q: 2+2? A: 4</s>"
    assert masked_text(tokenizer, row) == " A: 4</s>"
    assert row["completion_mask"] == [0] * 8 + [1] * 6


def test_prompt_completion_without_default_bos_and_custom_eos():
    tok = build_tokenizer(bos=False)
    out = prepare_sft_dataset([{"prompt": "ab", "completion": "cd"}], tok, sft_args(eos_token="<|im_end|>"))
    assert tok.decode(out[0]["input_ids"]) == "abcd<|im_end|>"
    assert masked_text(tok, out[0]) == "cd<|im_end|>"


def test_prompt_completion_merged_across_boundary():
    # "a" + "b" would merge into one "ab" token: prompt and completion are tokenized apart instead
    tok = build_tokenizer(merges=[("a", "b")])
    out = prepare_sft_dataset([{"prompt": "xa", "completion": "by"}, {"prompt": "ab", "completion": "c"}],
                              tok, sft_args())
    split, joint = out[0], out[1]
    assert tok.convert_ids_to_tokens(split["input_ids"]) == ["<s>", "x", "a", "b", "y", "</s>"]
    assert masked_text(tok, split) == "by</s>"
    assert tok.convert_ids_to_tokens(joint["input_ids"]) == ["<s>", "ab", "c", "</s>"]
    assert masked_text(tok, joint) == "c</s>"


def test_prompt_tokenization_joint_is_trls_and_rows_affected_are_logged(caplog):
    # "xa" + "by": "ab" merges across the boundary. apart (default): the prompt's own tokens x, a (as at inference);
    # joint (TRL's): x, ab, y with the completion starting where the ids diverge from the prompt's (at "ab")
    tok = build_tokenizer(merges=[("a", "b")])
    rows = [{"prompt": "xa", "completion": "by"}, {"prompt": "x", "completion": "y"}]
    out = {}
    for mode in ("apart", "joint"):
        with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
            caplog.clear()
            out[mode] = prepare_sft_dataset(rows, tok, sft_args(prompt_tokenization=mode))
        assert [r.getMessage().startswith("1 of 2 rows: tokens merge across") for r in caplog.records] == [True]
        assert "SFTDataOptions.prompt_tokenization" in caplog.records[0].getMessage()  # the options passed
        assert out[mode].column_names == ["input_ids", "completion_mask"]
    assert tok.convert_ids_to_tokens(out["apart"][0]["input_ids"]) == ["<s>", "x", "a", "b", "y", "</s>"]
    assert masked_text(tok, out["apart"][0]) == "by</s>"
    assert tok.convert_ids_to_tokens(out["joint"][0]["input_ids"]) == ["<s>", "x", "ab", "y", "</s>"]
    assert masked_text(tok, out["joint"][0]) == "aby</s>"
    assert out["apart"][1] == out["joint"][1]  # no merge: the same either way


def test_prompt_tokenization_reward_and_dpo():
    from hf_rlhf import DPOConfig, RewardConfig
    from hf_rlhf.data import prepare_preference_dataset
    from hf_rlhf.data.dpo import prepare_dpo_dataset

    tok = build_tokenizer(merges=[("a", "b")])
    row = {"prompt": "xa", "chosen": "by", "rejected": "c"}
    ids = {mode: prepare_preference_dataset([row], tok, RewardConfig(output_dir="o", prompt_tokenization=mode))[0]
           for mode in ("apart", "joint")}
    assert tok.convert_ids_to_tokens(ids["apart"]["chosen_ids"]) == ["<s>", "x", "a", "b", "y", "</s>"]
    assert tok.convert_ids_to_tokens(ids["joint"]["chosen_ids"]) == ["<s>", "x", "ab", "y", "</s>"]
    assert ids["apart"]["rejected_ids"] == ids["joint"]["rejected_ids"]
    dpo = {mode: prepare_dpo_dataset([row], tok, DPOConfig(output_dir="o", prompt_tokenization=mode))[0]
           for mode in ("apart", "joint")}
    names = {mode: {k: tok.convert_ids_to_tokens(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
             for mode, r in dpo.items()}
    assert names["apart"] == {"prompt_ids": ["<s>", "x", "a"], "chosen_ids": ["b", "y", "</s>"],
                              "rejected_ids": ["c", "</s>"]}
    # TRL's: the prompt cut where either side diverges from it, for both sides
    assert names["joint"] == {"prompt_ids": ["<s>", "x"], "chosen_ids": ["ab", "y", "</s>"],
                              "rejected_ids": ["a", "c", "</s>"]}
    with pytest.raises(ValueError, match="prompt_tokenization='both'"):
        DPOConfig(output_dir="o", prompt_tokenization="both")


def test_conversational_assistant_masks(tokenizer):
    rows = [{"messages": [{"role": "system", "content": "be brief"}, *conv("hi", "yo"), *conv("ok?", "ok")]}]
    out = prepare_sft_dataset(rows, tokenizer, sft_args(assistant_only_loss=True))
    row = out[0]
    assert set(out.column_names) == {"input_ids", "assistant_masks"}
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert masked_text(tokenizer, row, "assistant_masks") == "yo<|im_end|>ok<|im_end|>"
    assert row["input_ids"].count(tokenizer.bos_token_id) == 1  # from the template only


def test_conversational_without_assistant_only_loss(tokenizer):
    out = prepare_sft_dataset([{"messages": conv("hi", "yo")}], tokenizer, sft_args())
    assert out.column_names == ["input_ids"]


def test_conversational_prompt_completion_mask(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "capital of France?"}],
             "completion": [{"role": "assistant", "content": "Paris"}]}]
    out = prepare_sft_dataset(rows, tokenizer, sft_args(assistant_only_loss=True))
    row = out[0]
    assert masked_text(tokenizer, row) == "Paris<|im_end|>\n"
    assert masked_text(tokenizer, row, "assistant_masks") == "Paris<|im_end|>"
    prompt_text = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode([t for t, m in zip(row["input_ids"], row["completion_mask"]) if not m]) == prompt_text


def test_conversational_prompt_not_a_prefix(tokenizer):
    # a template that renders the prompt differently when a completion follows
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}>>{% endif %}")
    rows = [{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}]
    with pytest.raises(DataValidationError, match="row 0, field 'prompt'.*prefix"):
        prepare_sft_dataset(rows, tokenizer, sft_args())
    # prompt_tokenization="joint": TRL's, the completion starts where "q>>" and "qa" diverge
    out = prepare_sft_dataset(rows, tokenizer, sft_args(prompt_tokenization="joint"))
    assert masked_text(tokenizer, out[0]) == "a"


def test_input_dataset_unchanged(tokenizer):
    rows = [{"prompt": "Q", "completion": "A", "id": 7}]
    before = copy.deepcopy(rows)
    ds = Dataset.from_list(rows)
    out = prepare_sft_dataset(ds, tokenizer, sft_args())
    prepare_sft_dataset(rows, tokenizer, sft_args())
    assert rows == before
    assert ds.column_names == ["prompt", "completion", "id"] and ds.to_list() == before
    assert set(out.column_names) == {"input_ids", "completion_mask"}


def test_with_sft_config_and_two_processes(tokenizer, tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), max_length=8, dataset_num_proc=2, report_to=[])
    rows = [{"prompt": "p" * n, "completion": "c"} for n in range(1, 11)]
    out, stats = prepare_sft_dataset(rows, tokenizer, args, return_stats=True)
    # n + 3 tokens: p*6 is cut to "<s>pppppp c", p*7 .. p*10 keep no completion token
    assert stats == {"n_rows": 10, "n_truncated": 1, "n_dropped": 4}
    assert [sum(r["completion_mask"]) for r in out] == [2, 2, 2, 2, 2, 1] and max(map(len, out["input_ids"])) == 8


# ---------------------------------------------------------------------------------------------------
# Chat template requirements


def test_conversational_needs_chat_template():
    tok = build_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match=r"dataset is conversational \('messages'\) but the tokenizer has no chat "
                                         r"template; set SFTDataOptions.chat_template_path"):
        prepare_sft_dataset([{"messages": conv("hi", "yo")}], tok, sft_args())


def test_chat_template_path_is_applied_first(tmp_path):
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE)
    tok = build_tokenizer(chat_template=None)
    out = prepare_sft_dataset([{"messages": conv("hi", "yo")}], tok,
                              sft_args(chat_template_path=str(tmp_path / "t.jinja"), assistant_only_loss=True))
    assert masked_text(tok, out[0], "assistant_masks") == "yo<|im_end|>"


def test_assistant_only_loss_needs_generation_markers():
    tok = build_tokenizer(chat_template=PLAIN_TEMPLATE)
    with pytest.raises(ValueError, match=r"\{% generation %\}.*no such markers"):
        prepare_sft_dataset([{"messages": conv("hi", "yo")}], tok, sft_args(assistant_only_loss=True))


def test_assistant_only_loss_all_zero_mask_names_row():
    # markers exist but never wrap the assistant turn: caught per row
    template = PLAIN_TEMPLATE + "{% if false %}{% generation %}x{% endgeneration %}{% endif %}"
    tok = build_tokenizer(chat_template=template)
    with pytest.raises(DataValidationError, match=r"row 0, field 'messages'.*generation"):
        prepare_sft_dataset([{"messages": conv("hi", "yo")}], tok, sft_args(assistant_only_loss=True))


def test_assistant_only_loss_needs_an_assistant_turn(tokenizer):
    rows = [{"messages": conv("hi", "yo")}, {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DataValidationError, match=r"row 1, field 'messages': expected at least one 'assistant'"):
        prepare_sft_dataset(rows, tokenizer, sft_args(assistant_only_loss=True))


def test_assistant_only_loss_on_plain_data(tokenizer):
    with pytest.raises(ValueError, match="needs conversational data"):
        prepare_sft_dataset([{"text": "x"}], tokenizer, sft_args(assistant_only_loss=True))


# ---------------------------------------------------------------------------------------------------
# Over-long examples: <s> + prompt + completion + </s>


OVERLONG_ROWS = [
    {"prompt": "ab", "completion": "c"},       # 5 tokens
    {"prompt": "abcd", "completion": "efg"},   # 9 tokens: truncated to 6, keeps "e"
    {"prompt": "abcdefgh", "completion": "i"},  # 11 tokens: only prompt left after truncation
]


def test_overlong_truncate(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        out, stats = prepare_sft_dataset(OVERLONG_ROWS, tokenizer, sft_args(max_length=6), return_stats=True)
    assert stats == {"n_rows": 3, "n_truncated": 1, "n_dropped": 1}
    assert len(out) == 2
    assert tokenizer.decode(out[1]["input_ids"]) == "<s>abcde" and masked_text(tokenizer, out[1]) == "e"
    assert len(out[1]["completion_mask"]) == 6
    assert "1 of 3 examples longer than max_length=6 were truncated" in caplog.text
    assert "1 of 3 examples longer than max_length=6 were dropped" in caplog.text


def test_overlong_drop(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        out, stats = prepare_sft_dataset(OVERLONG_ROWS, tokenizer, sft_args(max_length=6, overlong_policy="drop"),
                                         return_stats=True)
    assert stats == {"n_rows": 3, "n_truncated": 0, "n_dropped": 2}
    assert tokenizer.decode(out["input_ids"][0]) == "<s>abc</s>" and len(out) == 1
    assert "2 of 3 examples longer than max_length=6 were dropped" in caplog.text


def test_overlong_error(tokenizer):
    with pytest.raises(DataValidationError, match=r"row 1, field 'prompt\+completion': expected at most "
                                                  r"max_length=6 tokens.*got 9 tokens"):
        prepare_sft_dataset(OVERLONG_ROWS, tokenizer, sft_args(max_length=6, overlong_policy="error"))


def test_no_max_length_keeps_everything(tokenizer):
    out, stats = prepare_sft_dataset(OVERLONG_ROWS, tokenizer, sft_args(), return_stats=True)
    assert stats == {"n_rows": 3, "n_truncated": 0, "n_dropped": 0}
    assert [len(ids) for ids in out["input_ids"]] == [5, 9, 11]


def test_truncate_text_keeps_start(tokenizer):
    out = prepare_sft_dataset([{"text": "abcdefgh"}], tokenizer, sft_args(max_length=4))
    assert tokenizer.decode(out[0]["input_ids"]) == "<s>abc"


# ---------------------------------------------------------------------------------------------------
# Options: an SFTConfig, an SFTDataOptions or a plain DataOptions


MIXED_ROWS = [{"prompt": "ab", "completion": "c"}, {"prompt": "abcd", "completion": "efg"},
              {"prompt": "abcdefgh", "completion": "i"}]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_plain_data_options_give_the_sft_config_tokens(tokenizer, tmp_path, policy):
    shared = dict(max_length=6, overlong_policy=policy, eos_token="<|im_end|>", dataset_num_proc=None)
    config = SFTConfig(output_dir=str(tmp_path), report_to=[], **shared)
    from_config, config_stats = prepare_sft_dataset(MIXED_ROWS, tokenizer, config, return_stats=True)
    plain, plain_stats = prepare_sft_dataset(MIXED_ROWS, tokenizer, DataOptions(**shared), return_stats=True)
    assert plain.to_list() == from_config.to_list() and plain_stats == config_stats
    assert config_stats["n_dropped"] >= 1  # the options reached the length policy: rows 1-2 are 9 and 11 tokens
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(row["input_ids"][-1] == eos for row in plain if len(row["input_ids"]) < 6)


def test_plain_data_options_take_sft_defaults_for_sft_only_fields(tokenizer):
    rows = [{"text": "hello"}]
    assert SFTDataOptions.from_options(DataOptions(max_length=None)) == sft_args()
    assert prepare_sft_dataset(rows, tokenizer, DataOptions()).to_list() == \
        prepare_sft_dataset(rows, tokenizer, sft_args(max_length=1024)).to_list()


def test_options_must_be_data_options(tokenizer):
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="options must be a DataOptions .* got SimpleNamespace"):
        prepare_sft_dataset([{"text": "hi"}], tokenizer, SimpleNamespace(max_length=None, overlong_policy="truncate"))


def test_errors_name_the_options_class_passed(tokenizer):
    tok = build_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match=r"set DataOptions.chat_template_path to"):
        prepare_sft_dataset([{"messages": conv("hi", "yo")}], tok, DataOptions())
    with pytest.raises(ValueError, match=r"SFTDataOptions.eos_token='<nope>' is not in the tokenizer's vocabulary"):
        prepare_sft_dataset([{"text": "hi"}], tokenizer, sft_args(eos_token="<nope>"))


def test_main_process_goes_first_only_for_cached_datasets(tmp_path):
    from hf_rlhf.data import main_process_first_if_cached

    class Args:  # records what the trainer's prepare step asks of TrainingArguments
        def __init__(self):
            self.calls = []

        def main_process_first(self, desc):
            self.calls.append(desc)
            return SFTConfig.main_process_first(SFTConfig(output_dir=str(tmp_path), report_to=[]), desc=desc)

    rows = [{"text": "hi"}, {"text": "yo"}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    on_disk = Dataset.load_from_disk(str(tmp_path / "ds"))
    args = Args()
    for data in (rows, Dataset.from_list(rows)):  # in memory: no cache to share, so no rank waits
        with main_process_first_if_cached(args, data, "train"):
            pass
    assert args.calls == []
    with main_process_first_if_cached(args, on_disk, "train dataset tokenization"):
        pass
    assert args.calls == ["train dataset tokenization"]


# ---------------------------------------------------------------------------------------------------
# ShareGPT rows and per-row chat template arguments (as TRL)


def test_sharegpt_rows_prepare_exactly_as_their_chatml_rows(tokenizer):
    from hf_rlhf.data.chatml import to_chatml

    chatml = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
              {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    sharegpt = Dataset.from_list([{"conversations": [{"from": m["role"], "value": m["content"]} for m in r["messages"]]}
                                  for r in chatml])
    converted = to_chatml(sharegpt)
    assert converted.column_names == ["messages"]
    expected = prepare_sft_dataset(Dataset.from_list(chatml), tokenizer, sft_args())
    assert prepare_sft_dataset(converted, tokenizer, sft_args())["input_ids"] == expected["input_ids"]
    plain = Dataset.from_list(chatml)
    assert to_chatml(plain) is plain and to_chatml(None) is None
    # preference columns too (TRL converts prompt / chosen / rejected messages)
    pairs = to_chatml(Dataset.from_list([{"chosen": [{"from": "user", "value": "a"}],
                                          "rejected": [{"from": "user", "value": "b"}]}]))
    assert pairs[0]["chosen"] == [{"role": "user", "content": "a"}]


def test_row_chat_template_kwargs_and_tools_reach_the_template():
    template = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
                "{% if shout %}!{% endif %}|{% endfor %}{% if tools %}tools={{ tools | length }}{% endif %}")
    tok = build_tokenizer(chat_template=template, bos=False)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = Dataset.from_list([
        {"messages": messages, "chat_template_kwargs": {"shout": True}, "tools": None},
        {"messages": messages, "chat_template_kwargs": {"shout": None},
         "tools": '[{"type": "function", "function": {"name": "f"}}]'},
    ])
    ids = prepare_sft_dataset(rows, tok, sft_args())["input_ids"]
    texts = [tok.decode(row) for row in ids]
    assert texts[0] == "user: hi!|assistant: yo!|"
    assert texts[1] == "user: hi|assistant: yo|tools=1"


def test_assistant_only_loss_with_a_stock_template_uses_trls_training_version():
    """As TRL: Qwen2.5's stock template has no {% generation %} markers; TRL's shipped training version of it marks
    the assistant turns, and tokenization uses it while the tokenizer keeps its own (inference) template."""
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = build_tokenizer(chat_template=qwen2_5_chat_template, bos=False)
    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}]
    out = prepare_sft_dataset(rows, tok, sft_args(assistant_only_loss=True))
    ids, mask = out[0]["input_ids"], out[0]["assistant_masks"]
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    # both answers with their end of turn (TRL's template also marks the newline after the role), no user text
    assert trained.replace("\n", "") == "4<|im_end|>6<|im_end|>", trained
    assert tok.chat_template == qwen2_5_chat_template
    # the text is the stock template's: training changes which tokens are masked, not what the model sees
    assert tok.decode(ids) == tok.apply_chat_template(rows[0]["messages"], tokenize=False)


# ---------------------------------------------------------------------------------------------------
# In-memory preparation maps a batch of rows at a time and encodes each batch's texts in one tokenizer call
# (`hf_rlhf.data.streaming.map_rows`, `hf_rlhf.data.tokenization.PreEncodedTokenizer`): the rows, logs and errors
# must be exactly what a row-at-a-time preparation gives.

import random  # noqa: E402

from hf_rlhf import RewardConfig  # noqa: E402
from hf_rlhf.data import prepare_preference_dataset  # noqa: E402
from hf_rlhf.data.sft import build_labels  # noqa: E402
from hf_rlhf.data.tokenization import (  # noqa: E402
    PreEncodedTokenizer,
    backend_encodes_plainly,
    encode_plain_batch,
    map_rows,
    special_prefix,
    tokenize_prompt_completion,
)

# merges make tokens join across the prompt / completion boundary ("a" | "b"), and across words
MERGES = [("a", "b"), ("c", "d"), ("ab", "cd"), (" ", "x")]


def random_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice("abcdx y") for _ in range(rng.randint(0, k)))  # noqa: E731
    return [{"prompt": rng.choice("abcd") + text(8) + rng.choice(["a", "c", " ", "ab"]),
             "completion": rng.choice(["b", "d", "x"]) + text(6)}
            for _ in range(n)]


def count_tokenizer_calls(tokenizer, monkeypatch) -> list[int]:
    """Patches the tokenizer's class to record its calls: 1 for a text, the list's length for a batch."""
    calls, inner = [], type(tokenizer).__call__

    def counted(tok, text, *args, **kwargs):
        calls.append(len(text) if isinstance(text, list) else 1)
        return inner(tok, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counted)
    return calls


@pytest.mark.parametrize("mode", ["apart", "joint"])
def test_sft_rows_equal_one_row_at_a_time_across_batches(mode, monkeypatch):
    tok = build_tokenizer(merges=MERGES)
    rows = random_rows(2100)  # three batches of Dataset.map's 1,000
    expected = [tokenize_prompt_completion(tok, r["prompt"], r["completion"], special_prefix(tok), tok.eos_token_id,
                                           mode) for r in rows]
    assert sum(e["_boundary"] for e in expected) > 100  # the merges do cross the boundary
    calls = count_tokenizer_calls(tok, monkeypatch)
    out = prepare_sft_dataset(rows, tok, sft_args(prompt_tokenization=mode))
    assert out["input_ids"] == [e["input_ids"] for e in expected]
    assert out["completion_mask"] == [e["completion_mask"] for e in expected]
    # one batched call per batch, not two or three calls per row (the single calls: special_prefix's probes)
    assert sum(c > 1 for c in calls) == 3 and calls.count(1) <= 2, calls


def test_sft_text_rows_and_labels_equal_one_row_at_a_time():
    tok = build_tokenizer(merges=MERGES)
    rows = [{"text": r["prompt"] + r["completion"]} for r in random_rows(1500, seed=1)]
    out = prepare_sft_dataset(rows, tok, sft_args(max_length=12, overlong_policy="truncate"))
    expected = [(special_prefix(tok) + tok(r["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                [:12] for r in rows]
    assert out["input_ids"] == expected
    labeled = build_labels(Dataset.from_dict({"input_ids": [[1, 2, 3]] * 1500, "completion_mask": [[0, 1, 1]] * 1500}))
    assert labeled.column_names == ["input_ids", "labels"] and set(map(tuple, labeled["labels"])) == {(-100, 2, 3)}
    both = build_labels(Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 1500, "completion_mask": [[0, 1, 1, 1]] * 1500,
                                           "assistant_masks": [[1, 1, 0, 1]] * 1500}))  # a token needs both masks
    assert both.column_names == ["input_ids", "labels"] and set(map(tuple, both["labels"])) == {(-100, 2, -100, 4)}


def test_preference_rows_equal_one_row_at_a_time():
    tok = build_tokenizer(merges=MERGES)
    rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"] + "y"}
            for r in random_rows(1200, seed=2)]
    out = prepare_preference_dataset(rows, tok, RewardConfig(output_dir="o"))
    for side in ("chosen", "rejected"):
        assert out[f"{side}_ids"] == [
            tokenize_prompt_completion(tok, r["prompt"], r[side], special_prefix(tok), tok.eos_token_id)["input_ids"]
            for r in rows]


def test_an_error_names_its_row_in_a_later_batch():
    def row_fn(row, index, spec):
        if index == 1234:
            raise DataValidationError(index, "x", "a small x", row["x"])
        return {"y": row["x"] + 1}

    data = Dataset.from_dict({"x": list(range(2000))})
    with pytest.raises(DataValidationError, match="row 1234") as err:
        data.map(map_rows, batched=True, with_indices=True, fn_kwargs={"row_fn": row_fn, "spec": object()})
    assert err.value.row == 1234


def test_plain_batch_encoding_is_the_tokenizer_call(monkeypatch):
    # straight from the Rust backend where that is the stock call's result, special tokens in the text included;
    # through the tokenizer's own call where that call would reconfigure the backend or is not the stock one
    texts = [r["prompt"] + r["completion"] for r in random_rows(300, seed=3)] + ["<s>ab</s> x", "", "  ", "ab\ncd\t"]
    stock = build_tokenizer(merges=MERGES)
    expected = stock(texts, add_special_tokens=False)["input_ids"]
    assert backend_encodes_plainly(stock) and encode_plain_batch(stock, texts) == expected
    assert expected[-4][0] == stock.bos_token_id and len(set(map(tuple, expected))) > 250  # "<s>": one token

    truncating = build_tokenizer(merges=MERGES)
    truncating.backend_tokenizer.enable_truncation(max_length=3)  # the stock call switches it off for the call
    assert not backend_encodes_plainly(truncating) and encode_plain_batch(truncating, texts) == expected

    splitting = build_tokenizer(merges=MERGES)
    splitting.split_special_tokens = True
    split = splitting(texts, add_special_tokens=False)["input_ids"]
    assert split[-4][0] != stock.bos_token_id and len(split[-4]) > len(expected[-4])  # "<s>": three characters
    splitting.backend_tokenizer.encode_special_tokens = False  # as a fresh tokenizer's, before its first call
    assert not backend_encodes_plainly(splitting) and encode_plain_batch(splitting, texts) == split

    patched = build_tokenizer(merges=MERGES)
    calls = count_tokenizer_calls(patched, monkeypatch)  # a class whose __call__ is not the stock one
    assert not backend_encodes_plainly(patched) and encode_plain_batch(patched, texts) == expected
    assert calls == [len(texts)] and encode_plain_batch(patched, []) == []


def test_pre_encoded_tokenizer_falls_through_for_anything_else():
    tok = build_tokenizer(merges=MERGES)
    pre = PreEncodedTokenizer(tok, ["ab cd", "ab cd", "x"])
    assert list(pre.ids) == ["ab cd", "x"]  # repeats encoded once
    assert pre("ab cd", add_special_tokens=False) == {"input_ids": tok("ab cd", add_special_tokens=False)["input_ids"]}
    assert pre("ab cd")["input_ids"] == tok("ab cd")["input_ids"]  # with special tokens: the tokenizer's
    assert pre("abx", add_special_tokens=False)["input_ids"] == tok("abx", add_special_tokens=False)["input_ids"]
    assert pre.eos_token_id == tok.eos_token_id and pre.decode([5]) == tok.decode([5])
    ids = pre("x", add_special_tokens=False)["input_ids"]
    ids.append(0)  # a caller's list is its own
    assert pre("x", add_special_tokens=False)["input_ids"] == tok("x", add_special_tokens=False)["input_ids"]
