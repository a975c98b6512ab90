"""`hf-rlhf`: one command line for every trainer.

    hf-rlhf chain                                   # the RLHF chain on the embedded toy task (SFT, reward, PPO)
    hf-rlhf sft --config recipes/configs/sft_toy_lora.yaml
    hf-rlhf ppo --num_processes 2 --accelerate_config ddp --config my_ppo.yaml
    hf-rlhf grpo --model_name_or_path my/sft --dataset_name my/prompts --reward_funcs my_rewards.accuracy
    accelerate launch -m hf_rlhf.cli ppo --config my_ppo.yaml
    hf-rlhf env
    hf-rlhf plan sft --model_name_or_path qwen2.5-0.5b --max_length 2048   # the predicted peak memory

A training subcommand (`sft`, `reward`, `ppo`, `dpo`, `kto`, `grpo`, `rloo`, `distill`, `chain`) takes
the options and `--config file.yaml` of its recipe and runs that recipe's `main()`: the same code as
`python recipes/<name>.py`. It runs under `accelerate launch` as `trl <command>` does (`hf_rlhf.cli.launch`). A bad
invocation prints one `[hf_rlhf] error: ...` line and exits 2; a bad input found by the recipe exits 1, as the recipe
does.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from .errors import RecipeOptionError, close_process_group, run_recipe

PROG = "hf-rlhf"

# name: (recipe it runs or None, one line of help); `dpo` is listed once recipes/dpo.py has a main()
COMMANDS = {
    "chain": ("ppo", "the RLHF chain on the embedded toy task: SFT policy and reward model (built if missing), "
                     "then PPO on the reward model"),
    "sft": ("sft", "supervised fine-tuning, full / LoRA / QLoRA (recipes/sft.py)"),
    "reward": ("reward", "a pairwise (Bradley-Terry) reward model (recipes/reward.py)"),
    "ppo": ("ppo", "PPO, GRPO, RLOO, REINFORCE++ on a reward model or function (recipes/ppo.py)"),
    "dpo": ("dpo", "direct preference optimisation (recipes/dpo.py)"),
    "kto": ("kto", "Kahneman-Tversky optimisation from unpaired good / bad labels (recipes/kto.py)"),
    "distill": ("distill", "on-policy distillation of a teacher into a student (recipes/distill.py)"),
    "grpo": ("grpo", "GRPO with trl grpo's options: GRPOConfig, --reward_funcs, eval_dataset (recipes/grpo.py)"),
    "rloo": ("rloo", "RLOO with trl rloo's options: RLOOConfig, --reward_funcs, eval_dataset (recipes/rloo.py)"),
    "merge": (None, "merge a LoRA adapter into its base model (hf_rlhf.models.merge)"),
    "plan": (None, "predict a run's peak memory, part by part, before the run (hf_rlhf.training.memory_plan)"),
    "env": (None, "print the versions of torch, transformers, trl, peft, accelerate, deepspeed, bitsandbytes and the "
                  "device"),
}
# `chain` is the PPO recipe with the reward model as its reward (options given still win)
CHAIN_DEFAULTS = ["--reward_source", "model"]


def available_commands() -> dict[str, str]:
    """{name: help} of the subcommands this installation has (a recipe's only once the recipe exists)."""
    from .recipes import has_recipe

    return {name: text for name, (recipe, text) in COMMANDS.items() if recipe is None or has_recipe(recipe)}


def build_parser(commands: dict[str, str]) -> argparse.ArgumentParser:
    """The top-level parser: for `--help` (one line per subcommand); each subcommand parses its own options."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="RLHF on the Hugging Face stack: one command line for every trainer.",
        epilog=f"`{PROG} <command> --help` lists a command's options, grouped by config class. Training commands "
               "also take accelerate launch's options (--num_processes, --accelerate_config NAME|FILE, ...).")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="<command>")
    for name, text in commands.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def error(message: str, status: int = 2) -> int:
    print(f"[hf_rlhf] error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = available_commands()
    if not argv or argv[0] in ("-h", "--help"):
        build_parser(commands).print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in commands:
        close = difflib.get_close_matches(command, list(commands), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return error(f"unknown command {command!r}{hint} (commands: {', '.join(commands)})")
    if command == "env":
        from .environment import print_env

        print_env()
        return 0
    if command == "plan":
        from .plan import main as plan_main

        return plan_main(rest, prog=f"{PROG} plan")
    if command == "merge":
        from ..models.loading import ModelUnavailableError
        from ..models.merge import main as merge_main

        try:
            merge_main(rest, prog=f"{PROG} merge")
        except ModelUnavailableError as e:  # a base model that cannot be loaded: one line, as the recipes say it
            return error(str(e), 1)
        return 0
    return run_training(command, rest)


def run_training(command: str, argv: list[str]) -> int:
    """Run the recipe of `command` with `argv` (its options mixed with accelerate launch's), here or launched."""
    from . import launch
    from .arguments import config_path
    from .recipes import load_recipe, recipes_dir

    try:
        module = load_recipe(COMMANDS[command][0])
    except FileNotFoundError as e:
        return error(str(e), 1)
    if {"-h", "--help"} & set(argv):
        return show_help(command, module)
    config = config_path(argv)
    if config is not None and not os.path.isfile(config):
        return error(f"--config {config}: no such file" if config else "--config needs a YAML file")
    try:
        recipe_args, launch_args = launch.split_arguments(argv, launch.recipe_option_names(module))
        if command == "chain" and not chain_arguments_ok(recipe_args):
            return 2
        if launch.should_launch(launch_args):
            launch.launch(command, recipe_args, launch_args, recipes_dir())
            return 0
    except RecipeOptionError as e:
        return error(str(e))
    if command == "chain":
        recipe_args = [*CHAIN_DEFAULTS, *recipe_args]  # options given win: argparse keeps the last value
    sys.argv[0] = f"{PROG} {command}"  # the recipe's messages and argparse's usage name the subcommand
    results = run_recipe(lambda: module.main(recipe_args), close=False)
    if command == "chain" and results:
        from .printing import print_chain_summary

        print_chain_summary_for(results, module, recipe_args, print_chain_summary)
    close_process_group()
    return 0


def chain_arguments_ok(argv: list[str]) -> bool:
    """`chain` runs the toy task: no `--dataset_name` or `--model_name_or_path` (else one error line)."""
    given = {a.split("=")[0] for a in argv}
    if given & {"--dataset_name", "--model_name_or_path"}:
        error(f"{PROG} chain runs the embedded toy task; on your own data and models run {PROG} sft, reward and ppo "
              f"(`{PROG} chain` prints the commands at its end)")
        return False
    return True


def print_chain_summary_for(results: dict, module, argv: list[str], printer) -> None:
    """The chain's closing note, with the paths its options chose (parsed again as the recipe parsed them: the toy
    YAML, then `argv`); on the main process only."""
    from accelerate import PartialState

    from .arguments import config_path, make_parser

    if not PartialState().is_main_process:
        return
    types = [t for t in vars(module).values() if isinstance(t, type) and t.__name__ in (
        "ScriptArguments", "ToyChainArguments", "PPOConfig")]
    # as parse_recipe_args: the toy YAML unless a --config is given (chain refuses --model_name_or_path and data)
    argv = argv if config_path(argv) is not None else ["--config", module.TOY_CONFIG, *argv]
    parsed = make_parser(types).parse_args_and_config(argv, return_remaining_strings=True)[:-1]
    parsed = {type(p).__name__: p for p in parsed}
    script, toy, args = parsed["ScriptArguments"], parsed["ToyChainArguments"], parsed["PPOConfig"]
    reward = script.reward_model_path if script.reward_source == "model" else None
    printer(results, args.output_dir, toy.sft_model_path, reward)


def show_help(command: str, module) -> int:
    """The recipe's `--help` (its options grouped by config class), then how launch options are handed over."""
    sys.argv[0] = f"{PROG} {command}"
    try:
        module.main(["--help"])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    print("\naccelerate launch's options (--num_processes, --config_file, --mixed_precision, ...) and "
          "--accelerate_config NAME|FILE (recipes/accelerate/NAME.yaml) may be mixed in: the command then runs "
          "under accelerate launch.")
    return 0
