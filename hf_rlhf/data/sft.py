"""SFT datasets: format detection, validation and tokenization (`prepare_sft_dataset`).

Formats (TRL's names), detected from the columns:

    text                              {"text": "..."}  (the column is `SFTConfig.dataset_text_field`)
    prompt_completion                 {"prompt": "...", "completion": "..."}
    conversational                    {"messages": [{"role": "user", "content": "..."}, ...]}
    conversational_prompt_completion  {"prompt": [messages], "completion": [messages]}

Tokenized columns: `input_ids`; `completion_mask` (1 on completion tokens, prompt/completion formats);
`assistant_masks` (1 on assistant tokens, when `assistant_only_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..configs import DataOptions, SFTDataOptions
from .tokenization import (
    apply_length_policy,
    check_chat_template,
    check_overlong_policy,
    check_unknown_tokens,
    eos_token_id,
    resolve_chat_template,
    special_prefix,
    tokenize_prompt_completion,
    with_eos,
)
from .validation import (
    DataValidationError,
    Verbatim,
    as_dataset,
    check_messages,
    check_not_empty,
    check_text,
    column_names,
    is_conversational_column,
    validate_rows,
)

CONVERSATIONAL_FORMATS = ("conversational", "conversational_prompt_completion")


# ---------------------------------------------------------------------------------------------------
# SFT formats


def detect_format(dataset, text_field: str = "text") -> str:
    """The SFT format of `dataset`, from its columns.

    Checked in this order of precedence: a `messages` column, then `prompt` + `completion` (message
    lists or strings), then `text_field`.

    Args:
        dataset: a `Dataset` or a list of dict rows.
        text_field: the column of plain-text datasets.

    Returns:
        "text", "prompt_completion", "conversational" or "conversational_prompt_completion".
    """
    check_not_empty(dataset)
    columns = column_names(dataset)
    if "messages" in columns:
        return "conversational"
    if "prompt" in columns and "completion" in columns:
        conversational = is_conversational_column(dataset, "prompt") or is_conversational_column(dataset, "completion")
        return "conversational_prompt_completion" if conversational else "prompt_completion"
    if text_field in columns:
        return "text"
    raise DataValidationError(
        None, None,
        f"a 'messages' column, 'prompt' and 'completion' columns, or a {text_field!r} column "
        "(SFTConfig.dataset_text_field)",
        Verbatim(f"columns {columns}"),
    )


def validate_sft_dataset(dataset, fmt: str, text_field: str = "text", *, require_assistant: bool = False) -> None:
    """Check every row of `dataset` against `fmt`; raise `DataValidationError` on the first bad one.

    Args:
        dataset: a `Dataset` or a list of dict rows.
        fmt: its format (`detect_format`).
        text_field: the column of plain-text datasets.
        require_assistant: every `messages` row needs an assistant message (set for assistant_only_loss).
    """
    messages = partial(check_messages, require_assistant=require_assistant)
    checks = {
        "text": {text_field: check_text},
        "prompt_completion": {"prompt": check_text, "completion": check_text},
        "conversational": {"messages": messages},
        "conversational_prompt_completion": {
            "prompt": check_messages, "completion": partial(check_messages, require_assistant=True)},
    }
    if fmt not in checks:
        raise ValueError(f"unknown SFT dataset format {fmt!r}; expected one of {sorted(checks)}")
    validate_rows(dataset, checks[fmt])


# ---------------------------------------------------------------------------------------------------
# Tokenization


@dataclass
class _SFTTokenizeSpec:
    """What one row's tokenization needs; passed to `Dataset.map` (pickled to its workers)."""

    fmt: str
    tokenizer: object
    text_field: str
    prefix: list[int]           # leading special ids (bos) for plain formats
    eos_id: int | None          # appended to plain text / completions
    assistant_only_loss: bool
    max_length: int | None
    truncate: bool
    loss_masks: tuple[str, ...]  # masks that must keep a 1 after truncation


def _tokenize_chat(tokenizer, messages, assistant_only_loss: bool, index: int, field: str) -> dict:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=assistant_only_loss)
    row = {"input_ids": list(out["input_ids"])}
    if assistant_only_loss:
        row["assistant_masks"] = list(out["assistant_masks"])
        if not any(row["assistant_masks"]) and any(m["role"] == "assistant" for m in messages):
            raise DataValidationError(
                index, field, "assistant tokens marked by the chat template's {% generation %} block "
                "(assistant_only_loss=True)", Verbatim("an all-zero assistant mask"))
    return row


