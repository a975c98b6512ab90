"""Plumbing shared by the recipes: argument parsing, the toy base model, dataset loading, results files."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from .configs import ModelConfig


def parse_recipe_args(dataclass_types, argv: list[str] | None, toy_config: str):
    """Parse the command line (and `--config file.yaml`) into the given dataclasses.

    Without `--config`, `--model_name_or_path` or `--dataset_name` the run is the embedded toy task,
    and the recipe's toy YAML supplies its defaults (other options given still win). Unknown options, on the command line or in
    the YAML file, are errors (trl's `TrlParser`, with `fail_with_unknown_args`). Seeds every RNG with the last
    dataclass's `seed` (the TrainingArguments).
    """
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    real_run = any(a.split("=")[0] in ("--config", "--model_name_or_path", "--dataset_name") for a in argv)
    if not real_run:
        # the toy YAML holds the toy task's defaults; options given on the command line still win
        print(f"[hf_rlhf] running the embedded toy task ({os.path.relpath(toy_config)})")
        argv = ["--config", toy_config, *argv]
    parser = TrlParser(dataclass_types)
    parsed = parser.parse_args_and_config(args=argv, fail_with_unknown_args=True)
    # seed before any model is built: a head added at load time (the reward model's score layer on an SFT
    # policy) is initialised before the Trainer seeds, and would differ from run to run
    from transformers import set_seed

    set_seed(parsed[-1].seed)
    return parsed


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
