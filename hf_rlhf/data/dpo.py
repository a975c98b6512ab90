"""DPO data: TRL's preference formats checked row by row (`hf_rlhf.data.preference`), then tokenized as trl 1.16's
`DPOTrainer._prepare_dataset` does (dpo_trainer.py:1036-1142) into `prompt_ids`, `chosen_ids`, `rejected_ids`.

- implicit prompt: the prompt is extracted as the longest common prefix of the two sides (`trl.extract_prompt`);
- plain text: eos appended to each completion when missing; prompt and prompt+completion tokenized on their own,
  the completion starting after the prompt's tokens. Where tokens merge across the boundary (a prompt ending in a
  space) `prompt_tokenization` decides: `apart` (default) keeps the prompt's own tokens (the inference context) and
  tokenizes that completion on its own; `joint` (TRL's) cuts the prompt to where the token lists diverge. The number
  of rows this changes is logged once per dataset. An implicit prompt (extracted where the two texts differ, often
  mid-word) is no boundary a user gave: those rows are tokenized as whole texts, `joint`, either way;
- conversations: the chat template, the prompt rendered with the generation prompt; a row's `tools` (JSON or list)
  and `chat_template_kwargs` are passed to it;
- already tokenized rows (`prompt_ids`, `chosen_ids`, `rejected_ids`) are used as they are;
- a streamed `IterableDataset` is prepared lazily, as TRL 1.16's (nothing is read up front but its first row, for the
  format): each row is checked as it streams, just before it is tokenized, so an error names its index in the stream
  and its field; the over-long policy is a lazy filter; nothing is counted ahead.

Over-long rows (`max_length`, per sequence prompt + completion): `overlong_policy="truncate"` (the default) leaves the
cut to the collator (TRL's `truncation_mode`), after dropping rows whose prompt alone fills `max_length` with
`keep_start` (as TRL); `drop` removes rows with an over-long side; `error` names the first.
"""

from __future__ import annotations

import json

from datasets import Dataset
from trl.data_utils import extract_prompt, is_conversational

from .options import DataOptions
from .preference import (
    PreferenceDataOptions,
    check_preference_row,
    check_preference_rows,
    detect_preference_format,
    field_checks,
    resolve_use_margin,
)
from .streaming import first_rows, is_streamed, stream_columns
from .tokenization import (
    BOUNDARY_COLUMN,
    check_chat_template,
    common_prefix_length,
    log_boundary_rows,
    resolve_chat_template,
)
from .validation import ABSENT, DataValidationError, Verbatim, as_dataset, column_names, column_values

DPO_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def check_dpo_rows(dataset, options: DataOptions) -> str:
    """Check every row of in-memory DPO data before any model loads; returns its preference format.

    Raises:
        DataValidationError: naming the row, the field and what was expected.
    """
    if set(DPO_COLUMNS) <= set(column_names(dataset)):
        return "tokenized"
    return check_preference_rows(dataset, options)


def _tokenize(tokenizer, value, **template_kwargs) -> list[int]:
    if isinstance(value, list):  # messages
        encoded = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **template_kwargs)
        return list(encoded["input_ids"])
    return list(tokenizer(text=value)["input_ids"])


def completion_eos(tokenizer, options) -> str:
    eos = options.eos_token or tokenizer.eos_token
    if eos is None:
        raise DataValidationError(None, "eos_token", "an end-of-sequence token (the tokenizer has none; set "
                                  "DPOConfig.eos_token)", Verbatim("None"))
    return eos


def add_eos(row: dict, eos: str, sides: tuple[str, ...] = ("chosen", "rejected")) -> dict:
    """A plain-text row's completions (`sides`), each ending in `eos` (added where missing, as TRL)."""
    return {side: row[side] if row[side].endswith(eos) else row[side] + eos for side in sides}


