"""The recipes' command line: their dataclasses parsed from argv and `--config file.yaml` (trl's `TrlParser`), the toy
task's default YAML, old option names, and the PPO recipe's option combinations that cannot make a run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from ..trainers.config_checks import check_renamed
from .errors import RecipeOptionError


class _KeepSharedNamespace(argparse.Namespace):
    """A namespace whose `shared` attributes survive `delattr`: each dataclass that holds them reads them."""

    def __init__(self, shared: set[str]):
        super().__init__()
        object.__setattr__(self, "_shared", shared)

    def __delattr__(self, name):
        if name not in self._shared:
            super().__delattr__(name)


def make_parser(dataclass_types):
    """trl's `TrlParser` for `dataclass_types`: a field several of them hold is one option, `--help` groups the
    options by dataclass."""
    from trl import TrlParser

    class SharedFieldsParser(TrlParser):
        """`TrlParser` where a field that several dataclasses hold is one option that sets all of them
        (`trust_remote_code`: ModelConfig's, and the trainer config's as in TRL)."""

        def __init__(self, types):
            types = list(types)
            names = [f.name for t in types for f in dataclasses.fields(t) if f.init]
            self.shared = {n for n in names if names.count(n) > 1}
            super().__init__(types, conflict_handler="resolve")  # argparse keeps one definition of a shared option

        def _add_dataclass_arguments(self, dtype):
            """Each dataclass's options under a heading of its own (`--help` groups them by config class)."""
            if hasattr(dtype, "_argument_group_name"):
                return super()._add_dataclass_arguments(dtype)
            dtype._argument_group_name = f"{dtype.__name__} ({dtype.__module__})"
            try:
                return super()._add_dataclass_arguments(dtype)
            finally:
                del dtype._argument_group_name

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
    and the recipe's toy YAML supplies its defaults (other options given still win). Unknown options, on the command
    line or in the YAML file, are errors (trl's `TrlParser`, with `fail_with_unknown_args`). Seeds every RNG with the
    last dataclass's `seed` (the TrainingArguments).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--config=x.yaml` as `--config x.yaml`: TrlParser reads the file only when its name is a token of its own
    argv = [t for a in argv for t in (a.split("=", 1) if a.startswith("--config=") else [a])]
    real_run = any(a.split("=")[0] in ("--config", "--model_name_or_path", "--dataset_name") for a in argv)
    config = config_path(argv)
    if config is not None and not os.path.isfile(config):
        raise RecipeOptionError(f"--config {config}: no such file")
    if not real_run and not {"-h", "--help"} & set(argv):
        # the toy YAML holds the toy task's defaults; options given on the command line still win
        print(f"[hf_rlhf] running the embedded toy task ({os.path.relpath(toy_config)})")
        argv = ["--config", toy_config, *argv]
    check_renamed_cli_options(argv, dataclass_types)
    parser = make_parser(dataclass_types)
    check_known_options(parser, argv)
    parsed = parser.parse_args_and_config(args=argv, fail_with_unknown_args=True)
    # seed before any model is built: a head added at load time (the reward model's score layer on an SFT
    # policy) is initialised before the Trainer seeds, and would differ from run to run
    from transformers import set_seed

    set_seed(parsed[-1].seed)
    return parsed


def config_path(argv: list[str]) -> str | None:
    """The `--config` file named in `argv` (`--config x.yaml` or `--config=x.yaml`), or None."""
    for i, a in enumerate(argv):
        if a == "--config":
            return argv[i + 1] if i + 1 < len(argv) else ""
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def unknown_option_message(name: str, valid, where: str = "") -> str:
    """"unknown option --x (did you mean --y?)": the closest valid name by `difflib`, if any is close."""
    import difflib

    close = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else " (--help lists the options)"
    return f"unknown option {name}{where}{hint}"


def check_known_options(parser, argv: list[str]) -> None:
    """Refuse an option the recipe does not have, on the command line or as a key of the `--config` YAML file, with
    the closest valid one (one line, before anything is parsed or loaded).

    Raises:
        RecipeOptionError: naming the unknown option and the closest valid one.
    """
    options = set(parser._option_string_actions) | {"--config"}
    for a in argv:
        if (a.startswith("--") and a != "--") or re.fullmatch(r"-[A-Za-z].*", a):  # not a value such as -0.5
            name = a.split("=")[0]
            if name not in options:
                raise RecipeOptionError(unknown_option_message(name, options))
    path = config_path(argv)
    if path and os.path.isfile(path):
        import yaml

        with open(path) as f:
            config = yaml.safe_load(f) or {}
        dests = {action.dest for action in parser._actions}
        for key in config if isinstance(config, dict) else ():
            if key != "env" and key not in dests:
                message = unknown_option_message(key, dests, f" in {path}")
                raise RecipeOptionError(message.replace(f"unknown option {key}", f"unknown key {key!r}", 1))


def check_renamed_cli_options(argv: list[str], dataclass_types=()) -> None:
    """Old option names (`hf_rlhf.trainers.config_checks.RENAMED`: `--max_seq_length`, `--init_kl_coef`, ...) on the
    command line or as keys of the `--config` YAML file are errors that name the new option (unless one of
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


def given_options(argv: list[str] | None) -> set[str]:
    """The `--option` names on the command line (`argv`, or `sys.argv[1:]`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return {a.split("=")[0] for a in argv if a.startswith("--")}


def check_ppo_options(script_args, model_config, options: set[str], toy: bool) -> None:
    """Refuse PPO recipe options that cannot make a run, before anything is loaded.

    Args:
        script_args: the recipe's options (`reward_source`, `reward_function`, `reward_model_path`).
        model_config: `model_name_or_path`.
        options: the `--option` names on the command line (`given_options`).
        toy: the run is the embedded toy task (no `dataset_name`).

    Raises:
        RecipeOptionError: naming the missing option.
        ModelUnavailableError: (a run on `dataset_name`) the reward model path cannot be loaded: no such local
            directory, not in the local hub cache while offline, or a Hub that cannot be reached (`check_model_path`).
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
    if script_args.reward_source == "model":
        from ..rewards.factory import check_reward_model_path

        check_reward_model_path(script_args.reward_model_path)  # before the prompts and the policy's tokenizer
