"""PPO recipe: a policy, a reward (model or function), `PPOTrainer`, held-out evaluation before and after.

    accelerate launch recipes/ppo.py                        # the embedded toy task, end to end on a CPU
    python recipes/ppo.py --reward_source function          # toy task, the verifiable reward instead of the model
    accelerate launch recipes/ppo.py --model_name_or_path my/sft-model --reward_model_path my/reward-model \
        --dataset_name my/prompts --output_dir outputs/ppo-mine

Toy task (no `model_name_or_path`, no `dataset_name`): the policy is the SFT recipe's model (`sft_model_path`,
default `outputs/sft`) and the reward the reward recipe's model (`reward_model_path`, default `outputs/reward`).
When either is missing it is built first, in this process, by running that recipe's `main()` with its toy config
(`build_missing`; about 3.5 + 1 minutes on an idle 2-core CPU). `reward_source: function` uses a Python reward
function instead (`reward_function`, default the toy task's verifiable `hf_rlhf.toy:reward_fn`), and then no reward
model is needed or built.

Evaluation, before and after PPO, on held-out prompts with greedy decoding: `score` is the mean of the training
reward (the reward model's raw score, or the function's); on the toy task `exact_match` is checked against the
ground truth (`hf_rlhf.toy.reward_fn`), whatever reward PPO trained on. Writes the policy (and `value/`) to
`output_dir`, `<output_dir>/results.json` (before / after, the KL over the run, timings, the plot's path) and
`<output_dir>/ppo_curves.png` (score, KL and KL coefficient against the step).

Options are the fields of `ScriptArguments` (below), `hf_rlhf.ModelConfig` and `hf_rlhf.PPOConfig`, on the command
line or in a YAML file given with `--config` (command-line values win). Unknown options are errors.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from trl.models.utils import unwrap_model_for_generation

from hf_rlhf import ModelConfig, PPOConfig, PPOTrainer
from hf_rlhf.callbacks import NonFiniteStopCallback, PlotCallback, SampleCompletionsCallback
from hf_rlhf.recipe_support import load_text_dataset, parse_recipe_args, print_outputs, write_results

RECIPES = os.path.dirname(os.path.abspath(__file__))
TOY_CONFIG = os.path.join(RECIPES, "configs", "ppo_toy.yaml")
PLOT_METRICS = ("objective/raw_scores", "objective/kl", "objective/kl_coef")
PLOT_TITLES = {"objective/raw_scores": "score (reward, raw)", "objective/kl": "KL(policy ‖ ref) per response",
               "objective/kl_coef": "KL coefficient β"}
KL_BAND = 0.25  # the adaptive controller's acceptance band: target ± 25 %


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.parquet "
                                        "file of prompts. None: the embedded toy task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="test", metadata={"help": "Held-out split for evaluation."})
    sft_model_path: str = field(
        default="outputs/sft", metadata={"help": "Toy task: the policy to start from (the SFT recipe's output); "
                                                 "built with recipes/sft.py when missing and build_missing is set."})
    reward_model_path: str = field(
        default="outputs/reward", metadata={"help": "The reward model (a path or hub id). Toy task: built with "
                                                    "recipes/reward.py when missing and build_missing is set."})
    reward_source: str = field(
        default="model", metadata={"help": "model: the reward model at reward_model_path; function: the Python "
                                           "function reward_function.", "choices": ["model", "function"]})
    reward_function: str = field(
        default="hf_rlhf.toy:reward_fn", metadata={"help": "module:function with the signature "
                                                           "(prompts, completions, **columns) -> list[float]."})
    build_missing: bool = field(
        default=True, metadata={"help": "Toy task: build a missing SFT / reward model with its recipe first."})
    sft_config: str = field(default=os.path.join(RECIPES, "configs", "sft_toy.yaml"),
                            metadata={"help": "Toy task: the config the SFT model is built with."})
    reward_config: str = field(default=os.path.join(RECIPES, "configs", "reward_toy.yaml"),
                               metadata={"help": "Toy task: the config the reward model is built with."})
    toy_train_size: int = field(default=4096, metadata={"help": "Toy task: training prompts."})
    toy_test_size: int = field(default=400, metadata={"help": "Toy task: held-out prompts for evaluation."})
    toy_seed: int = field(default=0, metadata={"help": "Seed of the toy prompts."})
    eval_size: int = field(default=400, metadata={"help": "Held-out prompts evaluated (non-toy data)."})
    sample_prompts: int = field(default=4, metadata={"help": "Held-out prompts whose completions are logged "
                                                              "during training (0: none)."})
    sample_every: int = field(default=0, metadata={"help": "Log sample completions every N steps "
                                                            "(0: at the start and the end only)."})
    plot: bool = field(default=True, metadata={"help": "Write ppo_curves.png (needs matplotlib, the `plot` "
                                                       "extra)."})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (None: torch's default). Tiny models on a busy "
                                        "machine run faster with 1."})


# ---------------------------------------------------------------------------------------------------
# Toy prerequisites: the SFT policy and the reward model


def _run_recipe(name: str, argv: list[str]) -> dict:
    """Run `recipes/<name>.py`'s main(argv) in this process (loaded by path: recipes/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module.main(argv)


