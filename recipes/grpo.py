"""GRPO recipe, as `trl grpo` (trl/scripts/grpo.py): `GRPOConfig` / `ModelConfig` options under TRL's names, reward
models and functions as `--reward_model_name_or_path` / `--reward_funcs`, the test split as `eval_dataset` when
`eval_strategy` is set; `hf_rlhf.GRPOTrainer`. `recipes/rloo.py` is the same recipe with `RLOOConfig` / `RLOOTrainer`.

    hf-rlhf grpo                                            # the embedded toy task (configs/grpo_eval_toy.yaml)
    hf-rlhf grpo --model_name_or_path my/sft --dataset_name my/prompts --reward_funcs my_rewards.accuracy \
        --beta 0.04 --num_generations 8 --max_completion_length 256 --eval_strategy steps --eval_steps 50

Without `--dataset_name` the run is the embedded toy task (its SFT policy built first when missing), scored by its
verifiable reward. With evaluation and `load_best_model_at_end` the printout gives the best checkpoint's eval reward
beside the last evaluation's; results.json holds the eval curve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import trl

from hf_rlhf import GRPOConfig, GRPOTrainer, ModelConfig, RLOOConfig, RLOOTrainer
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.data_loading import load_callable, load_prompt_data
from hf_rlhf.cli.errors import RecipeOptionError, run_recipe
from hf_rlhf.cli.results import write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.toy.chain import ToyChainArguments, is_toy_run, toy_chain

RECIPES = os.path.dirname(os.path.abspath(__file__))
METHODS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}
TOY_CONFIG = os.path.join(RECIPES, "configs", "grpo_eval_toy.yaml")


@dataclass
class ScriptArguments(trl.ScriptArguments):
    reward_model_name_or_path: str | None = field(default=None, metadata={
        "help": "A reward model (a path or hub id), scored beside the reward functions (TRL's option)."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions as import paths, module.function or module:function (TRL's option; its built-in "
                "names are trl.rewards' functions)."})
    eval_size: int = field(default=400, metadata={"help": "Held-out prompts kept for evaluation (at most)."})


def reward_functions(script_args, toy: bool) -> list:
    """The reward functions and models of the run, as `trl grpo` builds them (a toy run: the toy task's reward)."""
    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if ":" not in name and "." not in name:
            name = f"trl.rewards:{name}"  # TRL's registry: accuracy_reward, think_format_reward, ...
        elif ":" not in name:
            name = ":".join(name.rsplit(".", 1))
        rewards.append(load_callable(name, "--reward_funcs", "a reward (prompts, completions, **columns) -> scores"))
    if not rewards and not toy:
        raise RecipeOptionError("give a reward: --reward_funcs module.function and/or --reward_model_name_or_path")
    return rewards


def run(method: str, argv: list[str] | None = None, toy_config: str = TOY_CONFIG, parse=None) -> dict:
    """The recipe for `method` ("grpo" or "rloo"); `parse`: the calling recipe's `parse_recipe_args`."""
    config_class, trainer_class = METHODS[method]
    script_args, toy_args, model_config, args = (parse or parse_recipe_args)(
        (ScriptArguments, ToyChainArguments, ModelConfig, config_class), argv, toy_config)
    toy = is_toy_run(script_args)
    rewards = reward_functions(script_args, toy)
    resume = resume_argument(args.resume_from_checkpoint)
    if toy:  # the SFT policy (built when missing) and the toy prompts; the verifiable reward unless one is given
        toy_script = SimpleNamespace(reward_source="function", reward_function=None, reward_model_path=None)
        data = toy_chain(toy_script, toy_args, model_config, RECIPES)
        rewards = rewards or [load_callable(toy_script.reward_function, "--reward_funcs", "the toy reward")]
    else:
        data = load_prompt_data(script_args, model_config, args)
    evaluates = args.eval_strategy != "no"
    if evaluates and data.held_out is None:
        raise RecipeOptionError(f"--eval_strategy {args.eval_strategy.value} needs a test split "
                                f"({script_args.dataset_test_split!r}) in the dataset")
    trainer = trainer_class(model_config.model_name_or_path, rewards, args=args, train_dataset=data.train,
                            eval_dataset=data.held_out if evaluates else None, model_config=model_config)
    metrics = train_run(trainer, resume)
    trainer.save_model(args.output_dir)
    trainer.save_state()
    curve = [{"step": h["step"], "eval_reward": h["eval_reward"]} for h in trainer.state.log_history
             if "eval_reward" in h]
    results = {"train": metrics, "eval_curve": curve, "policy": model_config.model_name_or_path, "method": method,
               "task": "toy" if toy else script_args.dataset_name}
    if args.load_best_model_at_end and trainer.state.best_model_checkpoint:
        results["best"] = {"checkpoint": trainer.state.best_model_checkpoint, "metric": args.metric_for_best_model,
                           "value": trainer.state.best_metric}
    if trainer.is_world_process_zero():
        write_results(args.output_dir, results)
        print(f"[hf_rlhf] {method.upper()} finished: model and results.json in {os.path.abspath(args.output_dir)}")
        if curve:
            line = ", ".join(f"{p['step']}: {p['eval_reward']:.4f}" for p in curve)
            print(f"[hf_rlhf] eval reward by step: {line}")
        if "best" in results:
            print(f"[hf_rlhf] best checkpoint {results['best']['checkpoint']} ({args.metric_for_best_model} "
                  f"{results['best']['value']:.4f}) loaded and saved; last evaluation {curve[-1]['eval_reward']:.4f}")
    return results


def main(argv: list[str] | None = None) -> dict:
    return run("grpo", argv)


if __name__ == "__main__":
    run_recipe(main)
