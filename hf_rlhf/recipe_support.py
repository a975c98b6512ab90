"""Plumbing shared by the recipes: argument parsing, the toy base model, dataset loading, results files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

from .config_checks import check_renamed
from .configs import ModelConfig


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


def prepare_toy_base(model_config: ModelConfig, training_args, size: str, seed: int, reward: bool = False):
    """Build the toy tokenizer and a freshly initialised toy model.

    The base is saved under `<output_dir>/base` and `model_config.model_name_or_path` points there, so
    that a LoRA adapter records a base it can be reloaded from, and QLoRA loads that base in 4 bit
    through the ordinary `from_pretrained` path.
    """
    from .models import load_model
    from .toy import build_toy_model, build_toy_reward_model, build_toy_tokenizer

    tokenizer = build_toy_tokenizer()
    model = (build_toy_reward_model if reward else build_toy_model)(tokenizer, size=size, seed=seed)
    if not model_config.use_peft:
        return model, tokenizer
    base_dir = os.path.join(training_args.output_dir, "base")
    if training_args.process_index == 0:
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    _barrier(training_args)
    model_config.model_name_or_path = base_dir
    if model_config.load_in_4bit or model_config.load_in_8bit:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
        model = load_model(model_config, cls, **({"num_labels": 1} if reward else {}))
    else:
        model.config._name_or_path = base_dir
        model.name_or_path = base_dir
    return model, tokenizer


def _barrier(training_args):
    if training_args.world_size > 1:
        from accelerate import PartialState

        PartialState().wait_for_everyone()


def load_text_dataset(script_args):
    """(train, test-or-None) from a hub id, a dataset directory or a json/jsonl/csv/parquet file."""
    import datasets

    name = script_args.dataset_name
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
