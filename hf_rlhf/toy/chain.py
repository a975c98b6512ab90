"""The toy chain behind the recipes' no-argument runs: SFT -> reward model -> PPO on the embedded toy task.

The recipes call three things here: `is_toy_run` (the one place that decides it), `prepare_toy_base` (a fresh toy
model for the SFT and reward recipes) and `toy_chain` (the PPO recipe's prompts, ground-truth check, and its
prerequisites: a missing SFT policy or reward model is built first by running that recipe, in this process or, under
a multi-process launch, in a single-process child). The PPO recipe has two toy tasks (`toy_task`): the arithmetic of
`hf_rlhf.toy.tasks`, and the tool task of `hf_rlhf.toy.tool_task` (arithmetic with a calculator the policy calls; the
tool itself is the recipe's `--tools`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..cli.data_loading import PromptData, load_text_dataset
from ..cli.errors import RecipeOptionError
from .tasks import prompt_dataset, reward_fn, task_of

# a child started from a rank of a multi-process launch must not join that launch's process group
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                   "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass
class ToyChainArguments:
    """Options of the toy chain (used only when no `dataset_name` is given)."""

    sft_model_path: str = field(
        default="outputs/sft", metadata={"help": "Toy task: the policy to start from (the SFT recipe's output); "
                                                 "built with recipes/sft.py when missing and build_missing is set."})
    build_missing: bool = field(
        default=True, metadata={"help": "Toy task: build a missing SFT / reward model with its recipe first."})
    sft_config: str | None = field(
        default=None, metadata={"help": "Toy task: the config the SFT model is built with "
                                        "(None: recipes/configs/sft_toy.yaml)."})
    reward_config: str | None = field(
        default=None, metadata={"help": "Toy task: the config the reward model is built with "
                                        "(None: recipes/configs/reward_toy.yaml)."})
    toy_train_size: int = field(default=4096, metadata={"help": "Toy task: training prompts."})
    toy_test_size: int = field(default=400, metadata={"help": "Toy task: held-out prompts for evaluation."})
    toy_seed: int = field(default=0, metadata={"help": "Seed of the toy prompts."})
    toy_task: str = field(default="arithmetic", metadata={
        "help": "Toy task: arithmetic (hf_rlhf.toy.tasks) or tools (arithmetic with a calculator tool, "
                "hf_rlhf.toy.tool_task: its SFT policy is built with recipes/configs/sft_tools_toy.yaml; give the "
                "tool with --tools; PPO recipe only).", "choices": ["arithmetic", "tools"]})
    toy_tool_operation: str = field(default="multiply", metadata={
        "help": "Toy tools task: the operation of the prompts.", "choices": ["add", "multiply"]})
    toy_tool_digits: int = field(default=3, metadata={"help": "Toy tools task: digits of each operand."})
    build_threads: int | None = field(
        default=None, metadata={"help": "Toy task: torch threads of a single-process build (None: every core). The "
                                        "built model depends on it, as float sums do."})


def is_toy_run(script_args) -> bool:
    """True when a recipe runs on the embedded toy task: no `dataset_name` was given."""
    return getattr(script_args, "dataset_name", None) is None


def check_answers(prompts: list, completions: list[str], rows) -> dict:
    """Ground-truth exact match of `completions`, overall and per task family.

    Returns:
        {"exact_match": float, "exact_match_by_task": {family: float}}.
    """
    correct = reward_fn(prompts, completions, list(rows["answer"]))
    by_task: dict[str, list[float]] = {}
    for prompt, ok in zip(prompts, correct):
        by_task.setdefault(task_of(prompt), []).append(ok)
    return {"exact_match": sum(correct) / len(correct),
            "exact_match_by_task": {task: sum(v) / len(v) for task, v in sorted(by_task.items())}}


TOY_REWARD_FUNCTION = "hf_rlhf.toy:reward_fn"
TOOL_REWARD_FUNCTION = "hf_rlhf.toy:tool_reward"


def toy_chain(script_args, toy_args: ToyChainArguments, model_config, recipes_dir: str) -> PromptData:
    """The PPO recipe's toy task: its prerequisites built, the policy path set, its prompts and checks.

    Args:
        script_args: the PPO recipe's options (`reward_source`, `reward_model_path`, `reward_function`: the toy
            task's verifiable reward when `reward_source` is function and none is named).
        toy_args: the toy chain's options.
        model_config: `model_name_or_path` is set to the SFT policy unless given.
        recipes_dir: the directory holding sft.py, reward.py and configs/.

    Returns:
        `PromptData` with the toy train / held-out prompts, the ground-truth check, the verifiable reward for
        logged samples, and the build timings ({"sft_s", "reward_s"} for what was built).
    """
    timings: dict[str, float] = {}
    needed = []
    tools_task = toy_args.toy_task == "tools"
    if tools_task and script_args.reward_source != "function":
        raise RecipeOptionError("the toy tools task has no reward model: use --reward_source function (its reward, "
                                f"{TOOL_REWARD_FUNCTION}, checks the final answer)")
    if script_args.reward_source == "function" and not getattr(script_args, "reward_function", None):
        # the toy task's own reward: its verifiable exact match
        script_args.reward_function = TOOL_REWARD_FUNCTION if tools_task else TOY_REWARD_FUNCTION
    if model_config.model_name_or_path is None:
        config = toy_args.sft_config or os.path.join(recipes_dir, "configs",
                                                     "sft_tools_toy.yaml" if tools_task else "sft_toy.yaml")
        needed.append(("sft", toy_args.sft_model_path, config, []))
        model_config.model_name_or_path = toy_args.sft_model_path
    if script_args.reward_source == "model":
        config = toy_args.reward_config or os.path.join(recipes_dir, "configs", "reward_toy.yaml")
        needed.append(("reward", script_args.reward_model_path, config,
                       ["--sft_model_path", toy_args.sft_model_path]))
    for name, path, config, extra in needed:
        if is_model_dir(path):
            print(f"[hf_rlhf] {name} model: {path} (found)")
            continue
        if not toy_args.build_missing:
            raise FileNotFoundError(f"no {name} model at {path}; run recipes/{name}.py first or set build_missing")
        print(f"[hf_rlhf] {name} model: {path} is missing; building it now with recipes/{name}.py "
              f"--config {os.path.relpath(config)}", flush=True)
        start = time.perf_counter()
        build_with_recipe(os.path.join(recipes_dir, f"{name}.py"), ["--config", config, "--output_dir", path, *extra],
                          threads=toy_args.build_threads)
        timings[f"{name}_s"] = round(time.perf_counter() - start, 1)
        print(f"[hf_rlhf] {name} model built in {timings[f'{name}_s']:.0f} s")
    if tools_task:
        from .tool_task import TEST_SEED_OFFSET, check_tool_answers, tool_prompt_dataset, tool_reward

        task = {"digits": toy_args.toy_tool_digits, "operation": toy_args.toy_tool_operation}
        # the SFT demonstrations are drawn with toy_seed, the held-out prompts as recipes/sft.py draws them
        return PromptData(train=tool_prompt_dataset(toy_args.toy_train_size, seed=toy_args.toy_seed + 1, **task),
                          held_out=tool_prompt_dataset(toy_args.toy_test_size,
                                                       seed=toy_args.toy_seed + TEST_SEED_OFFSET, **task),
                          check=check_tool_answers, score_fn=tool_reward, timings=timings)
    return PromptData(
        train=prompt_dataset(toy_args.toy_train_size, seed=toy_args.toy_seed, split="train"),
        held_out=prompt_dataset(toy_args.toy_test_size, seed=toy_args.toy_seed, split="test"),
        check=check_answers, score_fn=reward_fn, timings=timings)


def is_model_dir(path: str) -> bool:
    """A directory holding a saved model or a LoRA adapter."""
    return os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(
        os.path.join(path, "adapter_config.json"))


def build_thread_count(threads: int | None = None) -> int:
    """Torch threads of a single-process build: `threads`, else every core this process may run on.

    `accelerate launch` sets OMP_NUM_THREADS=1 in every process it starts, a single one included; on a free 2-core
    machine the SFT build (packed batches of 8 x 128 tokens) runs about 1.5x faster on both cores (304 s -> 207 s
    measured). Every core, not the cores free at the moment: the built model may depend on the thread count (float
    sums) and must not depend on the machine's load.
    """
    if threads is not None:
        return threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def build_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a recipe run started as a child of a rank of a multi-process launch: the launch's process
    group variables removed (the child is a run of its own), the launcher's threads kept (the other ranks hold the
    other cores)."""
    env = dict(os.environ if environ is None else environ)
    for name in DISTRIBUTED_ENV:
        env.pop(name, None)
    return env