def _tokenize_sft_row(row: dict, index: int, spec: _SFTTokenizeSpec) -> dict:
    tok = spec.tokenizer
    if spec.fmt == "text":
        ids = tok(row[spec.text_field], add_special_tokens=False)["input_ids"]
        out = {"input_ids": with_eos(spec.prefix + ids, spec.eos_id)}
    elif spec.fmt == "prompt_completion":
        out = tokenize_prompt_completion(tok, row["prompt"], row["completion"], spec.prefix, spec.eos_id)
    elif spec.fmt == "conversational":
        out = _tokenize_chat(tok, row["messages"], spec.assistant_only_loss, index, "messages")
    else:  # conversational_prompt_completion
        prompt_ids = tok.apply_chat_template(
            list(row["prompt"]), tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
        out = _tokenize_chat(tok, list(row["prompt"]) + list(row["completion"]), spec.assistant_only_loss,
                             index, "completion")
        if out["input_ids"][: len(prompt_ids)] != list(prompt_ids):
            raise DataValidationError(
                index, "prompt", "the chat template to render the prompt (with add_generation_prompt=True) as a "
                "prefix of prompt+completion",
                Verbatim("a different start; the template changes past turns when a completion follows"))
        n_prompt = len(prompt_ids)
        out["completion_mask"] = [0] * n_prompt + [1] * (len(out["input_ids"]) - n_prompt)

    # Record the untruncated length for the overlong policy; truncation keeps the start (TRL's keep_start).
    out["_length"] = len(out["input_ids"])
    if spec.truncate and spec.max_length is not None and out["_length"] > spec.max_length:
        out = {k: (v[: spec.max_length] if isinstance(v, list) else v) for k, v in out.items()}
    out["_trainable"] = all(any(out[m]) for m in spec.loss_masks if m in out)
    return out


def prepare_sft_dataset(dataset, tokenizer, options: DataOptions, return_stats: bool = False):
    """Detect, validate and tokenize an SFT dataset (a `Dataset` or a list of dicts; left unchanged).

    Args:
        dataset: rows in one of the formats of this module.
        tokenizer: the tokenizer; `options.chat_template_path` replaces its chat template.
        options: an `SFTConfig`, an `SFTDataOptions`, or a plain `DataOptions` (text column "text", completion-only
            loss on prompt/completion data, no assistant-only loss).
        return_stats: also return {"n_rows", "n_truncated", "n_dropped"}.

    Returns:
        A `Dataset` with `input_ids` and, per format, `completion_mask` / `assistant_masks`
        (each a list with one entry per token), or `(dataset, stats)`.
    """
    opts = SFTDataOptions.from_options(options)
    owner = type(options).__name__  # errors name the class the user passed
    check_overlong_policy(opts.overlong_policy)

    # step 1. format and every row, before any tokenization
    fmt = detect_format(dataset, opts.dataset_text_field)
    if opts.assistant_only_loss and fmt not in CONVERSATIONAL_FORMATS:
        raise ValueError(f"assistant_only_loss=True needs conversational data; the dataset format is {fmt!r}")
    validate_sft_dataset(dataset, fmt, opts.dataset_text_field, require_assistant=opts.assistant_only_loss)

    # step 2. tokenizer: chat template, eos, default leading special tokens
    resolve_chat_template(tokenizer, opts.chat_template_path)
    eos_id = prefix = None
    if fmt in CONVERSATIONAL_FORMATS:
        # the template writes its own bos / end of turn
        check_chat_template(tokenizer, fmt, opts.assistant_only_loss, f"{owner}.chat_template_path")
    else:
        eos_id = eos_token_id(tokenizer, opts.eos_token, f"{owner}.eos_token")
        prefix = special_prefix(tokenizer)

    # step 3. tokenize (and truncate), then apply the overlong policy
    loss_masks = (("completion_mask",) if opts.completion_only_loss is not False else ()) + (
        ("assistant_masks",) if opts.assistant_only_loss else ())
    spec = _SFTTokenizeSpec(fmt, tokenizer, opts.dataset_text_field, prefix, eos_id, opts.assistant_only_loss,
                            opts.max_length, opts.overlong_policy == "truncate", loss_masks)
    data = as_dataset(dataset)
    tokenized = data.map(
        _tokenize_sft_row, with_indices=True, fn_kwargs={"spec": spec}, remove_columns=data.column_names,
        num_proc=opts.dataset_num_proc, desc="Tokenizing SFT dataset")
    field = {"text": opts.dataset_text_field, "prompt_completion": "prompt+completion",
             "conversational": "messages", "conversational_prompt_completion": "prompt+completion"}[fmt]
    check_unknown_tokens(tokenized, ("input_ids",), tokenizer, opts.max_unk_share, opts.strict, field)
    tokenized, stats = apply_length_policy(tokenized, opts.max_length, opts.overlong_policy, field)
    return (tokenized, stats) if return_stats else tokenized
