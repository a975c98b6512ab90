"""PPO recipe: a policy, a reward (model or function), `PPOTrainer`, held-out evaluation before and after.

    accelerate launch recipes/ppo.py                        # the embedded toy task, end to end on a CPU
    python recipes/ppo.py --reward_source model             # toy task, on the reward recipe's model
    python recipes/ppo.py --config recipes/configs/tools_toy.yaml   # toy task with a calculator tool (multi-turn)
    accelerate launch recipes/ppo.py --model_name_or_path my/sft-model --reward_model_path my/reward-model \
        --dataset_name my/prompts --output_dir outputs/ppo-mine

Options are the fields of `ScriptArguments` (below), `hf_rlhf.ModelConfig` and `hf_rlhf.PPOConfig`, on the command
line or in a YAML file given with `--config` (command-line values win); unknown options are errors. Without
`dataset_name` the run is the embedded toy task (`hf_rlhf.toy.chain`, with its own options: a missing SFT policy
or reward model is built first with recipes/sft.py / reward.py). Evaluation on held-out prompts, greedy, before
and after: `score` is the mean training reward; a 0/1 reward also gives `exact_match`, and the toy task checks it
against the ground truth. `--tools module:function,...` (or `none`): tools for rollouts, evaluation and samples, with
tool calls per completion and their error rate. Writes the policy (+ `value/`), results.json, plots to output_dir.

The data is read and checked (a local .json/.jsonl file as written: file, line, row and field in every error)
before any model is loaded. `--resume_from_checkpoint true` (or `latest`) resumes from the latest complete
checkpoint in `output_dir`, a path from that checkpoint; results.json then covers the whole run. After a
non-finite stop nothing is saved or evaluated: results.json holds `stopped` and the recipe exits 1 with the message.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import trl
from trl.models.utils import unwrap_model_for_generation

from hf_rlhf import ModelConfig, PPOConfig, PPOTrainer
from hf_rlhf.callbacks import NonFiniteStopCallback, PlotCallback, SampleCompletionsCallback
from hf_rlhf.cli.arguments import check_ppo_options, given_options, parse_recipe_args
from hf_rlhf.cli.data_loading import PromptData, load_prompt_data, load_reward_function, load_tools
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.evaluation import KL_BAND, evaluate_completions, kl_summary
from hf_rlhf.cli.printing import print_kl, print_outputs
from hf_rlhf.cli.results import exit_after_stop, write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.toy.chain import ToyChainArguments, is_toy_run, toy_chain

RECIPES = os.path.dirname(os.path.abspath(__file__))
TOY_CONFIG = os.path.join(RECIPES, "configs", "ppo_toy.yaml")
PLOT_TITLES = {"objective/raw_scores": "score (reward, raw)", "objective/kl": "KL(policy ‖ ref) per response",
               "objective/kl_coef": "KL coefficient β"}


@dataclass
class ScriptArguments(trl.ScriptArguments):
    reward_model_path: str | None = field(default=None, metadata={"help": "The reward model (a path or hub id)."})
    reward_source: str = field(default="model", metadata={
        "help": "model: the reward model; function: the Python function reward_function.",
        "choices": ["model", "function"]})
    reward_function: str | None = field(default=None, metadata={
        "help": "module:function with the signature (prompts, completions, **columns) -> list[float]."})
    tools: list[str] | None = field(default=None, metadata={
        "help": "Tools the policy may call in its rollouts: importable functions as module:function (type hints and "
                "a Google-style docstring, as TRL's tools), several separated by commas or spaces; none: no tools "
                "(switches off a config's). The policy's tokenizer needs a chat template that renders tool calls."})
    eval_size: int = field(default=400, metadata={"help": "Held-out prompts evaluated (at most)."})
    sample_prompts: int = field(default=4, metadata={"help": "Held-out prompts whose completions are logged."})
    sample_every: int = field(default=0, metadata={"help": "Log samples every N steps (0: at the start and end)."})
    plot: bool = field(default=True, metadata={"help": "Write ppo_curves.png (needs the `plot` extra)."})
    num_threads: int | None = field(default=None, metadata={"help": "torch intra-op threads (None: torch's)."})


def build_callbacks(script_args, args: PPOConfig, data: PromptData, tools: list = ()) -> list:
    callbacks = [NonFiniteStopCallback()]
    if script_args.sample_prompts > 0 and data.held_out is not None:
        callbacks.append(SampleCompletionsCallback(
            list(data.held_out["prompt"][:script_args.sample_prompts]), every_n_steps=script_args.sample_every,
            max_new_tokens=args.response_length, score_fn=data.score_fn, tools=tools,
            max_tool_calling_iterations=args.max_tool_calling_iterations if tools else None))
    if script_args.plot:
        target = args.kl_target  # None: a fixed KL coefficient, no target band
        bands = {"objective/kl": (target * (1 - KL_BAND), target * (1 + KL_BAND))} if target else None
        callbacks.append(PlotCallback(list(PLOT_TITLES), filename="ppo_curves.png", titles=PLOT_TITLES, bands=bands))
    return callbacks


def main(argv: list[str] | None = None) -> dict:
    script_args, toy_args, model_config, args = parse_recipe_args(
        (ScriptArguments, ToyChainArguments, ModelConfig, PPOConfig), argv, TOY_CONFIG)
    if script_args.num_threads:
        torch.set_num_threads(script_args.num_threads)
    check_ppo_options(script_args, model_config, given_options(argv), is_toy_run(script_args))
    tools = load_tools(script_args.tools)
    resume = resume_argument(args.resume_from_checkpoint)
    # the toy task builds its missing SFT policy / reward model first and sets model_name_or_path
    data = toy_chain(script_args, toy_args, model_config, RECIPES) if is_toy_run(script_args) \
        else load_prompt_data(script_args, model_config, args)
    if model_config.model_name_or_path is None:
        raise ValueError("give the policy with --model_name_or_path")
    if script_args.reward_source == "function":
        reward, reward_name = load_reward_function(script_args.reward_function), script_args.reward_function
    elif script_args.reward_model_path:
        reward, reward_name = script_args.reward_model_path, f"reward model {script_args.reward_model_path}"
    else:
        raise ValueError("reward_source 'model' needs --reward_model_path (or use --reward_source function)")
    print(f"[hf_rlhf] PPO: policy {model_config.model_name_or_path}, reward {reward_name}, tools {len(tools)}")

    callbacks = build_callbacks(script_args, args, data, tools)
    trainer = PPOTrainer(model_config.model_name_or_path, reward, args=args, train_dataset=data.train,
                         model_config=model_config, callbacks=callbacks, tools=tools or None)
    timings = data.timings

    def evaluate() -> dict:
        if data.held_out is None:
            return {}
        start = time.perf_counter()
        policy = trainer.accelerator.unwrap_model(trainer.model).policy
        with unwrap_model_for_generation(policy, trainer.accelerator) as policy:  # ZeRO-3: every rank, gathered
            result = evaluate_completions(policy, trainer.processing_class, data.held_out, trainer.reward_source,
                                          args.response_length, args.per_device_eval_batch_size, data.check,
                                          tools, args.max_tool_calling_iterations)
        timings["eval_s"] = round(timings.get("eval_s", 0.0) + time.perf_counter() - start, 1)
        return result

    before = evaluate()
    start = time.perf_counter()
    metrics = train_run(trainer, resume)
    timings["ppo_s"] = round(time.perf_counter() - start, 1)
    task = "toy" if is_toy_run(script_args) else script_args.dataset_name
    exit_after_stop(trainer, args.output_dir, metrics, {
        "before": {k: v for k, v in before.items() if not isinstance(v, dict)}, "timings": timings,
        "reward": reward_name, "policy": model_config.model_name_or_path, "task": task})
    trainer.save_model(args.output_dir)
    trainer.save_state()  # trainer_state.json: the full log history (bench/kl_control.py reads the KL curve)
    after = evaluate()

    plots = [c.path for c in callbacks if isinstance(c, PlotCallback) and c.path]
    results = {"before": {k: v for k, v in before.items() if not isinstance(v, dict)},
               "after": {k: v for k, v in after.items() if not isinstance(v, dict)},
               "kl": kl_summary(trainer.state.log_history, args.kl_target),
               "plots": {"curves": plots[0]} if plots else {}, "timings": timings, "train": metrics,
               "reward": reward_name, "policy": model_config.model_name_or_path, "task": task,
               "tools": [f"{t.__module__}:{t.__name__}" for t in tools]}
    # per-group metrics (the toy task's exact match by task family) side by side
    results.update({k: {"before": v, "after": after[k]} for k, v in before.items() if isinstance(v, dict)})
    if trainer.is_world_process_zero():
        write_results(args.output_dir, results)
        print_outputs("PPO", args.output_dir, results)
        print_kl(results["kl"], timings)
    return results


if __name__ == "__main__":
    run_recipe(main)