def run_recipe_here(script: str, argv: list[str], threads: int) -> None:
    """Run the recipe file `script`'s `main(argv)` in this process, on `threads` torch threads (restored after).

    The same model as a child process started with OMP_NUM_THREADS=`threads` would build, bit for bit
    (tests/integration/test_cli.py), without the child's start: its imports alone (`transformers.trainer`, peft,
    bitsandbytes) take ~15 s on 2 CPU cores. Every random stream the recipe uses is seeded by the recipe itself
    (the toy model's init under a forked RNG, the Trainer's `set_seed`).

    Raises:
        RuntimeError: the recipe exited with a non-zero status (with its message).
    """
    import gc

    import torch

    from ..cli.recipes import load_recipe_file

    recipe = load_recipe_file(script)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        recipe.main(list(argv))
    except SystemExit as e:  # a recipe's own exit (a non-finite stop: its message)
        if e.code not in (None, 0):
            raise RuntimeError(f"building a toy prerequisite failed ({e.code}): {script} {' '.join(argv)}") from None
    finally:
        torch.set_num_threads(previous)
        gc.collect()  # the build's trainer, model and optimizer


def build_with_recipe(script: str, argv: list[str], threads: int | None = None) -> None:
    """Build a toy prerequisite with the recipe `script` and `argv`, as a single-process run.

    A single-process run (`python recipes/ppo.py`, `accelerate launch` with one process) builds in its own process
    (`run_recipe_here`) on `build_thread_count(threads)` threads. Under a multi-process launch the main process runs
    it in a single-process child (`build_environment`: on the launcher's threads) while the other ranks wait, then
    find the model built.

    Args:
        threads: torch threads of a single-process build (`build_thread_count`).

    Raises:
        RuntimeError: the recipe exited with a non-zero status.
    """
    from accelerate import PartialState

    state = PartialState()
    if state.num_processes == 1:
        run_recipe_here(script, argv, build_thread_count(threads))
        return
    with state.main_process_first():  # the other ranks wait, then find the model built
        if state.is_main_process:
            done = subprocess.run([sys.executable, script, *argv], env=build_environment())
            if done.returncode != 0:
                raise RuntimeError(f"building a toy prerequisite failed (exit {done.returncode}): "
                                   f"{sys.executable} {script} {' '.join(argv)}")


