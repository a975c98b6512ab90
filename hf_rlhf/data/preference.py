"""Preference-pair formats: validation and tokenization (TRL's preference formats).

Formats, detected from the columns (an optional `margin` column goes with any of them):

    implicit_prompt                  {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}
    explicit_prompt                  {"prompt": "Q: 2+2? A: ", "chosen": "4", "rejected": "5"}
    conversational_implicit_prompt   {"chosen": [messages], "rejected": [messages]}
    conversational_explicit_prompt   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    tokenized                        {"chosen_ids": [ints], "rejected_ids": [ints]}  (TRL's processed columns)

Every row is checked before anything is tokenized (non-empty text or messages, a numeric margin, chosen
different from rejected), and errors name the row and the field. Plain text is tokenized as
`[bos] prompt + response [eos]` (TRL's: the tokenizer's special tokens, eos appended when missing);
conversations with the chat template.

Over-long pairs (`overlong_policy`, `RewardConfig`): a pair is over-long when its chosen or its rejected side
is longer than `max_length`. `drop` (default, TRL's behaviour) removes it; `error` raises on the first;
`truncate` keeps the start of both sides, unless the cut leaves them identical (it removed every token where
they differ, so the pair would teach nothing), in which case the pair is dropped. Counts are logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from numbers import Real

from .chatml import chat_template_row_kwargs
from .options import DataOptions, PreferenceDataOptions
from .streaming import first_rows, is_streamed, stream_columns, tokenize_rows
from .tokenization import (
    BOUNDARY_COLUMN,
    check_chat_template,
    check_overlong_policy,
    eos_token_id,
    prompt_completion_texts,
    resolve_chat_template,
    special_prefix,
    tokenize_prompt_completion,
)
from .validation import (
    ABSENT,
    MISSING,
    DataValidationError,
    Verbatim,
    check_messages,
    check_not_empty,
    check_text,
    column_names,
    is_conversational_column,
    iter_rows,
)

PREFERENCE_FORMATS = ("implicit_prompt", "explicit_prompt", "conversational_implicit_prompt",
                      "conversational_explicit_prompt", "tokenized")
LENGTH_FIELD = "chosen/rejected"


LEGACY_PAIR_COLUMNS = {"chosen_input_ids": "chosen_ids", "rejected_input_ids": "rejected_ids"}


def rename_legacy_pair_columns(dataset):
    """TRL's legacy tokenized columns `chosen_input_ids` / `rejected_input_ids` renamed to `chosen_ids` /
    `rejected_ids`, with TRL 1.16's `FutureWarning`; any other dataset (or None, a list of rows, a dict of datasets)
    comes back as it is.

    >>> import warnings; from datasets import Dataset
    >>> with warnings.catch_warnings(): warnings.simplefilter("ignore"); d = rename_legacy_pair_columns(
    ...     Dataset.from_list([{"chosen_input_ids": [1, 2], "rejected_input_ids": [1, 3]}]))
    >>> d.column_names
    ['chosen_ids', 'rejected_ids']
    """
    import warnings

    if isinstance(dataset, dict):
        return {key: rename_legacy_pair_columns(value) for key, value in dataset.items()}
    if dataset is None or not hasattr(dataset, "rename_columns"):
        return dataset
    columns = stream_columns(dataset, first_rows(dataset)[0]) if is_streamed(dataset) else dataset.column_names
    if not set(LEGACY_PAIR_COLUMNS) <= set(columns) or {"chosen_ids", "rejected_ids"} <= set(columns):
        return dataset
    warnings.warn("Detected legacy dataset columns `chosen_input_ids`/`rejected_input_ids`; they are deprecated and "
                  "will not be supported in v1 (TRL 1.16's deprecation). Please migrate to `chosen_ids`/"
                  "`rejected_ids`.", FutureWarning, stacklevel=3)
    return dataset.rename_columns(LEGACY_PAIR_COLUMNS)


def detect_preference_format(dataset) -> str:
    """The preference format of `dataset`, from its columns (and whether `chosen` holds messages).

    Args:
        dataset: a `Dataset` or a list of dict rows.

    Returns:
        One of `PREFERENCE_FORMATS`.
    """
    check_not_empty(dataset)
    columns = column_names(dataset)
    if "chosen_ids" in columns and "rejected_ids" in columns:
        return "tokenized"
    if "chosen" not in columns or "rejected" not in columns:
        missing = [c for c in ("chosen", "rejected") if c not in columns]
        raise DataValidationError(
            None, missing[0], "preference data: 'chosen' and 'rejected' columns, optionally 'prompt' and 'margin' "
            "(or tokenized 'chosen_ids' and 'rejected_ids')", Verbatim(f"columns {columns}"))
    conversational = is_conversational_column(dataset, "chosen") or is_conversational_column(dataset, "rejected")
    kind = "explicit_prompt" if "prompt" in columns else "implicit_prompt"
    return f"conversational_{kind}" if conversational else kind


def check_margin(row: int, field: str, value) -> None:
    """Check that `value` is a finite real number (bool and numeric strings are refused).

    Args:
        row, field: where, for the error.
        value: the value, or `ABSENT`.
    """
    expected = "a finite number (int or float)"
    if value is ABSENT:
        raise DataValidationError(row, field, expected, MISSING)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise DataValidationError(row, field, expected, value)


def check_token_ids(row: int, field: str, value) -> None:
    """Check that `value` is a non-empty list of ints.

    Args:
        row, field: where, for the error.
        value: the value, or `ABSENT`.
    """
    expected = "a non-empty list of token ids"
    if value is ABSENT:
        raise DataValidationError(row, field, expected, MISSING)
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(t, int) for t in value):
        raise DataValidationError(row, field, expected, value)


def field_checks(fmt: str, use_margin: bool) -> dict:
    """{field: check(row_index, field, value)} for a row of preference format `fmt` (`check_preference_row`)."""
    explicit = fmt.endswith("explicit_prompt")
    if fmt == "tokenized":
        checks = {"chosen_ids": check_token_ids, "rejected_ids": check_token_ids}
    elif fmt.startswith("conversational"):
        # a whole conversation (implicit prompt) or the answer to the prompt's messages: either way it must hold
        # the assistant turn being judged
        response = partial(check_messages, require_assistant=True)
        checks = {"prompt": check_messages} if explicit else {}
        checks.update(chosen=response, rejected=response)
    else:
        checks = {"prompt": check_text} if explicit else {}
        checks.update(chosen=check_text, rejected=check_text)
    if use_margin:
        checks["margin"] = check_margin
    return checks


def validate_preference_dataset(dataset, fmt: str, use_margin: bool = False) -> None:
    """Check every row against `fmt`; raise `DataValidationError` (row, field, expected) on the first bad one.

    Besides each field's own check, a pair whose chosen equals its rejected is refused: its loss is a constant
    log 2 and it teaches nothing.

    Args:
        dataset: a `Dataset` or a list of dict rows.
        fmt: one of `PREFERENCE_FORMATS` (`detect_preference_format`).
        use_margin: also check a numeric `margin` on every row.
    """
    if fmt not in PREFERENCE_FORMATS:
        raise ValueError(f"unknown preference format {fmt!r}; expected one of {PREFERENCE_FORMATS}")
    checks = field_checks(fmt, use_margin)
    check_not_empty(dataset)
    for index, row in iter_rows(dataset, list(checks)):
        check_preference_row(index, row, fmt, checks)


def check_preference_row(index: int, row: dict, fmt: str, checks: dict) -> None:
    """One row's field checks (`ABSENT` for a missing field), then chosen != rejected.

    Args:
        index: the row's index, for the error.
        row: {field: value} for every field of `checks`.
        fmt: one of `PREFERENCE_FORMATS`.
        checks: `{field: check}` (`field_checks`).
    """
    for field, check in checks.items():
        check(index, field, row.get(field, ABSENT))
    pair = ("chosen_ids", "rejected_ids") if fmt == "tokenized" else ("chosen", "rejected")
    if list(row[pair[0]]) == list(row[pair[1]]) if fmt == "tokenized" else row[pair[0]] == row[pair[1]]:
        raise DataValidationError(index, pair[1], f"a response different from {pair[0]!r} (a pair needs two "
                                  "different responses)", row[pair[1]])
    if fmt == "conversational_implicit_prompt":
        check_shared_prompt(index, row["chosen"], row["rejected"])


def _message(message) -> dict:
    # datasets fills keys another row has with None: compare what the message says
    return {k: v for k, v in dict(message).items() if v is not None}


def check_shared_prompt(row: int, chosen, rejected) -> None:
    """Check that two conversations differ only in their last message, an assistant turn (implicit-prompt pairs).

    The prompt of an implicit-prompt pair is everything before the judged answer; if chosen and rejected differ
    earlier, the pair compares two different conversations and its preference says nothing about the answer.

    Args:
        row: the row's index (for the error).
        chosen, rejected: lists of messages (already checked by `check_messages`).
    """
    for field, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            raise DataValidationError(row, f"{field}[{len(messages) - 1}].role", "'assistant' (the last message of "
                                      "an implicit-prompt pair is the answer being judged)", messages[-1]["role"])
    if len(chosen) != len(rejected) or any(_message(a) != _message(b) for a, b in zip(chosen[:-1], rejected[:-1])):
        k = next((k for k, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if _message(a) != _message(b)),
                 min(len(chosen), len(rejected)) - 1)
        raise DataValidationError(
            row, "rejected", "the same messages as 'chosen' up to the last assistant turn (implicit-prompt pairs "
            "share their prompt)", Verbatim(f"a different message at index {k} ({len(chosen)} messages in "
                                            f"chosen, {len(rejected)} in rejected)"))


# ---------------------------------------------------------------------------------------------------
# Tokenization


@dataclass
class _PairTokenizeSpec:
    """What one row's tokenization needs; passed to `Dataset.map` (pickled to its workers)."""

    fmt: str
    tokenizer: object
    prefix: list[int] | None
    eos_id: int | None
    max_length: int | None
    truncate: bool
    use_margin: bool
    checks: dict | None = None  # streamed rows: validated here, just before tokenization
    prompt_tokenization: str = "apart"  # or "joint" (TRL's): `tokenize_prompt_completion`


