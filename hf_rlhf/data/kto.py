"""KTO data: unpaired labelled completions, or preference pairs split into them, checked row by row and tokenized as
trl 1.16's `KTOTrainer._prepare_dataset` does (kto_trainer.py:1042-1191).

Formats (detected from the columns):

    unpaired    {"prompt": "2+2=", "completion": "4", "label": True}     (text or conversations; label: desirable?)
    paired      any TRL preference format ({"prompt", "chosen", "rejected"}, implicit prompt, conversations): each
                pair becomes two rows, its chosen completion desirable and its rejected one not (`trl`'s
                `unpair_preference_dataset`)
    tokenized   {"prompt_ids": [ints], "completion_ids": [ints], "label": bool} (+ `KL_completion_ids`), as it is

Then as TRL: eos appended to plain-text completions; prompt and prompt + completion tokenized (the boundary as
`prompt_tokenization`, see `hf_rlhf.data.dpo.tokenize_completions`); rows whose prompt alone fills `max_length`
dropped (`overlong_policy="truncate"`; `drop` / `error` as for DPO); and, for the KTO loss, each row's mismatched
completion `KL_completion_ids`: the completions rotated by one inside each block of `per_device_train_batch_size`
rows, (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), so that the batch's KL estimate sees the batch's own completions
paired with other prompts (`mismatched_completions`). A streamed `IterableDataset` is prepared lazily, as TRL's:
each row checked as it streams (the error names its index in the stream), the length policy a lazy filter.
"""

from __future__ import annotations

from datasets import Dataset
from trl.data_utils import extract_prompt, is_conversational, unpair_preference_dataset

from .dpo import add_eos, completion_eos, tokenize_completions
from .options import DataOptions
from .preference import check_preference_rows, check_token_ids
from .streaming import first_rows, is_streamed, stream_columns
from .tokenization import (
    BOUNDARY_COLUMN,
    check_chat_template,
    log_boundary_rows,
    resolve_chat_template,
)
from .validation import (
    ABSENT,
    MISSING,
    DataValidationError,
    Verbatim,
    as_dataset,
    check_messages,
    check_not_empty,
    check_text,
    column_names,
    column_values,
    is_conversational_column,
    iter_rows,
)

KTO_COLUMNS = ("prompt_ids", "completion_ids", "label")


def detect_kto_format(dataset) -> str:
    """"tokenized", "unpaired" (a `completion` or `label` column) or "paired" (a TRL preference format)."""
    columns = set(column_names(dataset))
    if set(KTO_COLUMNS) <= columns:
        return "tokenized"
    if {"completion", "label"} & columns:
        return "unpaired"
    return "paired"


def check_label(row: int, field: str, value) -> None:
    """A KTO label: a bool, True for a desirable completion."""
    if value is ABSENT:
        raise DataValidationError(row, field, "True (desirable) or False (undesirable)", MISSING)
    if not isinstance(value, bool) and type(value).__name__ != "bool_":  # numpy's bool too
        raise DataValidationError(row, field, "True (desirable) or False (undesirable)", value)


def check_prompt_ids(row: int, field: str, value) -> None:
    """Tokenized prompt ids: a list of ints, possibly empty (an unconditional completion)."""
    if value is ABSENT or not isinstance(value, (list, tuple)) or not all(isinstance(t, int) for t in value):
        raise DataValidationError(row, field, "a list of token ids", MISSING if value is ABSENT else value)


def check_kto_rows(dataset, options: DataOptions) -> str:
    """Check every row of in-memory KTO data before any model loads; returns its format (`detect_kto_format`).

    Raises:
        DataValidationError: naming the row, the field and what was expected.
    """
    fmt = detect_kto_format(dataset)
    if fmt == "paired":
        check_preference_rows(dataset, options)
        return fmt
    check_not_empty(dataset)
    checks = _row_checks(fmt, fmt != "tokenized" and is_conversational_column(dataset, "completion"))
    for index, row in iter_rows(dataset, list(checks)):
        for field, check in checks.items():
            check(index, field, row[field])
    return fmt


def mismatched_completions(completion_ids: list) -> list:
    """KTO's mismatched completions of one block of rows: each row gets the previous row's completion (the first
    gets the last's), trl 1.16 kto_trainer.py:1141-1155.

    >>> mismatched_completions([[1], [2, 2], [3]])
    [[3], [1], [2, 2]]
    """
    return completion_ids[-1:] + completion_ids[:-1]


