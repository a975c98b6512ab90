"""Dataset formats, row validation and tokenization.

Formats (TRL's names), detected from the columns:

    text                              {"text": "..."}  (the column is `SFTConfig.dataset_text_field`)
    prompt_completion                 {"prompt": "...", "completion": "..."}
    conversational                    {"messages": [{"role": "user", "content": "..."}, ...]}
    conversational_prompt_completion  {"prompt": [messages], "completion": [messages]}

Every row is validated before anything is tokenized, so a bad row fails in seconds with its index and
field instead of hours into training. The row helpers (`iter_rows`, `check_text`, `check_messages`,
`validate_rows`, `apply_length_policy`) are shared by every trainer's formats; `prepare_sft_dataset`
is the SFT entry point.

Tokenized columns: `input_ids`; `completion_mask` (1 on completion tokens, prompt/completion formats);
`assistant_masks` (1 on assistant tokens, when `assistant_only_loss`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from datasets import Dataset

logger = logging.getLogger("hf_rlhf")

ROLES = ("system", "user", "assistant", "tool")
OVERLONG_POLICIES = ("truncate", "drop", "error")
CONVERSATIONAL_FORMATS = ("conversational", "conversational_prompt_completion")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ---------------------------------------------------------------------------------------------------
# Errors


class _Raw(str):
    """A `got` shown as written instead of repr'd (e.g. "300 tokens")."""

    def __repr__(self):
        return str(self)


class _NotGiven:
    def __reduce__(self):  # pickles as the module singleton, so errors survive `map(num_proc=...)`
        return "_NOT_GIVEN"


_NOT_GIVEN = _NotGiven()
_ABSENT = object()  # a key missing from a row (distinct from a None value)
MISSING = _Raw("nothing (the field is missing)")


def _short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if value is not None and not isinstance(value, str):
        text += f" ({type(value).__name__})"
    return text


class DataValidationError(ValueError):
    """A dataset row that does not fit its format.

    str: "row 3, field 'completion': expected a non-empty string, got ''".
    """

    def __init__(self, row: int | None, field: str | None, expected: str, got=_NOT_GIVEN):
        self.row, self.field, self.expected, self.got = row, field, expected, got
        where = ", ".join(p for p in (row is not None and f"row {row}", field and f"field {field!r}") if p)
        message = f"expected {expected}"
        if got is not _NOT_GIVEN:
            message += f", got {got!r}" if isinstance(got, _Raw) else f", got {_short_repr(got)}"
        super().__init__(f"{where}: {message}" if where else message)

    def __reduce__(self):
        return (type(self), (self.row, self.field, self.expected, self.got))


# ---------------------------------------------------------------------------------------------------
# Row access and checks shared by all formats


def as_dataset(data) -> Dataset:
    """A `datasets.Dataset` from a Dataset (returned as is) or a list of dicts."""
    return data if isinstance(data, Dataset) else Dataset.from_list(list(data))


def column_names(data) -> list[str]:
    """Columns of a Dataset, or the union of keys (first-seen order) of a list of dicts."""
    if isinstance(data, Dataset):
        return list(data.column_names)
    names = {}
    for row in data:
        if isinstance(row, Mapping):
            names.update(dict.fromkeys(row))
    return list(names)


def check_not_empty(data) -> None:
    if len(data) == 0:
        raise DataValidationError(None, None, "at least one row", _Raw("0 rows: the dataset is empty"))


def iter_rows(data, columns: list[str]):
    """Yield `(index, {column: value})`; a key missing from a dict row has the value `_ABSENT`."""
    if isinstance(data, Dataset):
        present = [c for c in columns if c in data.column_names]
        if not present:
            yield from ((i, dict.fromkeys(columns, _ABSENT)) for i in range(len(data)))
            return
        index = 0
        for batch in data.select_columns(present).iter(batch_size=1000):
            for j in range(len(batch[present[0]])):
                yield index, {c: batch[c][j] if c in batch else _ABSENT for c in columns}
                index += 1
        return
    for index, row in enumerate(data):
        if not isinstance(row, Mapping):
            raise DataValidationError(index, None, "a dict", row)
        yield index, {c: row.get(c, _ABSENT) for c in columns}


def is_conversational_column(data, column: str) -> bool:
    """Whether the first non-missing value of `column` is a list (of messages)."""
    for _, row in iter_rows(data, [column]):
        value = row[column]
        if value is not None and value is not _ABSENT:
            return isinstance(value, (list, tuple))
    return False


