"""SFT datasets: format detection, validation and tokenization (`prepare_sft_dataset`).

Formats (TRL's names), detected from the columns:

    text                              {"text": "..."}  (the column is `SFTConfig.dataset_text_field`)
    prompt_completion                 {"prompt": "...", "completion": "..."}
    conversational                    {"messages": [{"role": "user", "content": "..."}, ...]}
    conversational_prompt_completion  {"prompt": [messages], "completion": [messages]}

ShareGPT rows (`conversations` of `from` / `value` messages) are converted first (`data.chatml.to_chatml`, by the
trainers). Conversational rows may carry `tools` and `chat_template_kwargs` for their chat template, as in TRL.

Tokenized columns: `input_ids`; `completion_mask` (1 on completion tokens, prompt/completion formats);
`assistant_masks` (1 on assistant tokens, when `assistant_only_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from .chatml import chat_template_row_kwargs
from .options import DataOptions, SFTDataOptions
from .streaming import first_rows, is_streamed, stream_length_policy, tokenize_rows
from .tokenization import (
    BOUNDARY_COLUMN,
    apply_length_policy,
    check_chat_template,
    check_overlong_policy,
    common_prefix_length,
    eos_token_id,
    map_rows,
    prompt_completion_texts,
    resolve_chat_template,
    special_prefix,
    tokenize_prompt_completion,
    with_eos,
)
from .validation import (
    ABSENT,
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
        "(SFTConfig.dataset_text_field); or pass formatting_func=... to SFTTrainer to build each row's text from "
        "its columns",
        Verbatim(f"columns {columns}"),
    )


def sft_row_checks(fmt: str, text_field: str = "text", *, require_assistant: bool = False) -> dict:
    """The `{field: check(row, field, value)}` checks of one row of `fmt` (see `validate_sft_dataset`)."""
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
    return checks[fmt]


def validate_sft_dataset(dataset, fmt: str, text_field: str = "text", *, require_assistant: bool = False) -> None:
    """Check every row of `dataset` against `fmt`; raise `DataValidationError` on the first bad one.

    Args:
        dataset: a `Dataset` or a list of dict rows.
        fmt: its format (`detect_format`).
        text_field: the column of plain-text datasets.
        require_assistant: every `messages` row needs an assistant message (set for assistant_only_loss).
    """
    validate_rows(dataset, sft_row_checks(fmt, text_field, require_assistant=require_assistant))


def _format_row(row: dict, index: int, formatting_func, text_field: str) -> dict:
    text = formatting_func(row)
    if not isinstance(text, str):
        raise DataValidationError(
            index, "formatting_func(row)", "a str: TRL 1.16 calls formatting_func on one row at a time (not on "
            "batches) and takes the text it returns", text)
    return {text_field: text}


def apply_formatting_func(dataset, formatting_func, text_field: str = "text"):
    """TRL's `formatting_func`: each row becomes `{text_field: formatting_func(row)}`, before tokenization.

    As in TRL 1.16 it is called per row (not batched) and ignored, with a warning, for tokenized data (`input_ids`).
    Where TRL would tokenize `messages` or `prompt`/`completion` columns instead of the formatted text (or refuse
    them with completion-only loss), this is an error: the formatted text would be lost.

    Args:
        dataset: a `Dataset`, an `IterableDataset` or a list of dict rows.
        formatting_func: `row (dict) -> str`.
        text_field: the column the text is written to (`SFTConfig.dataset_text_field`).

    Returns:
        The dataset with the one column `text_field` (a `Dataset` for a list of rows).
    """
    import logging

    columns = column_names(dataset) if isinstance(dataset, list) else dataset.column_names
    if columns is None:  # a streamed dataset whose features are unknown: its first row
        columns = list(next(iter(dataset)))
    if "input_ids" in columns:
        logging.getLogger("hf_rlhf").warning("formatting_func is ignored: the dataset is tokenized already "
                                             "(it has input_ids)")
        return dataset
    if "messages" in columns or {"prompt", "completion"} <= set(columns):
        kept = "'messages'" if "messages" in columns else "'prompt' and 'completion'"
        raise ValueError(f"formatting_func builds plain text, but the dataset has {kept} columns, which are "
                         "tokenized as they are (TRL ignores the formatted text, or refuses it with completion-only "
                         "loss). Remove those columns, or drop formatting_func.")
    data = as_dataset(dataset) if isinstance(dataset, list) else dataset
    return data.map(_format_row, with_indices=True, remove_columns=columns,
                    fn_kwargs={"formatting_func": formatting_func, "text_field": text_field})


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
    checks: dict | None = None   # streamed rows: validated here, just before tokenization
    chat_template: str | None = None  # TRL's training template for assistant_only_loss, else the tokenizer's
    prompt_tokenization: str = "apart"  # or "joint" (TRL's): `tokenize_prompt_completion`


def _tokenize_chat(tokenizer, messages, assistant_only_loss: bool, index: int, field: str,
                   template_kwargs: dict | None = None) -> dict:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=assistant_only_loss,
        **(template_kwargs or {}))
    row = {"input_ids": list(out["input_ids"])}
    if assistant_only_loss:
        row["assistant_masks"] = list(out["assistant_masks"])
        if not any(row["assistant_masks"]) and any(m["role"] == "assistant" for m in messages):
            raise DataValidationError(
                index, field, "assistant tokens marked by the chat template's {% generation %} block "
                "(assistant_only_loss=True)", Verbatim("an all-zero assistant mask"))
    return row


def _template_kwargs(row: dict, spec: _SFTTokenizeSpec) -> dict:
    kwargs = chat_template_row_kwargs(row)
    if spec.chat_template is not None:
        kwargs["chat_template"] = spec.chat_template
    return kwargs


def _tokenize_sft_row(row: dict, index: int, spec: _SFTTokenizeSpec) -> dict:
    tok = spec.tokenizer
    for field, check in (spec.checks or {}).items():
        check(index, field, row.get(field, ABSENT))
    if spec.fmt == "text":
        ids = tok(row[spec.text_field], add_special_tokens=False)["input_ids"]
        out = {"input_ids": with_eos(spec.prefix + ids, spec.eos_id)}
    elif spec.fmt == "prompt_completion":
        out = tokenize_prompt_completion(tok, row["prompt"], row["completion"], spec.prefix, spec.eos_id,
                                         spec.prompt_tokenization)
    elif spec.fmt == "conversational":
        out = _tokenize_chat(tok, row["messages"], spec.assistant_only_loss, index, "messages",
                             _template_kwargs(row, spec))
    else:  # conversational_prompt_completion
        template_kwargs = _template_kwargs(row, spec)
        prompt_ids = tok.apply_chat_template(
            list(row["prompt"]), tokenize=True, return_dict=True, add_generation_prompt=True,
            **template_kwargs)["input_ids"]
        out = _tokenize_chat(tok, list(row["prompt"]) + list(row["completion"]), spec.assistant_only_loss,
                             index, "completion", template_kwargs)
        n_prompt = len(prompt_ids)
        out[BOUNDARY_COLUMN] = out["input_ids"][:n_prompt] != list(prompt_ids)
        if out[BOUNDARY_COLUMN] and spec.prompt_tokenization == "joint":  # TRL's: from where they diverge
            n_prompt = common_prefix_length(list(prompt_ids), out["input_ids"])
        elif out[BOUNDARY_COLUMN]:
            raise DataValidationError(
                index, "prompt", "the chat template to render the prompt (with add_generation_prompt=True) as a "
                "prefix of prompt+completion (or prompt_tokenization='joint': TRL's, the completion starting where "
                "they diverge)",
                Verbatim("a different start; the template changes past turns when a completion follows"))
        out["completion_mask"] = [0] * n_prompt + [1] * (len(out["input_ids"]) - n_prompt)

    out.setdefault(BOUNDARY_COLUMN, False)
    # Record the untruncated length for the overlong policy; truncation keeps the start (TRL's keep_start).
    out["_length"] = len(out["input_ids"])
    if spec.truncate and spec.max_length is not None and out["_length"] > spec.max_length:
        out = {k: (v[: spec.max_length] if isinstance(v, list) else v) for k, v in out.items()}
    out["_trainable"] = all(any(out[m]) for m in spec.loss_masks if m in out)
    return out


def _sft_texts(row: dict, spec: _SFTTokenizeSpec) -> list[str]:
    """The plain texts `_tokenize_sft_row` encodes (encoded ahead, a batch at a time, by `tokenize_rows`)."""
    if spec.fmt == "text":
        text = row.get(spec.text_field)
        return [text] if isinstance(text, str) else []
    if spec.fmt == "prompt_completion":
        return prompt_completion_texts(row.get("prompt"), row.get("completion"))
    return []  # chat templates render and encode in one call


def check_sft_rows(dataset, options: DataOptions) -> str:
    """Detect the format of an in-memory SFT dataset and check every row (no tokenizer needed); its format.

    What `prepare_sft_dataset` does first; a trainer calls it before it loads any model, then prepares with
    `rows_checked=True`.

    Raises:
        DataValidationError: naming the row, the field and what was expected.
    """
    opts = SFTDataOptions.from_options(options)
    fmt = detect_format(dataset, opts.dataset_text_field)
    if opts.assistant_only_loss and fmt not in CONVERSATIONAL_FORMATS:
        raise ValueError(f"assistant_only_loss=True needs conversational data; the dataset format is {fmt!r}")
    validate_rows(dataset, sft_row_checks(fmt, opts.dataset_text_field, require_assistant=opts.assistant_only_loss))
    return fmt


def prepare_sft_dataset(dataset, tokenizer, options: DataOptions, return_stats: bool = False,
                        rows_checked: bool = False):
    """Detect, validate and tokenize an SFT dataset (a `Dataset`, a list of dicts or a streamed `IterableDataset`;
    left unchanged).

    A streamed dataset is prepared lazily (`hf_rlhf.data.streaming`): its format from its first row, each row
    validated as it streams, the over-long policy a lazy filter; its stats are None.

    Args:
        dataset: rows in one of the formats of this module.
        tokenizer: the tokenizer; `options.chat_template_path` replaces its chat template.
        options: an `SFTConfig`, an `SFTDataOptions`, or a plain `DataOptions` (text column "text", completion-only
            loss on prompt/completion data, no assistant-only loss).
        return_stats: also return {"n_rows", "n_truncated", "n_dropped"}.
        rows_checked: the rows already passed `check_sft_rows` with these options (not checked again).

    Returns:
        A `Dataset` with `input_ids` and, per format, `completion_mask` / `assistant_masks`
        (each a list with one entry per token), or `(dataset, stats)`.
    """
    opts = SFTDataOptions.from_options(options)
    owner = type(options).__name__  # errors name the class the user passed
    check_overlong_policy(opts.overlong_policy)

    # step 1. format and every row, before any tokenization (a stream: its first row, then each row as it streams)
    streamed = is_streamed(dataset)
    head = first_rows(dataset) if streamed else dataset
    fmt = detect_format(head, opts.dataset_text_field)
    if opts.assistant_only_loss and fmt not in CONVERSATIONAL_FORMATS:
        raise ValueError(f"assistant_only_loss=True needs conversational data; the dataset format is {fmt!r}")
    checks = sft_row_checks(fmt, opts.dataset_text_field, require_assistant=opts.assistant_only_loss)
    if not streamed and not rows_checked:
        validate_rows(dataset, checks)

    # step 2. tokenizer: chat template, eos, default leading special tokens
    resolve_chat_template(tokenizer, opts.chat_template_path)
    eos_id = prefix = chat_template = None
    if fmt in CONVERSATIONAL_FORMATS:
        # the template writes its own bos / end of turn
        chat_template = check_chat_template(tokenizer, fmt, opts.assistant_only_loss, f"{owner}.chat_template_path")
    else:
        eos_id = eos_token_id(tokenizer, opts.eos_token, f"{owner}.eos_token")
        prefix = special_prefix(tokenizer)

    # step 3. tokenize (and truncate), then apply the overlong policy
    loss_masks = (("completion_mask",) if opts.completion_only_loss is not False else ()) + (
        ("assistant_masks",) if opts.assistant_only_loss else ())
    spec = _SFTTokenizeSpec(fmt, tokenizer, opts.dataset_text_field, prefix, eos_id, opts.assistant_only_loss,
                            opts.max_length, opts.overlong_policy == "truncate", loss_masks,
                            checks if streamed else None, chat_template, opts.prompt_tokenization)
    field = {"text": opts.dataset_text_field, "prompt_completion": "prompt+completion",
             "conversational": "messages", "conversational_prompt_completion": "prompt+completion"}[fmt]
    tokenized, stats = tokenize_rows(dataset, _tokenize_sft_row, spec, opts, field, "Tokenizing SFT dataset",
                                     head[0] if streamed else None, tokenizer, ("input_ids",), owner, _sft_texts)
    return (tokenized, stats) if return_stats else tokenized


# ---------------------------------------------------------------------------------------------------
# Labels (TRL 1.16's preparation step)

TOKEN_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids", "completion_mask", "assistant_masks")


def _labels_row(row: dict, mask_columns: tuple[str, ...], max_length: int | None, truncate: bool) -> dict:
    if "labels" in row:
        out = {"labels": list(row["labels"])}
    else:
        masks = [row[column] for column in mask_columns]
        out = {"labels": [t if all(bits) else -100 for t, *bits in zip(row["input_ids"], *masks)]}
    if max_length is not None:  # pre-tokenized rows: the over-long policy, as for the rows tokenized here
        row = {**row, **out}
        out["_length"] = len(row["input_ids"])
        if truncate and out["_length"] > max_length:
            out.update({k: list(row[k])[:max_length] for k in TOKEN_COLUMNS
                        if k not in mask_columns and row.get(k) is not None})
        out["_trainable"] = any(label != -100 for label in out["labels"])
    return out


def build_labels(dataset, completion_only_loss: bool | None = None, max_length: int | None = None,
                 overlong_policy: str = "truncate", num_proc: int | None = None):
    """A `labels` column, as TRL 1.16 builds it when it prepares a dataset: `input_ids` with -100 on the tokens not
    trained on, read from `assistant_masks` (always) and `completion_mask` (unless `completion_only_loss=False`);
    the masks used are removed. A dataset with `labels` already keeps them.

    With `max_length` (pre-tokenized rows, which `prepare_sft_dataset` has not cut), the over-long policy is applied
    as to tokenized rows: `truncate` keeps the start of every per-token column and drops a row left without a
    trained label; `drop` and `error` as their names say.

    Args:
        dataset: tokenized rows (`input_ids`, optional masks), a `Dataset` or a streamed `IterableDataset`.
        completion_only_loss: False: `completion_mask` is not used (nor removed).
        max_length, overlong_policy: see above; None: no length check.
        num_proc: `Dataset.map` processes (in memory).

    Returns:
        The dataset with `labels` (lists of ints, one per token).

    >>> from datasets import Dataset
    >>> build_labels(Dataset.from_list([{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}]))[0]
    {'input_ids': [5, 6, 7], 'labels': [-100, 6, 7]}
    """
    streamed = is_streamed(dataset)
    columns = list(first_rows(dataset)[0]) if streamed and dataset.column_names is None else dataset.column_names
    mask_columns = () if "labels" in columns else tuple(
        c for c in ("completion_mask", "assistant_masks")
        if c in columns and (c == "assistant_masks" or completion_only_loss is not False))
    if not mask_columns and "labels" in columns and max_length is None:
        return dataset
    fn_kwargs = {"mask_columns": mask_columns, "max_length": max_length, "truncate": overlong_policy == "truncate"}
    if streamed:
        labeled = dataset.map(_labels_row, fn_kwargs=fn_kwargs, remove_columns=list(mask_columns))
        return labeled if max_length is None else stream_length_policy(labeled, max_length, overlong_policy,
                                                                       "input_ids")
    labeled = dataset.map(map_rows, batched=True, with_indices=True, remove_columns=list(mask_columns),
                          fn_kwargs={"row_fn": _labels_row, "fn_kwargs": fn_kwargs}, num_proc=num_proc,
                          desc="Building labels")
    return labeled if max_length is None else apply_length_policy(labeled, max_length, overlong_policy,
                                                                  "input_ids")[0]