def _is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(
        os.path.join(path, "adapter_config.json"))


@contextlib.contextmanager
def _build_threads():
    """Every core for a single-process build of a toy prerequisite, then the threads as they were.

    `accelerate launch` sets OMP_NUM_THREADS=1 in every process it starts, a single one included; the SFT build
    trains on packed 1,024-token batches, which run about 2x faster on both cores of a 2-core machine.
    """
    before = torch.get_num_threads()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ensure_toy_models(script_args, timings: dict) -> None:
    """Build the SFT policy and (for reward_source=model) the reward model when they are missing."""
    needed = [("sft", script_args.sft_model_path, script_args.sft_config, [])]
    if script_args.reward_source == "model":
        needed.append(("reward", script_args.reward_model_path, script_args.reward_config,
                       ["--sft_model_path", script_args.sft_model_path]))
    for name, path, config, extra in needed:
        if _is_model_dir(path):
            print(f"[hf_rlhf] {name} model: {path} (found)")
            continue
        if not script_args.build_missing:
            raise FileNotFoundError(f"no {name} model at {path}; run recipes/{name}.py first or set build_missing")
        print(f"[hf_rlhf] {name} model: {path} is missing; building it now with recipes/{name}.py "
              f"--config {os.path.relpath(config)}")
        start = time.perf_counter()
        with _build_threads():
            _run_recipe(name, ["--config", config, "--output_dir", path, *extra])
        timings[f"{name}_s"] = round(time.perf_counter() - start, 1)
        print(f"[hf_rlhf] {name} model built in {timings[f'{name}_s']:.0f} s")


