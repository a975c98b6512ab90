"""Dataset files read as written, before `datasets` loads them: file-level errors with their line, raw row types.

`datasets` turns an empty file into a `StopIteration`, a truncated JSON line into a long chained traceback, and may
coerce a column of mixed types, so that a row check on the loaded `Dataset` names the wrong row or none. Reading the
file here first gives every such problem one message with the file and the line, and lets the format's row checks
(`hf_rlhf.data.validate_*`) run on the values the file really holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from .validation import DataValidationError

JSON_EXTENSIONS = ("json", "jsonl")


class DataFileError(ValueError):
    """A dataset file that cannot be read as rows: "data.jsonl, line 3: expected a JSON object, got ..."."""


def _loads(text: str, path: str, line: int) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFileError(f"{path}, line {line}: expected a JSON object, got invalid JSON ({e.msg}, column "
                            f"{e.colno}): {text[:80]!r}") from None
    if not isinstance(row, dict):
        raise DataFileError(f"{path}, line {line}: expected a JSON object (one row), got {type(row).__name__}")
    return row


def _json_lines(text: str, path: str) -> tuple[list[dict], list[int]]:
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append(_loads(line, path, number))
            lines.append(number)
    return rows, lines


def _json_document(text: str, path: str) -> tuple[list[dict], list[int] | None]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines in a .json file (datasets reads those too)
            return _json_lines(text, path)
        raise DataFileError(f"{path}, line {e.lineno}: expected a JSON document, got invalid JSON ({e.msg}, "
                            f"column {e.colno})") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise DataFileError(f"{path}: expected columns of equal length, got lengths "
                                f"{ {k: len(v) for k, v in data.items()} }")
        data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list):
        raise DataFileError(f"{path}: expected a list of row objects or an object of columns, got "
                            f"{type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataValidationError(i, None, "a JSON object (one row)", row, source=path)
    return data, None


def read_json_rows(path: str) -> tuple[list[dict], list[int] | None]:
    """The rows of a .json / .jsonl file as Python values, and the line of each row (None for a JSON document).

    Args:
        path: a .json (a list of objects, an object of columns, or JSON Lines) or .jsonl file.

    Returns:
        (rows, lines).

    Raises:
        DataFileError: the file is empty, not valid JSON (with the line and column), or not rows.
    """
    with open(path, encoding="utf-8") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise DataFileError(f"{path}: expected UTF-8 text, got a byte it cannot decode at offset {e.start}") \
                from None
    if not text.strip():
        raise DataFileError(f"{path}: expected at least one row, got an empty file")
    if path.endswith(".jsonl"):
        rows, lines = _json_lines(text, path)
    else:
        rows, lines = _json_document(text, path)
    if not rows:
        raise DataFileError(f"{path}: expected at least one row, got none")
    return rows, lines


def check_raw_file(path: str, validate: Callable[[list[dict]], None]) -> None:
    """Read `path` as written and run `validate(rows)` on its raw rows; an error names the file and the line.

    Files other than JSON are only checked for emptiness here (CSV and Parquet carry their own column types).

    Args:
        path: the dataset file.
        validate: the format's row check, `rows -> None`, raising `DataValidationError`.
    """
    ext = os.path.splitext(path)[1].lstrip(".")
    if os.path.getsize(path) == 0:
        raise DataFileError(f"{path}: expected at least one row, got an empty file")
    if ext not in JSON_EXTENSIONS:
        return
    rows, lines = read_json_rows(path)
    try:
        validate(rows)
    except DataValidationError as e:
        if e.source is not None:
            raise
        source = f"{path}, line {lines[e.row]}" if lines is not None and e.row is not None else path
        raise DataValidationError(e.row, e.field, e.expected, e.got, source=source) from None

