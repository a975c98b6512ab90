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


def load_text_dataset(script_args):
    """(train, test-or-None) from a hub id, a dataset directory or a json/jsonl/csv/parquet file."""
    import datasets

    name = script_args.dataset_name
    if getattr(script_args, "dataset_streaming", False):
        raise NotImplementedError("dataset_streaming: the recipes load the whole dataset; leave it false")
    ext = os.path.splitext(name)[1].lstrip(".")
    if os.path.isfile(name) and ext in ("json", "jsonl", "csv", "parquet"):
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