def load_reward_function(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"reward_function must look like 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------------
# Evaluation


def evaluate(policy, tokenizer, rows, reward_source, max_new_tokens: int, batch_size: int, toy: bool) -> dict:
    """Greedy completions of the held-out `rows`: mean training-reward `score`, and toy `exact_match` per family."""
    from hf_rlhf.toy import generate_completions, reward_fn
    from hf_rlhf.toy.tasks import task_of

    prompts = list(rows["prompt"])
    completions = generate_completions(policy, tokenizer, prompts, max_new_tokens, batch_size)
    fields = {name: list(rows[name]) for name in rows.column_names if name not in ("prompt", "input_ids")}
    scores = reward_source(prompts, completions, **fields)
    out = {"score": float(scores.float().mean())}
    if toy:
        correct = reward_fn(prompts, completions, list(rows["answer"]))
        out["exact_match"] = sum(correct) / len(correct)
        by_task: dict[str, list[float]] = {}
        for prompt, ok in zip(prompts, correct):
            by_task.setdefault(task_of(prompt), []).append(ok)
        out["exact_match_by_task"] = {task: sum(v) / len(v) for task, v in sorted(by_task.items())}
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


# ---------------------------------------------------------------------------------------------------


def build_callbacks(script_args, training_args, held_out, toy: bool) -> tuple[list, PlotCallback | None]:
    callbacks = [NonFiniteStopCallback()]
    if script_args.sample_prompts > 0 and held_out is not None:
        score_fn = None
        if toy:
            from hf_rlhf.toy import reward_fn

            score_fn = reward_fn
        callbacks.append(SampleCompletionsCallback(
            list(held_out["prompt"][:script_args.sample_prompts]), every_n_steps=script_args.sample_every,
            max_new_tokens=training_args.response_length, score_fn=score_fn))
    plot = None
    if script_args.plot:
        target = training_args.kl_target
        bands = {"objective/kl": (target * (1 - KL_BAND), target * (1 + KL_BAND))} if target else None
        plot = PlotCallback(PLOT_METRICS, filename="ppo_curves.png", titles=PLOT_TITLES, bands=bands)
        callbacks.append(plot)
    return callbacks, plot


def load_prompts(script_args, toy: bool):
    """(training prompts, held-out prompts or None)."""
    if toy:
        from hf_rlhf.toy import prompt_dataset

        return (prompt_dataset(script_args.toy_train_size, seed=script_args.toy_seed, split="train"),
                prompt_dataset(script_args.toy_test_size, seed=script_args.toy_seed, split="test"))
    train, test = load_text_dataset(script_args)
    if test is not None and len(test) > script_args.eval_size:
        test = test.select(range(script_args.eval_size))
    return train, test


def main(argv: list[str] | None = None) -> dict:
    script_args, model_config, training_args = parse_recipe_args(
        (ScriptArguments, ModelConfig, PPOConfig), argv, TOY_CONFIG)
    if script_args.num_threads:
        torch.set_num_threads(script_args.num_threads)
    toy = script_args.dataset_name is None and model_config.model_name_or_path is None
    timings: dict[str, float] = {}
    if toy:
        ensure_toy_models(script_args, timings)  # a single-process build uses every core, then num_threads again
        model_config.model_name_or_path = script_args.sft_model_path
    elif model_config.model_name_or_path is None:
        raise ValueError("give the policy with --model_name_or_path (the toy task runs when neither it nor "
                         "--dataset_name is given)")
    if script_args.reward_source == "function":
        reward, reward_name = load_reward_function(script_args.reward_function), script_args.reward_function
    else:
        reward, reward_name = script_args.reward_model_path, f"reward model {script_args.reward_model_path}"
    print(f"[hf_rlhf] PPO: policy {model_config.model_name_or_path}, reward {reward_name}")

    train, held_out = load_prompts(script_args, toy)
    callbacks, plot = build_callbacks(script_args, training_args, held_out, toy)
    trainer = PPOTrainer(model_config.model_name_or_path, reward, args=training_args, train_dataset=train,
                         model_config=model_config, callbacks=callbacks)
    tokenizer = trainer.processing_class

    def run_eval():
        if held_out is None:
            return {}
        start = time.perf_counter()
        policy = trainer.accelerator.unwrap_model(trainer.model).policy
        with unwrap_model_for_generation(policy, trainer.accelerator) as policy:  # ZeRO-3: every rank, gathered
            result = evaluate(policy, tokenizer, held_out, trainer.reward_source, training_args.response_length,
                              training_args.per_device_eval_batch_size, toy)
        timings["eval_s"] = round(timings.get("eval_s", 0.0) + time.perf_counter() - start, 1)
        return result

    before = run_eval()
    start = time.perf_counter()
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    timings["ppo_s"] = round(time.perf_counter() - start, 1)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the full log history (bench/kl_control.py reads the KL curve there)
    after = run_eval()

    results = {"before": {k: v for k, v in before.items() if k != "exact_match_by_task"},
               "after": {k: v for k, v in after.items() if k != "exact_match_by_task"},
               "kl": kl_summary(trainer.state.log_history, training_args.kl_target),
               "plots": {"curves": plot.path} if plot is not None and plot.path else {},
               "timings": timings, "train": train_result.metrics, "reward": reward_name,
               "policy": model_config.model_name_or_path, "task": "toy" if toy else script_args.dataset_name}
    if toy:
        results["exact_match_by_task"] = {"before": before["exact_match_by_task"],
                                          "after": after["exact_match_by_task"]}
    if trainer.is_world_process_zero():
        write_results(training_args.output_dir, results)
        print_outputs("PPO", training_args.output_dir, results)
        _print_kl(results["kl"], timings)
    return results


def _print_kl(kl: dict, timings: dict) -> None:
    if kl:
        target = f", target {kl['target']:.3g}" if kl.get("target") else " (fixed coefficient)"
        share = (f", {kl['within_25pct_second_half']:.0%} of logged steps within ±25 %"
                 if "within_25pct_second_half" in kl else "")
        print(f"  KL: final {kl['final']:.3f}, mean over the 2nd half {kl['mean_second_half']:.3f}{target}{share}; "
              f"β final {kl['coef_final']:.4g}")
    if timings:
        print("  seconds: " + ", ".join(f"{name.removesuffix('_s')} {value:.0f}" for name, value in timings.items()))


if __name__ == "__main__":
    main()
