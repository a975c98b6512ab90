"""DPO data: TRL's preference formats checked row by row (`hf_rlhf.data.preference`), then tokenized as trl 1.16's
`DPOTrainer._prepare_dataset` does (dpo_trainer.py:1036-1142) into `prompt_ids`, `chosen_ids`, `rejected_ids`.

- implicit prompt: the prompt is extracted as the longest common prefix of the two sides (`trl.extract_prompt`);
- plain text: eos appended to each completion when missing; prompt and prompt+completion tokenized on their own,
  the completion starting where the two token lists diverge (a boundary that merges tokens moves into the prompt);
- conversations: the chat template, the prompt rendered with the generation prompt; a row's `tools` (JSON or list)
  and `chat_template_kwargs` are passed to it;
- already tokenized rows (`prompt_ids`, `chosen_ids`, `rejected_ids`) are used as they are.

Over-long rows (`max_length`, per sequence prompt + completion): `overlong_policy="truncate"` (the default) leaves the
cut to the collator (TRL's `truncation_mode`), after dropping rows whose prompt alone fills `max_length` with
`keep_start` (as TRL); `drop` removes rows with an over-long side; `error` names the first.
"""

from __future__ import annotations

import json

from datasets import Dataset
from trl.data_utils import extract_prompt, is_conversational

from ..configs import DataOptions
from .preference import check_preference_rows
from .tokenization import check_chat_template, resolve_chat_template
from .validation import DataValidationError, Verbatim, as_dataset, column_names

DPO_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def check_dpo_rows(dataset, options: DataOptions) -> str:
    """Check every row of in-memory DPO data before any model loads; returns its preference format.

    Raises:
        DataValidationError: naming the row, the field and what was expected.
    """
    if set(DPO_COLUMNS) <= set(column_names(dataset)):
        return "tokenized"
    return check_preference_rows(dataset, options)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _tokenize(tokenizer, value, **template_kwargs) -> list[int]:
    if isinstance(value, list):  # messages
        return list(tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **template_kwargs)["input_ids"])
    return list(tokenizer(text=value)["input_ids"])


def tokenize_dpo_row(row: dict, tokenizer) -> dict:
    """One row with an explicit prompt as TRL tokenizes it: {"prompt_ids", "chosen_ids", "rejected_ids"} where
    chosen / rejected hold the completion tokens only (dpo_trainer.py:1075-1126)."""
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    kwargs = {"tools": tools, **(row.get("chat_template_kwargs") or {})}
    if is_conversational(row):
        prompt = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True, **kwargs)
        chosen = _tokenize(tokenizer, row["prompt"] + row["chosen"], **kwargs)
        rejected = _tokenize(tokenizer, row["prompt"] + row["rejected"], **kwargs)
    else:
        prompt = _tokenize(tokenizer, row["prompt"])
        chosen = _tokenize(tokenizer, row["prompt"] + row["chosen"])
        rejected = _tokenize(tokenizer, row["prompt"] + row["rejected"])
    n = min(_common_prefix_length(prompt, chosen), _common_prefix_length(prompt, rejected))
    return {"prompt_ids": prompt[:n], "chosen_ids": chosen[n:], "rejected_ids": rejected[n:]}


def prepare_dpo_dataset(dataset, tokenizer, options, rows_checked: bool = False) -> Dataset:
    """Validate and tokenize DPO data (a `Dataset` or a list of dicts) as TRL does.

    Args:
        dataset: rows in a TRL preference format, or tokenized (`prompt_ids`, `chosen_ids`, `rejected_ids`).
        tokenizer: the tokenizer (`options.chat_template_path` replaces its chat template).
        options: a `DPOConfig` (`max_length`, `truncation_mode`, `overlong_policy`, `dataset_num_proc`, `eos_token`).
        rows_checked: `check_dpo_rows` already passed.

    Returns:
        A `Dataset` with `prompt_ids`, `chosen_ids`, `rejected_ids` (completion tokens), and any other column kept.
    """
    dataset = as_dataset(dataset)
    if set(DPO_COLUMNS) <= set(dataset.column_names):
        return dataset
    if not rows_checked:
        check_dpo_rows(dataset, options)
    if "prompt" not in dataset.column_names:
        dataset = dataset.map(extract_prompt, num_proc=options.dataset_num_proc, desc="Extracting prompts")
    if is_conversational(dataset[0]):
        resolve_chat_template(tokenizer, options.chat_template_path)
        check_chat_template(tokenizer, "conversational", False, "DPOConfig.chat_template_path")
    else:
        eos = options.eos_token or tokenizer.eos_token
        if eos is None:
            raise DataValidationError(None, "eos_token", "an end-of-sequence token (the tokenizer has none; set "
                                      "DPOConfig.eos_token)", Verbatim("None"))

        def add_eos(row):
            return {side: row[side] if row[side].endswith(eos) else row[side] + eos for side in ("chosen", "rejected")}

        dataset = dataset.map(add_eos, num_proc=options.dataset_num_proc, desc="Adding eos")
    dataset = dataset.map(tokenize_dpo_row, fn_kwargs={"tokenizer": tokenizer}, num_proc=options.dataset_num_proc,
                          desc="Tokenizing DPO pairs")
    max_length, policy = options.max_length, getattr(options, "overlong_policy", "truncate")
    if max_length is None:
        return dataset
    if policy == "truncate":
        if getattr(options, "truncation_mode", "keep_start") == "keep_start":  # TRL: no completion token would remain
            dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < max_length, desc="Dropping full prompts")
        return dataset
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in
               zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])]
    over = [i for i, n in enumerate(lengths) if n > max_length]
    if policy == "error" and over:
        raise DataValidationError(over[0], "chosen/rejected", f"prompt + completion of at most max_length="
                                  f"{max_length} tokens (overlong_policy='error')", Verbatim(f"{lengths[over[0]]} tokens"))
    return dataset.select([i for i in range(len(dataset)) if lengths[i] <= max_length]) if over else dataset