def ensure_sft_policy(toy_args, model_config, recipes_dir: str) -> None:
    """The preference recipes' policy (DPO, KTO): `model_config.model_name_or_path`, else the toy SFT policy at
    `toy_args.sft_model_path`, built first with recipes/sft.py when missing (unless `build_missing` is off)."""
    if model_config.model_name_or_path is not None:
        return
    if not is_model_dir(toy_args.sft_model_path):
        if not toy_args.build_missing:
            raise FileNotFoundError(f"no SFT model at {toy_args.sft_model_path}; run recipes/sft.py first")
        config = toy_args.sft_config or os.path.join(recipes_dir, "configs", "sft_toy.yaml")
        print(f"[hf_rlhf] SFT policy {toy_args.sft_model_path} is missing; building it with recipes/sft.py",
              flush=True)
        build_with_recipe(os.path.join(recipes_dir, "sft.py"), ["--config", config, "--output_dir",
                                                                 toy_args.sft_model_path], toy_args.build_threads)
    model_config.model_name_or_path = toy_args.sft_model_path


def preference_toy_data(recipe: str, build_rows, script_args, toy_args, model_config, recipes_dir: str,
                        max_test: int) -> tuple:
    """The preference recipes' toy data (DPO, KTO): (train rows, held-out rows, held-out prompts), the SFT policy
    built first when missing. `build_rows(size, seed=, split=, rejected_slip_rate=)` is the toy's row builder
    (`preference_dataset`, `unpaired_dataset`); the held-out rows are at most `max_test` of `toy_test_size`."""
    if toy_args.toy_task != "arithmetic":
        raise RecipeOptionError(f"recipes/{recipe}.py: the toy task is arithmetic only (--toy_task "
                                f"{toy_args.toy_task} is the PPO recipe's)")
    ensure_sft_policy(toy_args, model_config, recipes_dir)
    rows = {split: build_rows(size, seed=toy_args.toy_seed, split=split,
                              rejected_slip_rate=script_args.toy_rejected_slip_rate)
            for split, size in (("train", toy_args.toy_train_size), ("test", min(toy_args.toy_test_size, max_test)))}
    return rows["train"], rows["test"], prompt_dataset(toy_args.toy_test_size, seed=toy_args.toy_seed, split="test")


