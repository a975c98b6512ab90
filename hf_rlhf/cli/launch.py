"""The `hf-rlhf` training subcommands under `accelerate launch`, as `trl sft ...` hands itself over.

Options that belong to `accelerate launch` (`--num_processes`, `--config_file`, `--mixed_precision`, ...) and
`--accelerate_config NAME_OR_FILE` (a file, or a name from `recipes/accelerate/`: ddp, deepspeed_zero2,
deepspeed_zero3, deepspeed_zero3_offload, fsdp, as trl's names come from `trl/accelerate_configs`) may be mixed
with the recipe's options. With any of them, with a default accelerate config (`accelerate config`) or with
several GPUs, the subcommand re-runs itself as `accelerate launch [launch options] -m hf_rlhf.cli <command> [recipe
options]`; otherwise, or inside a launched process, it runs the recipe in this process (one process is what
`accelerate launch` would start, and the figures equal `python recipes/<name>.py`'s).
"""

from __future__ import annotations

import dataclasses
import os
import shlex

from .arguments import unknown_option_message
from .errors import RecipeOptionError

# set in every process `accelerate launch` starts (and by torchrun)
LAUNCHED_ENV = ("ACCELERATE_MIXED_PRECISION", "LOCAL_RANK", "WORLD_SIZE")


def recipe_option_names(module) -> set[str]:
    """The `--options` of a recipe module: the fields of its `*Arguments` / `*Config` dataclasses (the ones its
    `main()` parses), both spellings (`--a_b`, `--a-b`), `--no_x` for booleans, and `--config`."""
    names = {"--config", "-h", "--help"}
    for value in vars(module).values():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and \
                value.__name__.endswith(("Arguments", "Config")):
            for f in dataclasses.fields(value):
                if f.init:
                    names |= {f"--{f.name}", f"--{f.name.replace('_', '-')}", f"--no_{f.name}",
                              f"--no-{f.name.replace('_', '-')}"}
    return names


def launch_option_arity() -> dict[str, int]:
    """`accelerate launch`'s options and how many values each takes (0 for a flag), plus `--accelerate_config`."""
    from accelerate.commands.launch import launch_command_parser

    out = {"--accelerate_config": 1}
    for action in launch_command_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", "--module", "--no_python"):
                out[option] = 0 if action.nargs == 0 else 1
    return out


def split_arguments(argv: list[str], recipe_options: set[str]) -> tuple[list[str], list[str]]:
    """(recipe arguments, launch arguments) of a subcommand's `argv`; a recipe option wins a name both have
    (`--gradient_accumulation_steps`, `--debug`: TrainingArguments').

    Raises:
        RecipeOptionError: an option neither has, naming the closest one.
    """
    launch = launch_option_arity()
    recipe_args, launch_args = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=")[0]
        if token.startswith("--") and name not in recipe_options and token != "--":
            if name not in launch:
                raise RecipeOptionError(unknown_option_message(name, recipe_options | set(launch)))
            take = 0 if "=" in token else launch[name]
            launch_args += argv[i:i + 1 + take]
            i += 1 + take
            continue
        recipe_args.append(token)
        i += 1
    return recipe_args, launch_args


def resolve_accelerate_config(launch_args: list[str], recipes_dir: str | None) -> list[str]:
    """`--accelerate_config NAME_OR_FILE` as `--config_file PATH`: a file, or `recipes/accelerate/NAME.yaml`."""
    if not any(a.split("=")[0] == "--accelerate_config" for a in launch_args):
        return launch_args
    out, value = [], None
    it = iter(launch_args)
    for a in it:
        if a == "--accelerate_config":
            value = next(it, "")
        elif a.startswith("--accelerate_config="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
    if os.path.isfile(value):
        path = value
    else:
        folder = os.path.join(recipes_dir or "", "accelerate")
        path = os.path.join(folder, f"{value}.yaml")
        if not os.path.isfile(path):
            names = sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".yaml")) if os.path.isdir(folder) else []
            raise RecipeOptionError(f"--accelerate_config {value}: neither a file nor one of {', '.join(names)}")
    return ["--config_file", path, *out]


def should_launch(launch_args: list[str], environ=None) -> bool:
    """Re-run under `accelerate launch`: launch options given, or, outside a launched process, a default accelerate
    config or more than one GPU (what `accelerate launch` would use)."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in LAUNCHED_ENV):
        return False
    if launch_args:
        return True
    from accelerate.commands.config import default_config_file

    if os.path.isfile(default_config_file):
        return True
    import torch

    return torch.cuda.device_count() > 1


def launch(command: str, recipe_args: list[str], launch_args: list[str], recipes_dir: str | None) -> None:
    """`accelerate launch [launch_args] -m hf_rlhf.cli <command> [recipe_args]` (in this process, as trl does)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_args = resolve_accelerate_config(launch_args, recipes_dir)
    argv = [*launch_args, "--module", "hf_rlhf.cli", command, *recipe_args]
    print("[hf_rlhf] accelerate launch " + " ".join(shlex.quote(a) for a in argv), flush=True)
    args = launch_command_parser().parse_args(argv)
    launch_command(args)
