"""Plumbing shared by the recipes: argument parsing, dataset loading, evaluation, KL summary, results files."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from .config_checks import check_renamed

KL_BAND = 0.25  # the adaptive KL controller's acceptance band: target ± 25 %


class _KeepSharedNamespace(argparse.Namespace):
    """A namespace whose `shared` attributes survive `delattr`: each dataclass that holds them reads them."""

    def __init__(self, shared: set[str]):
        super().__init__()
        object.__setattr__(self, "_shared", shared)

    def __delattr__(self, name):
        if name not in self._shared:
            super().__delattr__(name)


def _make_parser(dataclass_types):
    from trl import TrlParser

    class SharedFieldsParser(TrlParser):
        """`TrlParser` where a field that several dataclasses hold is one option that sets all of them
        (`trust_remote_code`: ModelConfig's, and the trainer config's as in TRL)."""

        def __init__(self, types):
            types = list(types)
            names = [f.name for t in types for f in dataclasses.fields(t) if f.init]
            self.shared = {n for n in names if names.count(n) > 1}
            super().__init__(types, conflict_handler="resolve")  # argparse keeps one definition of a shared option

        def parse_known_args(self, args=None, namespace=None):
            return super().parse_known_args(args, namespace or _KeepSharedNamespace(self.shared))

        def parse_args_and_config(self, *args, **kwargs):
            parsed = super().parse_args_and_config(*args, **kwargs)
            # the shared attributes are left in a trailing namespace of their own; nothing else can be
            extra = parsed[-1] if parsed and isinstance(parsed[-1], argparse.Namespace) else None
            if extra is not None and set(vars(extra)) - {"_shared"} <= self.shared:
                parsed = parsed[:-1]
            return parsed

    return SharedFieldsParser(dataclass_types)


def parse_recipe_args(dataclass_types, argv: list[str] | None, toy_config: str):
    """Parse the command line (and `--config file.yaml`) into the given dataclasses.

    Without `--config`, `--model_name_or_path` or `--dataset_name` the run is the embedded toy task,
    and the recipe's toy YAML supplies its defaults (other options given still win). Unknown options, on the command line or in
    the YAML file, are errors (trl's `TrlParser`, with `fail_with_unknown_args`). Seeds every RNG with the last
    dataclass's `seed` (the TrainingArguments).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    real_run = any(a.split("=")[0] in ("--config", "--model_name_or_path", "--dataset_name") for a in argv)
    if not real_run:
        # the toy YAML holds the toy task's defaults; options given on the command line still win
        print(f"[hf_rlhf] running the embedded toy task ({os.path.relpath(toy_config)})")
        argv = ["--config", toy_config, *argv]
    check_renamed_cli_options(argv, dataclass_types)
    parser = _make_parser(dataclass_types)
    parsed = parser.parse_args_and_config(args=argv, fail_with_unknown_args=True)
    # seed before any model is built: a head added at load time (the reward model's score layer on an SFT
    # policy) is initialised before the Trainer seeds, and would differ from run to run
    from transformers import set_seed

    set_seed(parsed[-1].seed)
    return parsed


def check_renamed_cli_options(argv: list[str], dataclass_types=()) -> None:
    """Old option names (`hf_rlhf.config_checks.RENAMED`: `--max_seq_length`, `--init_kl_coef`, ...) on the command
    line or as keys of the `--config` YAML file are errors that name the new option (unless one of
    `dataclass_types` has a field of that name)."""
    names = [a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")]
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        import yaml

        i = next(i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config="))
        path = argv[i].split("=", 1)[1] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else None)
        if path and os.path.isfile(path):
            with open(path) as f:
                config = yaml.safe_load(f) or {}
            names += list(config) if isinstance(config, dict) else []
    fields = {f.name for t in dataclass_types for f in dataclasses.fields(t)}
    check_renamed([n for n in names if n not in fields], "command line / --config YAML")


class RecipeOptionError(ValueError):
    """A recipe's options that cannot make a run (a missing dataset, policy or reward); raised before any loading."""


def given_options(argv: list[str] | None) -> set[str]:
    """The `--option` names on the command line (`argv`, or `sys.argv[1:]`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return {a.split("=")[0] for a in argv if a.startswith("--")}


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

    from .data import check_raw_file

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


# ---------------------------------------------------------------------------------------------------
# Resume and the end of a run


def resume_argument(value) -> str | None:
    """`--resume_from_checkpoint` as the trainers take it (TrainingArguments types it as a string).

    Returns:
        "latest" for true / latest (the trainers resume from the latest complete checkpoint of `output_dir`), None
        for false / none / empty, else the checkpoint folder.

    Raises:
        FileNotFoundError: a path that is not a folder.
    """
    if value is None or value is False:
        return None
    text = "true" if value is True else str(value).strip()
    if text.lower() in ("true", "latest"):
        return "latest"
    if text.lower() in ("false", "none", ""):
        return None
    if not os.path.isdir(text):
        raise FileNotFoundError(f"--resume_from_checkpoint {text}: no such checkpoint folder (give a checkpoint-N "
                                "folder, or true / latest for the latest complete checkpoint of output_dir)")
    return text


def train_run(trainer, resume_from_checkpoint) -> dict:
    """`trainer.train(resume_from_checkpoint=...)`'s metrics, with `train_loss` over the whole run when resumed.

    The Trainer averages `train_loss` over the steps of this `train()` call only; a resumed run adds the steps
    before the checkpoint from the checkpoint's logged losses (each log covers the steps since the previous one),
    so the figure reads as the uninterrupted run's (exactly when the checkpoint step is a logging step).

    Args:
        trainer: an hf_rlhf trainer (`resolve_resume_checkpoint`).
        resume_from_checkpoint: `resume_argument`'s value.
    """
    from transformers.trainer_callback import TrainerState

    checkpoint = trainer.resolve_resume_checkpoint(resume_from_checkpoint)
    metrics = dict(trainer.train(resume_from_checkpoint=checkpoint).metrics)
    if checkpoint is None or "train_loss" not in metrics:
        return metrics
    start = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json")).global_step
    previous, before = 0, 0.0
    for h in trainer.state.log_history:
        if "loss" in h and previous < h["step"] <= start:
            before += h["loss"] * (h["step"] - previous)
            previous = h["step"]
    resumed = trainer.state.global_step - start
    metrics["train_loss"] = (before + metrics["train_loss"] * resumed) / max(previous + resumed, 1)
    return metrics


def nonfinite_stop_of(trainer, metrics: dict) -> dict | None:
    """The run's non-finite stop (`trainer.nonfinite_stop`, or a `NonFiniteStopCallback`'s), or None."""
    if "nonfinite_stop_step" not in metrics:
        return None
    if trainer.nonfinite_stop is not None:
        return dict(trainer.nonfinite_stop)
    from .callbacks import NonFiniteStopCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, NonFiniteStopCallback) and cb.stopped is not None:
            return {**cb.stopped, "message": f"training stopped at step {cb.stopped['step']}: "
                                             f"{cb.stopped['metric']} = {cb.stopped['value']} was logged"}
    return {"step": metrics["nonfinite_stop_step"], "message": f"training stopped at step "
                                                                f"{metrics['nonfinite_stop_step']}: a non-finite value"}


def exit_after_nonfinite_stop(trainer, output_dir: str, metrics: dict, results: dict) -> None:
    """After a non-finite stop: write results.json saying so (no model saved, none evaluated) and exit non-zero.

    Returns only when the run did not stop on a non-finite value.

    Raises:
        SystemExit: with the stop's message (step, value, last good checkpoint); the exit status is 1.
    """
    stop = nonfinite_stop_of(trainer, metrics)
    if stop is None:
        return
    if trainer.is_world_process_zero():
        write_results(output_dir, {**results, "train": metrics, "stopped": stop})
    raise SystemExit(f"[hf_rlhf] {stop['message']}. No model was saved or evaluated; results: "
                     f"{os.path.join(output_dir, 'results.json')}")


def run_recipe(main: Callable) -> None:
    """Run a recipe's `main()` from the command line: a bad input or option exits with its message, not a traceback."""
    from .data import DataFileError, DataValidationError

    try:
        main()
    except (DataFileError, DataValidationError, RecipeOptionError) as e:
        raise SystemExit(f"[hf_rlhf] error: {e}") from None


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


def check_ppo_options(script_args, model_config, options: set[str], toy: bool) -> None:
    """Refuse PPO recipe options that cannot make a run, before anything is loaded.

    Args:
        script_args: the recipe's options (`reward_source`, `reward_function`, `reward_model_path`).
        model_config: `model_name_or_path`.
        options: the `--option` names on the command line (`given_options`).
        toy: the run is the embedded toy task (no `dataset_name`).

    Raises:
        RecipeOptionError: naming the missing option.
    """
    if toy:
        if model_config.model_name_or_path is not None and not options & {"--config", "--dataset_name"}:
            raise RecipeOptionError(
                f"recipes/ppo.py: --model_name_or_path {model_config.model_name_or_path} needs --dataset_name (the "
                "prompts) and a reward (--reward_model_path, or --reward_source function --reward_function "
                "module:function); with neither --model_name_or_path nor --dataset_name the recipe runs the toy task")
        return
    if model_config.model_name_or_path is None:
        raise RecipeOptionError("recipes/ppo.py: --dataset_name needs the policy to train: give --model_name_or_path")
    if script_args.reward_source == "function" and not script_args.reward_function:
        raise RecipeOptionError("recipes/ppo.py: --reward_source function needs --reward_function module:function")
    if script_args.reward_source == "model" and not script_args.reward_model_path:
        raise RecipeOptionError("recipes/ppo.py: a run on --dataset_name needs a reward: give --reward_model_path "
                                "(a reward model), or --reward_source function --reward_function module:function")


def load_prompt_data(script_args, model_config, args) -> PromptData:
    """PPO prompts read, checked and tokenized before any model is loaded (only the policy's config is read).

    Args:
        script_args: `dataset_name` and its splits, `eval_size` (held-out prompts kept).
        model_config: the policy (its tokenizer and `max_position_embeddings`).
        args: a `PPOConfig` (`max_prompt_length`, `prompt_overlong_policy`, `response_length`).
    """
    from transformers import AutoConfig

    from .models import load_tokenizer
    from .ppo.loader import prepare_prompt_dataset, validate_prompt_dataset

    train, test = load_text_dataset(script_args, lambda rows: validate_prompt_dataset(rows))
    if test is not None:
        test = validate_prompt_dataset(test)[0]
        test = test.select(range(min(len(test), script_args.eval_size)))
    config = AutoConfig.from_pretrained(model_config.model_name_or_path, revision=model_config.model_revision,
                                        trust_remote_code=model_config.trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    train = prepare_prompt_dataset(train, load_tokenizer(model_config), args, max_positions=positions)
    return PromptData(train, test)


def load_reward_function(spec: str) -> Callable:
    """The function named by `spec`, "package.module:function"."""
    module, _, name = (spec or "").partition(":")
    if not module or not name:
        raise ValueError(f"reward_function must look like 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


def evaluate_completions(model, tokenizer, rows, reward: Callable, max_new_tokens: int, batch_size: int,
                         check: Callable | None = None) -> dict:
    """Greedy completions of the held-out `rows`, scored by `reward` (and `check`).

    Args:
        rows: a `datasets.Dataset` with "prompt"; its other columns (but "input_ids") go to `reward` by name.
        reward: `(prompts, completions, **columns) -> (N,) tensor` (a PPO trainer's `reward_source`).
        check: optional `(prompts, completions, rows) -> dict` of extra metrics.

    Returns:
        {"score": mean score, **check's metrics}; without `check`, when every score is 0 or 1 (a verifiable
        reward), also "exact_match": the share of completions that scored 1.
    """
    from .generation import generate_completions

    prompts = list(rows["prompt"])
    completions = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size)
    columns = {name: list(rows[name]) for name in rows.column_names if name not in ("prompt", "input_ids")}
    scores = reward(prompts, completions, **columns).float()
    out = {"score": float(scores.mean())}
    if check is not None:
        out.update(check(prompts, completions, rows))
    elif bool(((scores == 0) | (scores == 1)).all()):
        out["exact_match"] = float((scores == 1).float().mean())
    return out


def kl_summary(log_history: list[dict], target: float | None) -> dict:
    """The logged KL: final value, mean over the second half of the steps, and (adaptive) the share in target ± 25 %."""
    logged = [(h["step"], h["objective/kl"]) for h in log_history if "objective/kl" in h]
    if not logged:
        return {}
    last_step = logged[-1][0]
    second = [kl for step, kl in logged if step > last_step / 2] or [logged[-1][1]]
    coefs = [h["objective/kl_coef"] for h in log_history if "objective/kl_coef" in h]
    out = {"final": logged[-1][1], "mean_second_half": sum(second) / len(second), "target": target,
           "coef_final": coefs[-1] if coefs else None, "logged_steps_second_half": len(second)}
    if target is not None:
        inside = [abs(kl / target - 1) <= KL_BAND for kl in second]
        out["within_25pct_second_half"] = sum(inside) / len(inside)
        out["mean_second_half_within_25pct"] = abs(out["mean_second_half"] / target - 1) <= KL_BAND
    return out


def write_results(output_dir: str, results: dict) -> str:
    """Write `<output_dir>/results.json` atomically (a crash leaves the old file or none)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "results.json")
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".json", dir=output_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=2, default=float)
    os.replace(tmp, path)
    return path


def print_outputs(stage: str, output_dir: str, results: dict) -> None:
    def fmt(d):
        return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()) or "-"

    print(f"\n[hf_rlhf] {stage} finished")
    print(f"  before: {fmt(results.get('before', {}))}")
    print(f"  after:  {fmt(results.get('after', {}))}")
    print(f"  model and tokenizer: {os.path.abspath(output_dir)}")
    print(f"  results:             {os.path.join(os.path.abspath(output_dir), 'results.json')}")
    for name, path in results.get("plots", {}).items():
        print(f"  plot ({name}): {path}")


def print_kl(kl: dict, timings: dict) -> None:
    """Print `kl_summary`'s figures and the run's timings."""
    if kl:
        target = f", target {kl['target']:.3g}" if kl.get("target") else " (fixed coefficient)"
        share = (f", {kl['within_25pct_second_half']:.0%} of logged steps within ±25 %"
                 if "within_25pct_second_half" in kl else "")
        print(f"  KL: final {kl['final']:.3f}, mean over the 2nd half {kl['mean_second_half']:.3f}{target}{share}; "
              f"β final {kl['coef_final']:.4g}")
    if timings:
        print("  seconds: " + ", ".join(f"{name.removesuffix('_s')} {value:.0f}" for name, value in timings.items()))


def tokenize_first(train, test, prepare, tokenizer, training_args):
    """(train, test) checked and tokenized with `prepare` (`prepare_sft_dataset` / `prepare_preference_dataset`)
    before the model is loaded; rank 0 first when the datasets are cached files."""
    from .data import main_process_first_if_cached

    prepared = []
    for name, dataset in (("train", train), ("test", test)):
        if dataset is not None:
            with main_process_first_if_cached(training_args, dataset, f"{name} dataset tokenization"):
                dataset = prepare(dataset, tokenizer, training_args)
        prepared.append(dataset)
    return tuple(prepared)