def check_text(row: int, field: str, value) -> None:
    """A non-empty string."""
    expected = "a non-empty string"
    if value is _ABSENT:
        raise DataValidationError(row, field, expected, MISSING)
    if not isinstance(value, str) or not value:
        raise DataValidationError(row, field, expected, value)


def check_messages(row: int, field: str, value, require_assistant: bool = False) -> None:
    """A non-empty list of {"role": one of ROLES, "content": str} dicts.

    An assistant message that carries `tool_calls` may have no content.
    """
    expected = "a non-empty list of messages ({'role': ..., 'content': ...})"
    if value is _ABSENT:
        raise DataValidationError(row, field, expected, MISSING)
    if not isinstance(value, (list, tuple)) or not value:
        raise DataValidationError(row, field, expected, value)
    for k, message in enumerate(value):
        where = f"{field}[{k}]"
        if not isinstance(message, Mapping):
            raise DataValidationError(row, where, "a message dict with 'role' and 'content'", message)
        role = message.get("role", _ABSENT)
        if role not in ROLES:
            raise DataValidationError(row, f"{where}.role", "one of " + ", ".join(map(repr, ROLES)),
                                      MISSING if role is _ABSENT else role)
        content = message.get("content", _ABSENT)
        if not isinstance(content, str) and not (role == "assistant" and message.get("tool_calls")):
            raise DataValidationError(row, f"{where}.content", "a string", MISSING if content is _ABSENT else content)
    if require_assistant and not any(m["role"] == "assistant" for m in value):
        roles = [m["role"] for m in value]
        raise DataValidationError(row, field, "at least one 'assistant' message", _Raw(f"roles {roles}"))


def validate_rows(data, checks: dict) -> None:
    """Run `checks[field](row_index, field, value)` on every row; raise on the first bad one."""
    check_not_empty(data)
    for index, row in iter_rows(data, list(checks)):
        for field, check in checks.items():
            check(index, field, row[field])


# ---------------------------------------------------------------------------------------------------
# SFT formats


def detect_format(dataset, text_field: str = "text") -> str:
    """"text", "prompt_completion", "conversational" or "conversational_prompt_completion".

    Checked in that order of precedence: a `messages` column, then `prompt` + `completion` (message
    lists or strings), then `text_field`.
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
        _Raw(f"columns {columns}"),
    )


def validate_sft_dataset(dataset, fmt: str, text_field: str = "text", *, require_assistant: bool = False) -> None:
    """Check every row of `dataset` against `fmt`; raise `DataValidationError` on the first bad one.

    Args:
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
# Tokenizer set-up


def _template_from_dir(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name in ("tokenizer_config.json", "chat_template.json"):
        if (path / name).is_file():
            template = json.loads((path / name).read_text()).get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t["name"]: t["template"] for t in template}
                template = named.get("default", next(iter(named.values()), None))
            if template:
                return template
    return None


def resolve_chat_template(tokenizer, chat_template_path: str | None) -> None:
    """Set `tokenizer.chat_template` from a Jinja file or a local tokenizer directory (None: keep it)."""
    if chat_template_path is None:
        return
    path = Path(chat_template_path)
    if path.is_file():
        template = path.read_text()
    elif path.is_dir():
        template = _template_from_dir(path)
        if template is None:
            raise FileNotFoundError(
                f"chat_template_path={chat_template_path!r}: the directory has no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json")
    else:
        raise FileNotFoundError(
            f"chat_template_path={chat_template_path!r} is neither a Jinja file nor a tokenizer directory")
    tokenizer.chat_template = template


def _token_id(tokenizer, token: str, option: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"SFTConfig.{option}={token!r} is not in the tokenizer's vocabulary")
    return token_id


def ensure_pad_token(tokenizer, pad_token: str | None) -> None:
    """Set `tokenizer.pad_token` from `SFTConfig.pad_token`; require one if the tokenizer has none.

    The eos token is never used as a silent fallback: a collator that masks labels by pad id would then
    also mask every real eos, and the model would never learn to stop.
    """
    if pad_token is not None:
        _token_id(tokenizer, pad_token, "pad_token")
        tokenizer.pad_token = pad_token
        return
    if tokenizer.pad_token is None:
        raise ValueError(
            "tokenizer has no pad token: set SFTConfig.pad_token to a token of its vocabulary that is not the "
            "eos token (e.g. an unused reserved token), or add one with "
            "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and model.resize_token_embeddings(len(tokenizer)). "
            "The eos token is not used silently: eos positions would be masked out of the labels.")