def run_preference_recipe(name: str, trainer_class, parsed: tuple, toy_data, check_rows, metric_keys: tuple[str, ...],
                          detail: str) -> dict:
    """The DPO and KTO recipes after parsing: the data (the toy's, or `--dataset_name` with every row checked by
    `check_rows(rows, args)`) before any model loads, the trainer, the held-out figures before and after training,
    the model and results.json written (on the main process).

    Args:
        parsed: (script_args, toy_args, model_config, args) as `parse_recipe_args` returns them.
        toy_data: `(script_args, toy_args, model_config) -> (train, test, prompts)` for the toy run.
        metric_keys: the `eval_<key>` metrics reported beside the exact match.
        detail: what the start line names besides the policy (the loss type).
    """
    from ..cli.printing import print_outputs
    from ..cli.results import exit_after_stop, write_results
    from ..cli.resume import resume_argument, train_run

    script_args, toy_args, model_config, args = parsed
    toy = is_toy_run(script_args)
    resume = resume_argument(args.resume_from_checkpoint)
    if toy:  # the data first: a bad row fails before any model is loaded
        train, test, prompts = toy_data(script_args, toy_args, model_config)
    else:
        train, test = load_text_dataset(script_args, lambda rows: check_rows(rows, args))
        prompts = None
        if model_config.model_name_or_path is None:
            raise ValueError("give the policy with --model_name_or_path")
    print(f"[hf_rlhf] {name} ({detail}): policy {model_config.model_name_or_path}")
    trainer = trainer_class(model_config.model_name_or_path, args=args, train_dataset=train, eval_dataset=test,
                            model_config=model_config)

    def evaluate() -> dict:
        return preference_metrics(trainer, prompts, test, script_args.max_new_tokens, args.per_device_eval_batch_size,
                                  metric_keys)

    start = time.perf_counter()
    before = evaluate()
    metrics = train_run(trainer, resume)
    task = "toy" if toy else script_args.dataset_name
    exit_after_stop(trainer, args.output_dir, metrics, {"before": before, "task": task})
    trainer.save_model(args.output_dir)
    after = evaluate()
    results = {"before": before, "after": after, "train": metrics, "task": task,
               "policy": model_config.model_name_or_path, "wall_s": round(time.perf_counter() - start, 1)}
    if trainer.is_world_process_zero():
        write_results(args.output_dir, results)
        print_outputs(name, args.output_dir, results)
    return results


def preference_metrics(trainer, prompts, test, max_new_tokens: int, batch_size: int, keys: tuple[str, ...]) -> dict:
    """The preference recipes' before / after figures: greedy exact match on the toy's held-out `prompts` (when
    given) and the held-out split's `eval_<key>` metrics (when `test` is given)."""
    out = {}
    if prompts is not None:
        import torch

        from ..cli.evaluation import evaluate_completions

        def reward(p, c, **columns):  # the toy check as a reward tensor (1: right answer)
            return torch.tensor(reward_fn(p, c, **columns), dtype=torch.float)

        model = trainer.accelerator.unwrap_model(trainer.model)
        out.update({k: v for k, v in evaluate_completions(
            model, trainer.processing_class, prompts, reward, max_new_tokens, batch_size, check_answers).items()
            if not isinstance(v, dict)})
    if test is not None:
        metrics = trainer.evaluate()
        out.update({k: metrics[f"eval_{k}"] for k in keys if f"eval_{k}" in metrics})
    return out


def prepare_toy_base(model_config, training_args, size: str, seed: int, reward: bool = False, tools: bool = False):
    """Build the toy tokenizer (`tools`: the one whose chat template renders tool calls) and a freshly initialised
    toy model.

    The base is saved under `<output_dir>/base` and `model_config.model_name_or_path` points there, so
    that a LoRA adapter records a base it can be reloaded from, and QLoRA loads that base in 4 bit
    through the ordinary `from_pretrained` path.

    Returns:
        (model, tokenizer).
    """
    from ..models.loading import load_model
    from .models import build_toy_model, build_toy_reward_model
    from .tokenizer import build_toy_tokenizer, build_toy_tool_tokenizer

    tokenizer = build_toy_tool_tokenizer() if tools else build_toy_tokenizer()
    model = (build_toy_reward_model if reward else build_toy_model)(tokenizer, size=size, seed=seed)
    if not model_config.use_peft:
        return model, tokenizer
    base_dir = os.path.join(training_args.output_dir, "base")
    if training_args.process_index == 0:
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    if training_args.world_size > 1:
        from accelerate import PartialState

        PartialState().wait_for_everyone()
    model_config.model_name_or_path = base_dir
    if model_config.load_in_4bit or model_config.load_in_8bit:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
        model = load_model(model_config, cls, **({"num_labels": 1} if reward else {}))
    else:
        model.config._name_or_path = base_dir
        model.name_or_path = base_dir
    return model, tokenizer