def tokenize_completions(row: dict, sides: tuple[str, ...], tokenizer, prompt_tokenization: str = "apart") -> dict:
    """One row with an explicit prompt and completions `sides`: {"prompt_ids", "<side>_ids" for each side,
    "_boundary"}, each side's ids its completion tokens only, `_boundary` whether the setting changed the row.

    `joint` is TRL's (dpo_trainer.py:1075-1126, kto_trainer.py:1087-1128): prompt and prompt + completion tokenized
    on their own, the prompt cut to where any side's tokens diverge from it. `apart` (default) differs only where
    tokens merge across the boundary of plain text (a prompt ending in a space): the prompt keeps its own tokens, as at
    inference, and that side's completion is tokenized on its own. Conversations are rendered by the chat template
    either way (TRL's).
    """
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    kwargs = {"tools": tools, **(row.get("chat_template_kwargs") or {})}
    if is_conversational(row):
        prompt = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True, **kwargs)
        full = {side: _tokenize(tokenizer, row["prompt"] + row[side], **kwargs) for side in sides}
    else:
        prompt = _tokenize(tokenizer, row["prompt"])
        full = {side: _tokenize(tokenizer, row["prompt"] + row[side]) for side in sides}
    n = min(common_prefix_length(prompt, ids) for ids in full.values())
    merged = n < len(prompt) and not is_conversational(row)  # a conversation is tokenized the same either way
    if merged and prompt_tokenization == "apart":
        def completion(side, ids):
            if ids[: len(prompt)] == prompt:
                return ids[len(prompt):]
            return list(tokenizer(text=row[side], add_special_tokens=False)["input_ids"])

        return {"prompt_ids": prompt, **{f"{side}_ids": completion(side, ids) for side, ids in full.items()},
                BOUNDARY_COLUMN: True}
    return {"prompt_ids": prompt[:n], **{f"{side}_ids": ids[n:] for side, ids in full.items()},
            BOUNDARY_COLUMN: merged}


def tokenize_dpo_row(row: dict, tokenizer, prompt_tokenization: str = "apart") -> dict:
    """One pair with an explicit prompt: {"prompt_ids", "chosen_ids", "rejected_ids", "_boundary"}
    (`tokenize_completions` of both sides)."""
    return tokenize_completions(row, ("chosen", "rejected"), tokenizer, prompt_tokenization)


def prepare_dpo_dataset(dataset, tokenizer, options, rows_checked: bool = False) -> Dataset:
    """Validate and tokenize DPO data (a `Dataset` or a list of dicts) as TRL does (`prompt_tokenization='joint'`;
    the default `apart` differs where tokens merge across an explicit prompt's end, see the module docstring).

    Args:
        dataset: rows in a TRL preference format, or tokenized (`prompt_ids`, `chosen_ids`, `rejected_ids`).
        tokenizer: the tokenizer (`options.chat_template_path` replaces its chat template).
        options: a `DPOConfig` (`max_length`, `truncation_mode`, `overlong_policy`, `dataset_num_proc`, `eos_token`,
            `prompt_tokenization`).
        rows_checked: `check_dpo_rows` already passed.

    Returns:
        A `Dataset` with `prompt_ids`, `chosen_ids`, `rejected_ids` (completion tokens), and any other column kept
        (an `IterableDataset`, prepared lazily, for a stream).
    """
    if is_streamed(dataset):
        return _prepare_streamed(dataset, tokenizer, options)
    dataset = as_dataset(dataset)
    if set(DPO_COLUMNS) <= set(dataset.column_names):
        return dataset
    if not rows_checked:
        check_dpo_rows(dataset, options)
    implicit = "prompt" not in dataset.column_names
    # an extracted prompt ends where the texts differ, no boundary a user gave: tokenized as whole texts
    mode = "joint" if implicit else getattr(options, "prompt_tokenization", "apart")
    if implicit:
        dataset = dataset.map(extract_prompt, num_proc=options.dataset_num_proc, desc="Extracting prompts")
    if is_conversational(dataset[0]):
        resolve_chat_template(tokenizer, options.chat_template_path)
        check_chat_template(tokenizer, "conversational", False, "DPOConfig.chat_template_path")
    else:
        dataset = dataset.map(add_eos, fn_kwargs={"eos": completion_eos(tokenizer, options)},
                              num_proc=options.dataset_num_proc, desc="Adding eos")
    dataset = dataset.map(tokenize_dpo_row, fn_kwargs={"tokenizer": tokenizer, "prompt_tokenization": mode},
                          num_proc=options.dataset_num_proc, desc="Tokenizing DPO pairs")
    if not implicit:
        log_boundary_rows(sum(column_values(dataset, BOUNDARY_COLUMN)), len(dataset), mode,
                          f"{type(options).__name__}.prompt_tokenization")
    dataset = dataset.remove_columns([BOUNDARY_COLUMN])
    max_length, policy = options.max_length, getattr(options, "overlong_policy", "truncate")
    if max_length is None:
        return dataset
    if policy == "truncate":
        if getattr(options, "truncation_mode", "keep_start") == "keep_start":  # TRL: no completion token would remain
            dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < max_length, desc="Dropping full prompts")
        return dataset
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in
               zip(*(column_values(dataset, c) for c in ("prompt_ids", "chosen_ids", "rejected_ids")))]
    over = [i for i, n in enumerate(lengths) if n > max_length]
    if policy == "error" and over:
        raise DataValidationError(over[0], "chosen/rejected", f"prompt + completion of at most max_length="
                                  f"{max_length} tokens (overlong_policy='error')",
                                  Verbatim(f"{lengths[over[0]]} tokens"))
    return dataset.select([i for i in range(len(dataset)) if lengths[i] <= max_length]) if over else dataset