def _add_mismatched(batch: dict) -> dict:
    return {"KL_completion_ids": mismatched_completions(batch["completion_ids"])}


def prepare_kto_dataset(dataset, tokenizer, options, block_size: int, mismatched: bool = True,
                        rows_checked: bool = False) -> Dataset:
    """Validate and tokenize KTO data as TRL does (see the module docstring).

    Args:
        dataset: rows in a format of `detect_kto_format` (a `Dataset` or a list of dicts).
        tokenizer: the tokenizer (`options.chat_template_path` replaces its chat template).
        options: a `KTOConfig` (`max_length`, `overlong_policy`, `dataset_num_proc`, `eos_token`,
            `prompt_tokenization`).
        block_size: rows per block of the mismatched-completion rotation (TRL: `per_device_train_batch_size`).
        mismatched: add `KL_completion_ids` (the `kto` loss; not `apo_zero_unpaired`).
        rows_checked: `check_kto_rows` already passed.

    Returns:
        A `Dataset` with `prompt_ids`, `completion_ids`, `label` (and `KL_completion_ids`), other columns kept.
    """
    if is_streamed(dataset):
        return _prepare_streamed(dataset, tokenizer, options, block_size, mismatched)
    dataset = as_dataset(dataset)
    fmt = "tokenized" if rows_checked and set(KTO_COLUMNS) <= set(dataset.column_names) else None
    fmt = fmt or (detect_kto_format(dataset) if rows_checked else check_kto_rows(dataset, options))
    proc = options.dataset_num_proc
    if fmt != "tokenized":
        implicit = "prompt" not in dataset.column_names
        mode = "joint" if implicit else getattr(options, "prompt_tokenization", "apart")
        if implicit:
            dataset = dataset.map(extract_prompt, num_proc=proc, desc="Extracting prompts")
        if fmt == "paired":
            dataset = unpair_preference_dataset(dataset, num_proc=proc, desc="Unpairing")
        if is_conversational(dataset[0]):
            resolve_chat_template(tokenizer, options.chat_template_path)
            check_chat_template(tokenizer, "conversational", False, f"{type(options).__name__}.chat_template_path")
        else:
            eos = completion_eos(tokenizer, options)
            dataset = dataset.map(add_eos, fn_kwargs={"eos": eos, "sides": ("completion",)}, num_proc=proc,
                                  desc="Adding eos")
        dataset = dataset.map(tokenize_completions, fn_kwargs={"sides": ("completion",), "tokenizer": tokenizer,
                                                               "prompt_tokenization": mode},
                              num_proc=proc, desc="Tokenizing KTO rows")
        if not implicit:
            log_boundary_rows(sum(column_values(dataset, BOUNDARY_COLUMN)), len(dataset), mode,
                              f"{type(options).__name__}.prompt_tokenization")
        dataset = dataset.remove_columns([BOUNDARY_COLUMN])
    dataset = _apply_length_policy(dataset, options)
    if mismatched and "KL_completion_ids" not in dataset.column_names:
        dataset = dataset.map(_add_mismatched, batched=True, batch_size=block_size, num_proc=proc,
                              desc="Mismatched KL completions")
    return dataset


def _row_checks(fmt: str, conversational: bool) -> dict:
    if fmt == "tokenized":
        return {"prompt_ids": check_prompt_ids, "completion_ids": check_token_ids, "label": check_label}
    if conversational:
        return {"prompt": check_messages, "label": check_label,
                "completion": lambda row, field, value: check_messages(row, field, value, require_assistant=True)}
    return {"prompt": check_text, "completion": check_text, "label": check_label}