def _tokenize_side(spec: _PairTokenizeSpec, prompt, response, template_kwargs: dict) -> tuple[list[int], bool]:
    """(ids, whether tokens merged across the prompt / response boundary)."""
    tok = spec.tokenizer
    if spec.fmt.startswith("conversational"):
        messages = list(prompt or []) + list(response)
        return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            **template_kwargs)["input_ids"]), False
    out = tokenize_prompt_completion(tok, prompt or "", response, spec.prefix, spec.eos_id, spec.prompt_tokenization)
    return out["input_ids"], out[BOUNDARY_COLUMN]


def _pair_texts(row: dict, spec: _PairTokenizeSpec) -> list[str]:
    """The plain texts `_tokenize_pair` encodes (encoded ahead, a batch at a time, by `tokenize_rows`)."""
    if spec.fmt == "tokenized" or spec.fmt.startswith("conversational"):
        return []
    prompt = row.get("prompt") or ""
    return prompt_completion_texts(prompt, row.get("chosen")) + prompt_completion_texts(prompt, row.get("rejected"))


def _tokenize_pair(row: dict, index: int, spec: _PairTokenizeSpec) -> dict:
    if spec.checks is not None:
        check_preference_row(index, row, spec.fmt, spec.checks)
    merged = False
    if spec.fmt == "tokenized":
        chosen, rejected = list(row["chosen_ids"]), list(row["rejected_ids"])
    else:
        prompt, template_kwargs = row.get("prompt"), chat_template_row_kwargs(row)  # `tools`, `chat_template_kwargs`
        (chosen, merged_chosen), (rejected, merged_rejected) = (_tokenize_side(spec, prompt, row[side], template_kwargs)
                                                                for side in ("chosen", "rejected"))
        merged = merged_chosen or merged_rejected
        if chosen == rejected:
            raise DataValidationError(index, "rejected", "a response that tokenizes differently from 'chosen'",
                                      row["rejected"])
    out = {"chosen_ids": chosen, "rejected_ids": rejected, "_length": max(len(chosen), len(rejected)),
           BOUNDARY_COLUMN: merged}
    if spec.truncate and spec.max_length is not None and out["_length"] > spec.max_length:
        out["chosen_ids"], out["rejected_ids"] = chosen[: spec.max_length], rejected[: spec.max_length]
    # a pair the cut made identical cannot be learned from (apply_length_policy drops it)
    out["_trainable"] = out["chosen_ids"] != out["rejected_ids"]
    if spec.use_margin:
        out["margin"] = float(row["margin"])
    return out