def _prepare_streamed(dataset, tokenizer, options):
    """`prepare_dpo_dataset` for an `IterableDataset`: the same rows, mapped lazily (see the module docstring)."""
    head = first_rows(dataset)[0]
    columns = stream_columns(dataset, head)
    if set(DPO_COLUMNS) <= set(columns):
        return dataset
    fmt = detect_preference_format([head])
    checks = field_checks(fmt, resolve_use_margin(PreferenceDataOptions.from_options(options).use_margin, columns))

    def check(row, index):  # before anything reads the row: a bad one fails naming its index and field
        check_preference_row(index, {field: row.get(field, ABSENT) for field in checks}, fmt, checks)
        return {}

    dataset = dataset.map(check, with_indices=True)
    implicit = "prompt" not in columns
    if implicit:
        dataset = dataset.map(extract_prompt)
    if fmt.startswith("conversational"):
        resolve_chat_template(tokenizer, options.chat_template_path)
        check_chat_template(tokenizer, "conversational", False, "DPOConfig.chat_template_path")
    else:
        dataset = dataset.map(add_eos, fn_kwargs={"eos": completion_eos(tokenizer, options)})
    mode = "joint" if implicit else getattr(options, "prompt_tokenization", "apart")
    dataset = dataset.map(tokenize_dpo_row, fn_kwargs={"tokenizer": tokenizer, "prompt_tokenization": mode})
    dataset = dataset.remove_columns([BOUNDARY_COLUMN])  # a stream is not counted ahead
    max_length, policy = options.max_length, getattr(options, "overlong_policy", "truncate")
    if max_length is None:
        return dataset
    if policy == "truncate":  # the collator cuts; a prompt that fills max_length leaves no completion (keep_start)
        if getattr(options, "truncation_mode", "keep_start") != "keep_start":
            return dataset
        return dataset.filter(lambda row: len(row["prompt_ids"]) < max_length)

    def keep(row, index):
        length = len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))
        if length > max_length and policy == "error":
            raise DataValidationError(index, "chosen/rejected", f"prompt + completion of at most max_length="
                                      f"{max_length} tokens (overlong_policy='error')", Verbatim(f"{length} tokens"))
        return length <= max_length

    return dataset.filter(keep, with_indices=True)
