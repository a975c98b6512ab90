"""The recipes' data: a dataset read from the hub, a folder or a file and checked before any model loads; PPO's
prompts (`PromptData`), tokenized first; a reward function named `module:function`."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import RecipeOptionError


def load_text_dataset(script_args, validate: Callable | None = None):
    """(train, test-or-None) from a hub id, a dataset directory or a json/jsonl/csv/parquet file.

    Args:
        script_args: `dataset_name`, `dataset_config`, `dataset_train_split`, `dataset_test_split`.
        validate: the format's row check, `rows -> None` (a list of dicts or a `Dataset`). A local file is read as
            written first (`hf_rlhf.data.check_raw_file`): an empty or unreadable file is an error naming the line,
            and `validate` sees the file's own values, before `datasets` coerces a column.

    Raises:
        DataFileError, DataValidationError: a bad file or row (file, line, row, field).
    """
    import datasets

    from ..data import check_raw_file

    name = script_args.dataset_name
    if getattr(script_args, "dataset_streaming", False):
        raise NotImplementedError("dataset_streaming: the recipes load the whole dataset; leave it false")
    ext = os.path.splitext(name)[1].lstrip(".")
    if os.path.isfile(name) and ext in ("json", "jsonl", "csv", "parquet"):
        check_raw_file(name, validate or (lambda rows: None))
        data = datasets.load_dataset("json" if ext == "jsonl" else ext, data_files=name)
    elif os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_dict.json")):
        data = datasets.load_from_disk(name)
    else:
        data = datasets.load_dataset(name, script_args.dataset_config)
    if script_args.dataset_train_split not in data:
        raise ValueError(f"dataset {name!r} has no split {script_args.dataset_train_split!r}; "
                         f"splits: {sorted(data)}")
    test_split = script_args.dataset_test_split
    return data[script_args.dataset_train_split], (data[test_split] if test_split in data else None)


@dataclass
class PromptData:
    """What a PPO run trains and evaluates on.

    Args:
        train: the training prompts (a `datasets.Dataset` with "prompt" and any columns the reward takes).
        held_out: prompts for the evaluation before and after training, or None.
        check: optional `(prompts, completions, held_out) -> dict` of extra metrics (e.g. a ground-truth check);
            a dict-valued metric is reported per group.
        score_fn: optional `(prompts, completions) -> list[float]` logged beside the sample completions.
        timings: seconds spent preparing, by name (e.g. {"sft_s": 207.0}).
    """

    train: object
    held_out: object | None = None
    check: Callable | None = None
    score_fn: Callable | None = None
    timings: dict = field(default_factory=dict)


def load_prompt_data(script_args, model_config, args) -> PromptData:
    """PPO prompts read, checked and tokenized before any model is loaded (only the policy's config is read).

    Args:
        script_args: `dataset_name` and its splits, `eval_size` (held-out prompts kept).
        model_config: the policy (its tokenizer and `max_position_embeddings`).
        args: a `PPOConfig` (`max_prompt_length`, `prompt_overlong_policy`, `response_length`).
    """
    from transformers import AutoConfig

    from ..models.loading import hub_errors, load_tokenizer
    from ..rollout.loader import prepare_prompt_dataset, validate_prompt_dataset

    train, test = load_text_dataset(script_args, lambda rows: validate_prompt_dataset(rows))
    if test is not None:
        test = validate_prompt_dataset(test)[0]
        test = test.select(range(min(len(test), script_args.eval_size)))
    with hub_errors(model_config.model_name_or_path, revision=model_config.model_revision):
        config = AutoConfig.from_pretrained(model_config.model_name_or_path, revision=model_config.model_revision,
                                            trust_remote_code=model_config.trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    train = prepare_prompt_dataset(train, load_tokenizer(model_config), args, max_positions=positions)
    return PromptData(train, test)


def load_callable(spec: str | None, option: str, what: str) -> Callable:
    """The callable named by `spec`, "package.module:function" (`option` and `what` name it in errors).

    Raises:
        RecipeOptionError: (one line on the command line) `spec` is malformed, its module cannot be imported, or
            the module has no such callable.
    """
    module, _, name = (spec or "").partition(":")
    if not module or not name:
        raise RecipeOptionError(f"{option} needs 'package.module:function' ({what}), got {spec!r}")
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        raise RecipeOptionError(f"{option} {spec}: cannot import {module!r} ({e})") from None
    function = getattr(loaded, name, None)
    if not callable(function):
        raise RecipeOptionError(f"{option} {spec}: module {module!r} has no function {name!r}")
    return function


def load_reward_function(spec: str | None) -> Callable:
    """The function named by `spec`, "package.module:function".

    Raises:
        RecipeOptionError: (one line on the command line) `spec` is missing or malformed, its module cannot be
            imported, or the module has no such callable.
    """
    if not spec:
        raise RecipeOptionError(f"--reward_source function needs --reward_function 'package.module:function' (the "
                                f"reward (prompts, completions, **columns) -> list[float]), got {spec!r}")
    return load_callable(spec, "--reward_function", "the reward (prompts, completions, **columns) -> list[float]")


NO_TOOLS = "none"


def load_tools(specs: list[str] | None) -> list[Callable]:
    """The tools named by `specs`: each "package.module:function", several in one item separated by commas; the
    single item "none" (or nothing): no tools (so a command line can switch off a config's tools).

    Raises:
        RecipeOptionError: a name that cannot be resolved, or "none" beside tools.
    """
    names = [name.strip() for item in specs or [] for name in item.split(",") if name.strip()]
    if NO_TOOLS in names:
        if len(names) > 1:
            raise RecipeOptionError(f"--tools {NO_TOOLS} means no tools; it cannot come with others: {names}")
        return []
    return [load_callable(name, "--tools", "a type-hinted function with a Google-style docstring") for name in names]


def tokenize_first(train, test, prepare, tokenizer, training_args):
    """(train, test) checked and tokenized with `prepare` (`prepare_sft_dataset` / `prepare_preference_dataset`)
    before the model is loaded; rank 0 first when the datasets are cached files."""
    from ..data import main_process_first_if_cached

    prepared = []
    for name, dataset in (("train", train), ("test", test)):
        if dataset is not None:
            with main_process_first_if_cached(training_args, dataset, f"{name} dataset tokenization"):
                dataset = prepare(dataset, tokenizer, training_args)
        prepared.append(dataset)
    return tuple(prepared)
