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

import logging
import math
from dataclasses import dataclass
from functools import partial
from numbers import Real

from datasets import Dataset

from .data import (
    _ABSENT,
    _Raw,
    MISSING,
    OVERLONG_POLICIES,
    DataValidationError,
    _check_chat_template,
    _special_prefix,
    _token_id,
    _tokenize_prompt_completion,
    apply_length_policy,
    as_dataset,
    check_messages,
    check_not_empty,
    check_text,
    column_names,
    is_conversational_column,
    iter_rows,
    resolve_chat_template,
)

logger = logging.getLogger("hf_rlhf")

PREFERENCE_FORMATS = ("implicit_prompt", "explicit_prompt", "conversational_implicit_prompt",
                      "conversational_explicit_prompt", "tokenized")
LENGTH_FIELD = "chosen/rejected"


def detect_preference_format(dataset) -> str:
    """One of `PREFERENCE_FORMATS`, from the columns (and whether `chosen` holds messages)."""
    check_not_empty(dataset)
    columns = column_names(dataset)
    if "chosen_ids" in columns and "rejected_ids" in columns:
        return "tokenized"
    if "chosen" not in columns or "rejected" not in columns:
        missing = [c for c in ("chosen", "rejected") if c not in columns]
        raise DataValidationError(
            None, missing[0], "preference data: 'chosen' and 'rejected' columns, optionally 'prompt' and 'margin' "
            "(or tokenized 'chosen_ids' and 'rejected_ids')", _Raw(f"columns {columns}"))
    conversational = is_conversational_column(dataset, "chosen") or is_conversational_column(dataset, "rejected")
    kind = "explicit_prompt" if "prompt" in columns else "implicit_prompt"
    return f"conversational_{kind}" if conversational else kind


def check_margin(row: int, field: str, value) -> None:
    """A finite real number (bool and numeric strings are refused)."""
    expected = "a finite number (int or float)"
    if value is _ABSENT:
        raise DataValidationError(row, field, expected, MISSING)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise DataValidationError(row, field, expected, value)


def check_token_ids(row: int, field: str, value) -> None:
    """A non-empty list of ints."""
    expected = "a non-empty list of token ids"
    if value is _ABSENT:
        raise DataValidationError(row, field, expected, MISSING)
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(t, int) for t in value):
        raise DataValidationError(row, field, expected, value)


def _field_checks(fmt: str, use_margin: bool) -> dict:
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
    """
    if fmt not in PREFERENCE_FORMATS:
        raise ValueError(f"unknown preference format {fmt!r}; expected one of {PREFERENCE_FORMATS}")
    checks = _field_checks(fmt, use_margin)
    pair = ("chosen_ids", "rejected_ids") if fmt == "tokenized" else ("chosen", "rejected")
    check_not_empty(dataset)
    for index, row in iter_rows(dataset, list(checks)):
        for field, check in checks.items():
            check(index, field, row[field])
        if list(row[pair[0]]) == list(row[pair[1]]) if fmt == "tokenized" else row[pair[0]] == row[pair[1]]:
            raise DataValidationError(index, pair[1], f"a response different from {pair[0]!r} (a pair needs two "
                                      "different responses)", row[pair[1]])


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


def _tokenize_side(spec: _PairTokenizeSpec, prompt, response) -> list[int]:
    tok = spec.tokenizer
    if spec.fmt.startswith("conversational"):
        messages = list(prompt or []) + list(response)
        return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    return _tokenize_prompt_completion(tok, prompt or "", response, spec.prefix, spec.eos_id)["input_ids"]


def _tokenize_pair(row: dict, index: int, spec: _PairTokenizeSpec) -> dict:
    if spec.fmt == "tokenized":
        chosen, rejected = list(row["chosen_ids"]), list(row["rejected_ids"])
    else:
        prompt = row.get("prompt")
        chosen, rejected = _tokenize_side(spec, prompt, row["chosen"]), _tokenize_side(spec, prompt, row["rejected"])
        if chosen == rejected:
            raise DataValidationError(index, "rejected", "a response that tokenizes differently from 'chosen'",
                                      row["rejected"])
    out = {"chosen_ids": chosen, "rejected_ids": rejected, "_length": max(len(chosen), len(rejected))}
    if spec.truncate and spec.max_length is not None and out["_length"] > spec.max_length:
        out["chosen_ids"], out["rejected_ids"] = chosen[: spec.max_length], rejected[: spec.max_length]
    # a pair the cut made identical cannot be learned from (apply_length_policy drops it)
    out["_trainable"] = out["chosen_ids"] != out["rejected_ids"]
    if spec.use_margin:
        out["margin"] = float(row["margin"])
    return out


def _resolve_use_margin(use_margin: bool | None, columns: list[str]) -> bool:
    if use_margin is None:
        return "margin" in columns
    if use_margin and "margin" not in columns:
        raise DataValidationError(None, "margin", "a 'margin' column (use_margin=True)", _Raw(f"columns {columns}"))
    return bool(use_margin)


def prepare_preference_dataset(dataset, tokenizer, args, return_stats: bool = False):
    """Detect, validate and tokenize preference pairs (a `Dataset` or a list of dicts; left unchanged).

    Args:
        args: a `RewardConfig`, or any object with its data attributes (`max_length`, `overlong_policy`,
            `use_margin`, `eos_token`, `chat_template_path`, `dataset_num_proc`).
        return_stats: also return {"n_rows", "n_truncated", "n_dropped"}.

    Returns:
        A `Dataset` with `chosen_ids`, `rejected_ids` (lists of ints) and, with a margin, `margin` (float);
        or `(dataset, stats)`.
    """
    policy = getattr(args, "overlong_policy", "drop")
    max_length = getattr(args, "max_length", None)
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong_policy={policy!r}; expected one of {OVERLONG_POLICIES}")

    # step 1. format and every row, before any tokenization
    fmt = detect_preference_format(dataset)
    use_margin = _resolve_use_margin(getattr(args, "use_margin", None), column_names(dataset))
    validate_preference_dataset(dataset, fmt, use_margin)

    # step 2. tokenizer: chat template, or eos and leading special tokens for plain text
    eos_id = prefix = None
    if fmt.startswith("conversational"):
        resolve_chat_template(tokenizer, getattr(args, "chat_template_path", None))
        _check_chat_template(tokenizer, "conversational", False)
    elif fmt != "tokenized":
        eos_token = getattr(args, "eos_token", None) or tokenizer.eos_token
        if eos_token is None:
            raise ValueError("tokenizer has no eos token: set RewardConfig.eos_token")
        eos_id = _token_id(tokenizer, eos_token, "eos_token")
        prefix = _special_prefix(tokenizer)

    # step 3. tokenize (and truncate), then apply the overlong policy
    spec = _PairTokenizeSpec(fmt, tokenizer, prefix, eos_id, max_length, policy == "truncate", use_margin)
    data = as_dataset(dataset)
    tokenized = data.map(
        _tokenize_pair, with_indices=True, fn_kwargs={"spec": spec}, remove_columns=data.column_names,
        num_proc=getattr(args, "dataset_num_proc", None), desc="Tokenizing preference pairs")
    tokenized, stats = apply_length_policy(tokenized, max_length, policy, LENGTH_FIELD)
    return (tokenized, stats) if return_stats else tokenized