def _special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default: usually `[bos]` or `[]`."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start]
    return []


def _chat_template(tokenizer) -> str | None:
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # no template set
        return None


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


def _with_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids if ids and ids[-1] == eos_id else ids + [eos_id]


def _tokenize_prompt_completion(tokenizer, prompt: str, completion: str, prefix, eos_id) -> dict:
    """Joint tokenization of prompt+completion when the prompt's ids are a prefix of it; otherwise
    (a merge across the boundary, e.g. "a" + "b" -> "ab") prompt and completion tokenized apart and
    concatenated, which is also what the model sees when it generates after the prompt."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
    if full_ids[: len(prompt_ids)] != prompt_ids:
        full_ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
    input_ids = _with_eos(prefix + full_ids, eos_id)
    n_prompt = len(prefix) + len(prompt_ids)
    return {"input_ids": input_ids, "completion_mask": [0] * n_prompt + [1] * (len(input_ids) - n_prompt)}


def _tokenize_chat(tokenizer, messages, assistant_only_loss: bool, index: int, field: str) -> dict:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=assistant_only_loss)
    row = {"input_ids": list(out["input_ids"])}
    if assistant_only_loss:
        row["assistant_masks"] = list(out["assistant_masks"])
        if not any(row["assistant_masks"]) and any(m["role"] == "assistant" for m in messages):
            raise DataValidationError(
                index, field, "assistant tokens marked by the chat template's {% generation %} block "
                "(assistant_only_loss=True)", _Raw("an all-zero assistant mask"))
    return row


def _tokenize_sft_row(row: dict, index: int, spec: _SFTTokenizeSpec) -> dict:
    tok = spec.tokenizer
    if spec.fmt == "text":
        ids = tok(row[spec.text_field], add_special_tokens=False)["input_ids"]
        out = {"input_ids": _with_eos(spec.prefix + ids, spec.eos_id)}
    elif spec.fmt == "prompt_completion":
        out = _tokenize_prompt_completion(tok, row["prompt"], row["completion"], spec.prefix, spec.eos_id)
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
                "prefix of prompt+completion", _Raw("a different start; the template changes past turns when a "
                                                    "completion follows"))
        n_prompt = len(prompt_ids)
        out["completion_mask"] = [0] * n_prompt + [1] * (len(out["input_ids"]) - n_prompt)

    # Record the untruncated length for the overlong policy; truncation keeps the start (TRL's keep_start).
    out["_length"] = len(out["input_ids"])
    if spec.truncate and spec.max_length is not None and out["_length"] > spec.max_length:
        out = {k: (v[: spec.max_length] if isinstance(v, list) else v) for k, v in out.items()}
    out["_trainable"] = all(any(out[m]) for m in spec.loss_masks if m in out)
    return out


def apply_length_policy(dataset: Dataset, max_length: int | None, policy: str, field: str) -> tuple[Dataset, dict]:
    """Apply `overlong_policy` using the `_length` / `_trainable` columns the tokenizer wrote, then drop them.

    Rows longer than `max_length`: `error` raises on the first; `drop` removes them; `truncate` keeps
    them (already cut) unless no trainable token is left, in which case they are dropped too.

    Returns:
        (dataset, {"n_rows": rows in, "n_truncated": kept truncated, "n_dropped": removed}).
    """
    n_rows = len(dataset)
    stats = {"n_rows": n_rows, "n_truncated": 0, "n_dropped": 0}
    overlong = [] if max_length is None else [i for i, n in enumerate(dataset["_length"]) if n > max_length]
    if overlong and policy == "error":
        i = overlong[0]
        raise DataValidationError(
            i, field, f"at most max_length={max_length} tokens (overlong_policy='error'; use 'truncate' or 'drop' "
            f"to keep going; {len(overlong)} of {n_rows} rows are longer)", _Raw(f"{dataset[i]['_length']} tokens"))
    drop = set(overlong)
    if policy == "truncate" and overlong:
        trainable = dataset["_trainable"]
        drop = {i for i in overlong if not trainable[i]}
        stats["n_truncated"] = len(overlong) - len(drop)
        logger.warning("%d of %d examples longer than max_length=%d were truncated",
                       stats["n_truncated"], n_rows, max_length)
        if drop:
            logger.warning("%d of %d examples longer than max_length=%d were dropped: truncation left no "
                           "completion token to train on", len(drop), n_rows, max_length)
    elif drop:
        logger.warning("%d of %d examples longer than max_length=%d were dropped", len(drop), n_rows, max_length)
    stats["n_dropped"] = len(drop)
    if drop:
        if len(drop) == n_rows:
            raise ValueError(f"all {n_rows} examples were dropped as longer than max_length={max_length}; "
                             "raise max_length or use overlong_policy='truncate'")
        dataset = dataset.select([i for i in range(n_rows) if i not in drop])
    return dataset.remove_columns(["_length", "_trainable"]), stats


def _check_chat_template(tokenizer, fmt: str, assistant_only_loss: bool) -> None:
    template = _chat_template(tokenizer)
    if template is None:
        column = "messages" if fmt == "conversational" else "prompt/completion messages"
        raise ValueError(f"dataset is conversational ({column!r}) but the tokenizer has no chat template; "
                         "set SFTConfig.chat_template_path to a Jinja file or a tokenizer directory")
    if assistant_only_loss and not _GENERATION_TAG.search(template):
        raise ValueError(
            "assistant_only_loss=True needs a chat template that wraps assistant content in "
            "{% generation %} ... {% endgeneration %}, and the tokenizer's template has no such markers "
            "(every assistant mask would be all zeros). Add them and pass the template with "
            "SFTConfig.chat_template_path, or set assistant_only_loss=False.")


def prepare_sft_dataset(dataset, tokenizer, args, return_stats: bool = False):
    """Detect, validate and tokenize an SFT dataset (a `Dataset` or a list of dicts; left unchanged).

    Args:
        args: an `SFTConfig`, or any object with its data attributes.
        return_stats: also return {"n_rows", "n_truncated", "n_dropped"}.

    Returns:
        A `Dataset` with `input_ids` and, per format, `completion_mask` / `assistant_masks`
        (each a list with one entry per token), or `(dataset, stats)`.
    """
    text_field = getattr(args, "dataset_text_field", "text")
    assistant_only_loss = bool(getattr(args, "assistant_only_loss", False))
    policy = getattr(args, "overlong_policy", "truncate")
    max_length = getattr(args, "max_length", None)
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong_policy={policy!r}; expected one of {OVERLONG_POLICIES}")

    # step 1. format and every row, before any tokenization
    fmt = detect_format(dataset, text_field)
    if assistant_only_loss and fmt not in CONVERSATIONAL_FORMATS:
        raise ValueError(f"assistant_only_loss=True needs conversational data; the dataset format is {fmt!r}")
    validate_sft_dataset(dataset, fmt, text_field, require_assistant=assistant_only_loss)

    # step 2. tokenizer: chat template, eos, default leading special tokens
    resolve_chat_template(tokenizer, getattr(args, "chat_template_path", None))
    eos_id = prefix = None
    if fmt in CONVERSATIONAL_FORMATS:
        _check_chat_template(tokenizer, fmt, assistant_only_loss)  # the template writes its own bos / end of turn
    else:
        eos_token = getattr(args, "eos_token", None) or tokenizer.eos_token
        if eos_token is None:
            raise ValueError("tokenizer has no eos token: set SFTConfig.eos_token")
        eos_id = _token_id(tokenizer, eos_token, "eos_token")
        prefix = _special_prefix(tokenizer)

    # step 3. tokenize (and truncate), then apply the overlong policy
    completion_only = getattr(args, "completion_only_loss", None) is not False
    loss_masks = (("completion_mask",) if completion_only else ()) + (("assistant_masks",) if assistant_only_loss else ())
    spec = _SFTTokenizeSpec(fmt, tokenizer, text_field, prefix, eos_id, assistant_only_loss, max_length,
                            policy == "truncate", loss_masks)
    data = as_dataset(dataset)
    tokenized = data.map(
        _tokenize_sft_row, with_indices=True, fn_kwargs={"spec": spec}, remove_columns=data.column_names,
        num_proc=getattr(args, "dataset_num_proc", None), desc="Tokenizing SFT dataset")
    field = {"text": text_field, "prompt_completion": "prompt+completion",
             "conversational": "messages", "conversational_prompt_completion": "prompt+completion"}[fmt]
    tokenized, stats = apply_length_policy(tokenized, max_length, policy, field)
    return (tokenized, stats) if return_stats else tokenized
