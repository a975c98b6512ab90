"""Streamed datasets (`datasets.IterableDataset`): the same preparation as in-memory data, row by row.

A stream has no length and cannot be read twice cheaply, so preparation is lazy, as TRL 1.16's:
- the format is detected from a look-ahead at the first row (a stream's columns may be unknown until read);
- every row is validated as it streams, just before it is tokenized, with the same checks as in-memory data, so an
  error names the row (its index in the stream) and the field, when training reaches it;
- the over-long policy is a lazy filter (`error` raises on the row, `drop` / `truncate` skip rows), with no counts.
"""

from __future__ import annotations

import itertools
import logging

from datasets import IterableDataset

from .tokenization import (
    BOUNDARY_COLUMN,
    LENGTH_COLUMNS,
    apply_length_policy,
    check_unknown_tokens,
    log_boundary_rows,
    map_rows,
)
from .validation import DataValidationError, Verbatim, as_dataset, column_values

logger = logging.getLogger("hf_rlhf")


def is_streamed(dataset) -> bool:
    """Whether `dataset` is a `datasets.IterableDataset` (streamed: no length, read lazily)."""
    return isinstance(dataset, IterableDataset)


def first_rows(dataset: IterableDataset, n: int = 1) -> list[dict]:
    """The first `n` rows of a stream (a look-ahead: the stream itself is not consumed).

    Raises:
        DataValidationError: the stream has no row.
    """
    rows = list(itertools.islice(iter(dataset), n))
    if not rows:
        raise DataValidationError(None, None, "at least one row", Verbatim("0 rows: the stream is empty"))
    return rows


def stream_columns(dataset: IterableDataset, first_row: dict) -> list[str]:
    """The stream's columns: its features' names when known, else the first row's keys."""
    return list(dataset.column_names) if dataset.column_names is not None else list(first_row)


def stream_length_policy(dataset: IterableDataset, max_length: int | None, policy: str,
                         field: str) -> IterableDataset:
    """`apply_length_policy` for a stream: a lazy filter on the `_length` / `_trainable` columns, then drop them.

    Args:
        dataset: tokenized rows with `_length` (untruncated length) and `_trainable` (a loss token is left).
        max_length: the longest row allowed; None: no limit.
        policy: `error` raises `DataValidationError` on the first over-long row as it streams; `drop` skips
            over-long rows; `truncate` keeps them (already cut) unless no trainable token is left.
        field: the field named in an `error`.
    """

    def keep(row: dict, index: int) -> bool:
        if max_length is None or row["_length"] <= max_length:
            return True
        if policy == "error":
            raise DataValidationError(index, field, f"at most max_length={max_length} tokens (overlong_policy="
                                      "'error'; use 'truncate' or 'drop' to keep going)",
                                      Verbatim(f"{row['_length']} tokens"))
        return policy == "truncate" and bool(row["_trainable"])

    return dataset.filter(keep, with_indices=True).remove_columns(list(LENGTH_COLUMNS))


def check_streamed_training(args, train_dataset) -> None:
    """A streamed train set needs `max_steps` (it has no length to count epochs by), as TRL; and, as TRL, accelerate
    must not dispatch its batches from the main process (`dispatch_batches=False`).

    Args:
        args: the trainer's `TrainingArguments`.
        train_dataset: the train set, streamed or not.
    """
    if not is_streamed(train_dataset):
        return
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError(f"train_dataset is a streamed IterableDataset, which has no length: set max_steps > 0 "
                         f"(got max_steps={args.max_steps}); num_train_epochs cannot be counted on a stream")
    args.accelerator_config.dispatch_batches = False


def check_streamed_rollouts(args, train_dataset, eval_dataset) -> None:
    """TRL 1.16 GRPO / RLOO's settings for streamed prompt sets: with a streamed train or eval set, accelerate must not
    dispatch batches from the main process (`dispatch_batches=False`, set here; True is refused); a streamed train set
    is read by this process alone (`dataloader_num_workers` set to 0, with a warning: workers would interleave its
    rows and split the prompt groups). A streamed eval set leaves the workers of a map-style train set as they are.

    Args:
        args: the trainer's config (changed in place).
        train_dataset, eval_dataset: as given to the trainer (eval: None, a dataset or a dict of them).
    """
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if not (is_streamed(train_dataset) or any(is_streamed(dataset) for dataset in evals)):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                         "`accelerator_config`. Please set it to `False`.")
    args.accelerator_config.dispatch_batches = False
    if is_streamed(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding "
                       "the provided value (%d).", args.dataloader_num_workers)
        args.dataloader_num_workers = 0


def tokenize_rows(dataset, row_fn, spec, options, field: str, desc: str, first_row: dict | None = None,
                  tokenizer=None, id_columns: tuple[str, ...] = (), owner: str = "DataOptions", texts_fn=None):
    """Map `row_fn(row, index, spec)` over `dataset` (it writes `_length`, `_trainable` and `_boundary`), then count
    unknown tokens and the rows whose tokens merged across the prompt / completion boundary (logged once:
    `log_boundary_rows`), and apply the over-long policy.

    The one tokenization tail of SFT and preference data, in memory or streamed.

    Args:
        dataset: a `Dataset` / list of rows, or an `IterableDataset` (mapped lazily; `first_row` is its look-ahead).
        row_fn, spec: the format's row tokenizer and its spec.
        options: `max_length`, `overlong_policy`, `dataset_num_proc`, `max_unk_share`, `strict`.
        field: the field named in errors and logs.
        desc: the progress bar's text (in memory).
        tokenizer, id_columns: where to count unknown tokens (in memory; none without a tokenizer).
        owner: the config class named in the boundary log (e.g. "SFTConfig").
        texts_fn: `texts_fn(row, spec)`, the plain texts a row encodes (in memory: each batch's are encoded in
            one call, `map_rows`).

    Returns:
        (tokenized, stats): stats is None for a stream.
    """
    if first_row is not None:  # IterableDataset.map takes no num_proc / desc
        tokenized = dataset.map(row_fn, with_indices=True, fn_kwargs={"spec": spec},
                                remove_columns=stream_columns(dataset, first_row))
        tokenized = tokenized.remove_columns([BOUNDARY_COLUMN])  # a stream is not counted ahead
        return stream_length_policy(tokenized, options.max_length, options.overlong_policy, field), None
    data = as_dataset(dataset)
    tokenized = data.map(map_rows, batched=True, with_indices=True, remove_columns=data.column_names,
                         fn_kwargs={"row_fn": row_fn, "spec": spec, "texts_fn": texts_fn},
                         num_proc=options.dataset_num_proc, desc=desc)
    log_boundary_rows(sum(column_values(tokenized, BOUNDARY_COLUMN)), len(tokenized), options.prompt_tokenization,
                      f"{owner}.prompt_tokenization")
    tokenized = tokenized.remove_columns([BOUNDARY_COLUMN])
    if tokenizer is not None:
        check_unknown_tokens(tokenized, id_columns, tokenizer, options.max_unk_share, options.strict, field)
    return apply_length_policy(tokenized, options.max_length, options.overlong_policy, field)
