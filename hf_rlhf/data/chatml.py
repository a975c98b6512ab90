"""Conversational rows as the chat template reads them: ShareGPT rows converted to ChatML, and the per-row template
arguments (`tools`, `chat_template_kwargs`) that TRL passes to `apply_chat_template`."""

from __future__ import annotations

import json

from .streaming import first_rows, is_streamed
from .validation import column_names

MESSAGE_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "conversations")


def _is_sharegpt(row: dict) -> bool:
    if "conversations" in row:
        return True
    for key in MESSAGE_COLUMNS:
        messages = row.get(key)
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            return "from" in messages[0] or "value" in messages[0]
    return False


def to_chatml(dataset):
    """ShareGPT rows (`conversations`, messages with `from` / `value`) as ChatML (`messages`, `role` / `content`),
    converted by `trl.maybe_convert_to_chatml` as TRL's preparation does; any other dataset (or None, or a dict of
    datasets) comes back as it is. The format is read from the first row; a stream is converted lazily.

    >>> from datasets import Dataset
    >>> to_chatml(Dataset.from_list([{"conversations": [{"from": "user", "value": "Hi"}]}]))[0]
    {'messages': [{'role': 'user', 'content': 'Hi'}]}
    """
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {key: to_chatml(value) for key, value in dataset.items()}
    if not hasattr(dataset, "map"):
        return dataset  # a list of rows: left to the row checks
    rows = first_rows(dataset) if is_streamed(dataset) else (dataset.select(range(1)) if len(dataset) else [])
    if not rows or not _is_sharegpt(dict(rows[0])):
        return dataset
    from trl.data_utils import maybe_convert_to_chatml

    remove = ["conversations"] if "conversations" in (column_names(dataset) if not is_streamed(dataset)
                                                        else list(rows[0])) else None
    return dataset.map(maybe_convert_to_chatml, remove_columns=remove)


def chat_template_row_kwargs(row: dict) -> dict:
    """Keyword arguments of `apply_chat_template` that a row carries, as TRL reads them: `tools` (a list, or its JSON
    text) and `chat_template_kwargs` (a dict; keys that are None — absent in this row of a column whose other rows
    have them — are left out).

    >>> chat_template_row_kwargs({"tools": '[{"type": "function"}]', "chat_template_kwargs": {"x": 1, "y": None}})
    {'tools': [{'type': 'function'}], 'x': 1}
    """
    kwargs = {}
    tools = row.get("tools")
    if tools is not None:
        kwargs["tools"] = json.loads(tools) if isinstance(tools, str) else tools
    extra = row.get("chat_template_kwargs") or {}
    kwargs.update({key: value for key, value in extra.items() if value is not None})
    return kwargs