def resolve_use_margin(use_margin: bool | None, columns: list[str]) -> bool:
    """The margin column is used when asked, or by default (None) when there is one."""
    if use_margin is None:
        return "margin" in columns
    if use_margin and "margin" not in columns:
        raise DataValidationError(None, "margin", "a 'margin' column (use_margin=True)", Verbatim(f"columns {columns}"))
    return bool(use_margin)


def check_preference_rows(dataset, options: DataOptions) -> str:
    """Detect the format of in-memory preference pairs and check every row (no tokenizer needed); its format.

    What `prepare_preference_dataset` does first; a trainer calls it before it loads any model, then prepares with
    `rows_checked=True`.

    Raises:
        DataValidationError: naming the row, the field and what was expected.
    """
    opts = PreferenceDataOptions.from_options(options)
    fmt = detect_preference_format(dataset)
    validate_preference_dataset(dataset, fmt, resolve_use_margin(opts.use_margin, column_names(dataset)))
    return fmt


def prepare_preference_dataset(dataset, tokenizer, options: DataOptions, return_stats: bool = False,
                               rows_checked: bool = False):
    """Detect, validate and tokenize preference pairs (a `Dataset`, a list of dicts or a streamed `IterableDataset`;
    left unchanged).

    A streamed dataset is prepared lazily (`hf_rlhf.data.streaming`): its format from its first row, each pair
    validated as it streams, the over-long policy a lazy filter; its stats are None.

    Args:
        dataset: rows in one of `PREFERENCE_FORMATS`.
        tokenizer: the tokenizer; `options.chat_template_path` replaces its chat template for conversations.
        options: a `RewardConfig`, a `PreferenceDataOptions`, or a plain `DataOptions` (its `overlong_policy` is
            used as given; the margin column is used when there is one).
        return_stats: also return {"n_rows", "n_truncated", "n_dropped"}.
        rows_checked: the rows already passed `check_preference_rows` with these options (not checked again).

    Returns:
        A `Dataset` with `chosen_ids`, `rejected_ids` (lists of ints) and, with a margin, `margin` (float);
        or `(dataset, stats)`.
    """
    opts = PreferenceDataOptions.from_options(options)
    owner = type(options).__name__  # errors name the class the user passed
    check_overlong_policy(opts.overlong_policy)

    # step 1. format and every row, before any tokenization (a stream: its first row, then each row as it streams)
    streamed = is_streamed(dataset)
    head = first_rows(dataset) if streamed else dataset
    fmt = detect_preference_format(head)
    use_margin = resolve_use_margin(opts.use_margin, column_names(head))
    if not streamed and not rows_checked:
        validate_preference_dataset(dataset, fmt, use_margin)

    # step 2. tokenizer: chat template, or eos and leading special tokens for plain text
    eos_id = prefix = None
    if fmt.startswith("conversational"):
        resolve_chat_template(tokenizer, opts.chat_template_path)
        check_chat_template(tokenizer, "conversational", False, f"{owner}.chat_template_path")
    elif fmt != "tokenized":
        eos_id = eos_token_id(tokenizer, opts.eos_token, f"{owner}.eos_token")
        prefix = special_prefix(tokenizer)

    # step 3. tokenize (and truncate), then apply the overlong policy
    spec = _PairTokenizeSpec(fmt, tokenizer, prefix, eos_id, opts.max_length, opts.overlong_policy == "truncate",
                             use_margin, field_checks(fmt, use_margin) if streamed else None, opts.prompt_tokenization)
    tokenized, stats = tokenize_rows(dataset, _tokenize_pair, spec, opts, LENGTH_FIELD,
                                     "Tokenizing preference pairs", head[0] if streamed else None,
                                     tokenizer if fmt != "tokenized" else None, ("chosen_ids", "rejected_ids"), owner,
                                     _pair_texts)
    return (tokenized, stats) if return_stats else tokenized