def _prepare_streamed(dataset, tokenizer, options, block_size: int, mismatched: bool):
    """`prepare_kto_dataset` for an `IterableDataset`: the same rows, mapped lazily."""
    head = first_rows(dataset)[0]
    columns = stream_columns(dataset, head)
    fmt = detect_kto_format([head])
    if fmt == "paired":
        from .preference import check_preference_row, detect_preference_format, field_checks

        pair_format = detect_preference_format([head])
        pair_checks = field_checks(pair_format, False)

        def check(row, index):
            check_preference_row(index, {f: row.get(f, ABSENT) for f in pair_checks}, pair_format, pair_checks)
            return {}
    else:
        checks = _row_checks(fmt, isinstance(head.get("completion"), (list, tuple)))

        def check(row, index):  # before anything reads the row: a bad one fails naming its index and field
            for field, fn in checks.items():
                fn(index, field, row.get(field, ABSENT))
            return {}

    dataset = dataset.map(check, with_indices=True)
    if fmt != "tokenized":
        implicit = "prompt" not in columns
        if implicit:
            dataset = dataset.map(extract_prompt)
        if fmt == "paired":
            dataset = unpair_preference_dataset(dataset)
        mode = "joint" if implicit else getattr(options, "prompt_tokenization", "apart")
        if is_conversational(first_rows(dataset)[0]):  # a look-ahead through the maps so far
            resolve_chat_template(tokenizer, options.chat_template_path)
            check_chat_template(tokenizer, "conversational", False, f"{type(options).__name__}.chat_template_path")
        else:
            dataset = dataset.map(add_eos, fn_kwargs={"eos": completion_eos(tokenizer, options),
                                                      "sides": ("completion",)})
        dataset = dataset.map(tokenize_completions, fn_kwargs={"sides": ("completion",), "tokenizer": tokenizer,
                                                               "prompt_tokenization": mode})
        dataset = dataset.remove_columns([BOUNDARY_COLUMN])  # a stream is not counted ahead
    max_length, policy = options.max_length, getattr(options, "overlong_policy", "truncate")
    if max_length is not None:
        def keep(row, index):
            if policy == "truncate":
                return len(row["prompt_ids"]) < max_length
            length = len(row["prompt_ids"]) + len(row["completion_ids"])
            if length > max_length and policy == "error":
                raise DataValidationError(index, "completion", f"prompt + completion of at most max_length="
                                          f"{max_length} tokens (overlong_policy='error')",
                                          Verbatim(f"{length} tokens"))
            return length <= max_length

        dataset = dataset.filter(keep, with_indices=True)
    if mismatched:
        dataset = dataset.map(_add_mismatched, batched=True, batch_size=block_size)
    return dataset


def _apply_length_policy(dataset: Dataset, options) -> Dataset:
    max_length, policy = options.max_length, getattr(options, "overlong_policy", "truncate")
    if max_length is None:
        return dataset
    if policy == "truncate":  # the collator keeps the start; a prompt that fills max_length leaves no completion
        return dataset.filter(lambda row: len(row["prompt_ids"]) < max_length, desc="Dropping full prompts")
    lengths = [len(p) + len(c) for p, c in zip(column_values(dataset, "prompt_ids"),
                                               column_values(dataset, "completion_ids"))]
    over = [i for i, n in enumerate(lengths) if n > max_length]
    if policy == "error" and over:
        raise DataValidationError(over[0], "completion", f"prompt + completion of at most max_length={max_length} "
                                  "tokens (overlong_policy='error')", Verbatim(f"{lengths[over[0]]} tokens"))
    return dataset.select([i for i in range(len(dataset)) if lengths[i] <= max_length]) if over else dataset


def weight_balance_warning(labels, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's advice when desirable and undesirable rows are unbalanced and neither weight is in the range of Eq. (8) of
    the KTO paper (trl 1.16 kto_trainer.py:1157-1184): the message, or None.

    >>> weight_balance_warning([True, False, False, False], 1.0, 1.0)[:40]
    'desirable / undesirable rows are 1 / 3 b'
    >>> weight_balance_warning([True, False, False, False], 3.5, 1.0) is None
    True
    """
    desirable = max(sum(bool(x) for x in labels), 1)
    undesirable = max(len(labels) - desirable, 1)
    if desirable == undesirable:
        return None
    des_low = round(undesirable * undesirable_weight / desirable, 2)
    des_high = round(undesirable * undesirable_weight / desirable * 1.33, 2)
    und_low = round(desirable * desirable_weight / undesirable / 1.33, 2)
    und_high = round(desirable * desirable_weight / undesirable, 2)
    if des_low <= desirable_weight <= des_high or und_low <= undesirable_weight <= und_high:
        return None
    return (f"desirable / undesirable rows are {desirable} / {undesirable} but the weights are not in the range of "
            f"the KTO paper's Eq. (8): set EITHER desirable_weight in [{des_low}, {des_high}] OR undesirable_weight "
            f"in [{und_low}, {und_high}] (not both).")
