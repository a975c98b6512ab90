"""On-policy distillation recipe: a student trained toward a teacher's next-token distributions (GKD).

    python recipes/distill.py                                  # the embedded toy task, end to end on a CPU
    python recipes/distill.py --config recipes/configs/distill_toy.yaml --max_steps 5
    accelerate launch recipes/distill.py --model_name_or_path <student> --teacher_model_name_or_path <teacher> \
        --dataset_name <prompts>

Toy task: the teacher is the PPO recipe's policy (`ppo_model_path`, default `outputs/ppo`, a 0.9M 4-layer Llama;
built first with recipes/ppo.py, and its SFT policy with recipes/sft.py, when missing; `--toy_teacher sft`: the SFT
policy at `sft_model_path` instead); the student is the teacher with three of its four decoder layers
(`student_layers`: DistilBERT's initialisation, 3/4 of the parameters; or any model at `student_model_path`). It is
distilled on its own samples of the training prompts (`lmbda` of the rollouts; the rest are the teacher's greedy
answers), and, for comparison, the same student is trained by SFT on the teacher's greedy answers to the same prompts
with the same number of samples (off-policy distillation). Printed and written to results.json: held-out greedy exact
match of the teacher (`teacher.exact_match`), of the student before (`before`), after distillation (`after`) and
after SFT on the teacher's outputs (`sft_on_teacher_outputs`).

With `--dataset_name` (and `--model_name_or_path`, `--teacher_model_name_or_path`): prompt rows (a `prompt` or
`messages` column), and the held-out split's `eval_loss` (the divergence) before and after. Options are the fields
of `ScriptArguments`, `ToyChainArguments`, `hf_rlhf.ModelConfig` and `hf_rlhf.DistillationConfig`, on the command
line or in a YAML file (`--config`); unknown options are errors. Writes the student (or adapter), the tokenizer and
`<output_dir>/results.json`. `--resume_from_checkpoint true` resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hf_rlhf import DistillationConfig, DistillationTrainer, ModelConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.data_loading import load_text_dataset
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.printing import print_outputs
from hf_rlhf.cli.results import exit_after_stop, write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.toy.chain import ToyChainArguments, build_with_recipe, is_model_dir, is_toy_run

RECIPES = os.path.dirname(os.path.abspath(__file__))
TOY_CONFIG = os.path.join(RECIPES, "configs", "distill_toy.yaml")


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.parquet file "
                                        "of prompts. None: the embedded toy task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="test", metadata={"help": "Held-out split (if present)."})
    toy_teacher: str = field(
        default="ppo", metadata={"help": "Toy task: the teacher: the PPO recipe's policy (`ppo_model_path`, built with "
                                         "recipes/ppo.py from `sft_model_path` when missing) or the SFT recipe's "
                                         "(`sft_model_path`).", "choices": ["ppo", "sft"]})
    ppo_model_path: str = field(
        default="outputs/ppo", metadata={"help": "Toy task: the PPO recipe's policy (the `toy_teacher ppo`)."})
    ppo_config: str | None = field(
        default=None, metadata={"help": "Toy task: the config the PPO teacher is built with "
                                        "(None: recipes/configs/ppo_toy.yaml)."})
    student_model_path: str | None = field(
        default=None, metadata={"help": "Toy task: the student to start from. None: the teacher with only its "
                                        "`student_layers` decoder layers (saved as <output_dir>/student_init)."})
    student_layers: str = field(
        default="0,1,3", metadata={"help": "Toy task: the teacher's decoder layers the student keeps "
                                           "(comma-separated)."})
    compare_sft: bool = field(
        default=True, metadata={"help": "Toy task: also train the student by SFT on the teacher's greedy answers "
                                        "(the same number of samples) and report it beside the distilled one."})
    sft_learning_rate: float | None = field(
        default=None, metadata={"help": "Toy task: the SFT comparison's learning rate (None: the distillation's)."})
    max_new_tokens: int = field(default=8, metadata={"help": "Toy task: greedy answer length for exact match."})
    num_threads: int | None = field(default=None, metadata={"help": "torch intra-op threads (None: torch's)."})


def build_missing(path: str, script: str, config: str, threads: int | None, allowed: bool,
                  extra: tuple[str, ...] = ()) -> float:
    """Build the model at `path` with recipes/`script`, `config` and the `extra` options when it is missing; the
    seconds it took."""
    if is_model_dir(path):
        print(f"[hf_rlhf] {path}: found")
        return 0.0
    if not allowed:
        raise FileNotFoundError(f"no model at {path}; run recipes/{script} --config {config} first")
    print(f"[hf_rlhf] {path} is missing; building it with recipes/{script} --config {os.path.relpath(config)}",
          flush=True)
    start = time.perf_counter()
    build_with_recipe(os.path.join(RECIPES, script), ["--config", config, "--output_dir", path, *extra], threads)
    return round(time.perf_counter() - start, 1)


def toy_data(script_args, toy_args, model_config, args) -> dict:
    """The toy run's models (built when missing), the teacher's greedy answers to the train prompts, held-out rows."""
    from hf_rlhf.cli.errors import RecipeOptionError
    from hf_rlhf.toy import prompt_dataset

    if toy_args.toy_task != "arithmetic":
        raise RecipeOptionError(f"recipes/distill.py: the toy task is arithmetic only (--toy_task "
                                f"{toy_args.toy_task} is the PPO recipe's)")
    timings = {}
    if args.teacher_model_name_or_path is None:
        sft_config = toy_args.sft_config or os.path.join(RECIPES, "configs", "sft_toy.yaml")
        if script_args.toy_teacher == "sft":
            path, script, config, extra = toy_args.sft_model_path, "sft.py", sft_config, ()
        else:  # recipes/ppo.py builds its SFT policy first when that is missing too
            path, script, extra = script_args.ppo_model_path, "ppo.py", ("--sft_model_path", toy_args.sft_model_path)
            config = script_args.ppo_config or os.path.join(RECIPES, "configs", "ppo_toy.yaml")
            if toy_args.sft_config is not None:
                extra += ("--sft_config", toy_args.sft_config)
        timings["teacher_build_s"] = build_missing(path, script, config, toy_args.build_threads,
                                                   toy_args.build_missing, extra)
        args.teacher_model_name_or_path = path
    if model_config.model_name_or_path is None and script_args.student_model_path is not None:
        model_config.model_name_or_path = script_args.student_model_path
    return {"train": prompt_dataset(toy_args.toy_train_size, seed=toy_args.toy_seed + 1, split="train"),
            "held_out": prompt_dataset(toy_args.toy_test_size, seed=toy_args.toy_seed, split="test"),
            "timings": timings}


def exact_match(model, tokenizer, rows, script_args, batch_size: int) -> dict:
    import torch

    from hf_rlhf.cli.evaluation import evaluate_completions
    from hf_rlhf.toy import reward_fn
    from hf_rlhf.toy.chain import check_answers

    def reward(p, c, **columns):
        return torch.tensor(reward_fn(p, c, **columns), dtype=torch.float)

    out = evaluate_completions(model, tokenizer, rows, reward, script_args.max_new_tokens, batch_size, check_answers)
    return {"exact_match": out["exact_match"]}


def student_from_teacher(teacher, tokenizer, script_args, output_dir: str) -> str:
    """The teacher with only its `student_layers` decoder layers, saved under `output_dir`; its path."""
    from hf_rlhf.toy.models import keep_layers

    layers = [int(i) for i in script_args.student_layers.split(",")]
    path = os.path.join(output_dir, "student_init")
    keep_layers(teacher, layers).save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"[hf_rlhf] student: the teacher's decoder layers {layers} ({path})", flush=True)
    return path


def teacher_answers(teacher, tokenizer, rows, script_args, batch_size: int):
    """The training prompts with the teacher's greedy answers as `completion` (rows it left empty are dropped)."""
    from datasets import Dataset

    from hf_rlhf.generation import generate_completions

    answers = generate_completions(teacher, tokenizer, list(rows["prompt"]), script_args.max_new_tokens, batch_size)
    kept = [{"prompt": p, "completion": a.strip()} for p, a in zip(rows["prompt"], answers) if a.strip()]
    return Dataset.from_list(kept)


def sft_on_teacher_answers(student_path, tokenizer, rows, args, script_args) -> object:
    """The off-policy comparison: the student trained by SFT on the teacher's answers, as many samples."""
    from hf_rlhf import SFTConfig, SFTTrainer

    samples = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    config = SFTConfig(output_dir=os.path.join(args.output_dir, "sft_on_teacher_outputs"),
                       per_device_train_batch_size=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                       max_steps=args.max_steps, learning_rate=script_args.sft_learning_rate or args.learning_rate,
                       lr_scheduler_type=args.lr_scheduler_type, warmup_steps=args.warmup_steps,
                       logging_steps=args.logging_steps, save_strategy="no", report_to="none", seed=args.seed,
                       max_length=64, disable_tqdm=args.disable_tqdm)
    trainer = SFTTrainer(student_path, args=config, train_dataset=rows.select(range(min(samples, len(rows)))),
                         processing_class=tokenizer)
    trainer.train()
    return trainer.accelerator.unwrap_model(trainer.model)


def print_table(results: dict) -> None:
    rows = [("teacher", results["teacher"]), ("student before", results["before"]),
            ("student, on-policy distillation", results["after"])]
    if "sft_on_teacher_outputs" in results:
        rows.append(("student, SFT on the teacher's answers", results["sft_on_teacher_outputs"]))
    print("\n| model | held-out exact match |\n|---|---|")
    for name, metrics in rows:
        print(f"| {name} | {metrics.get('exact_match', float('nan')):.3f} |")


def main(argv: list[str] | None = None) -> dict:
    script_args, toy_args, model_config, args = parse_recipe_args(
        (ScriptArguments, ToyChainArguments, ModelConfig, DistillationConfig), argv, TOY_CONFIG)
    if script_args.num_threads:
        import torch

        torch.set_num_threads(script_args.num_threads)
    toy = is_toy_run(script_args)
    resume = resume_argument(args.resume_from_checkpoint)
    start = time.perf_counter()
    if toy:  # the data and prerequisites first: a bad option fails before any model is loaded
        data = toy_data(script_args, toy_args, model_config, args)
        train, test = data["train"], None
    else:
        from hf_rlhf.rollout.loader import validate_prompt_dataset

        train, test = load_text_dataset(script_args, validate_prompt_dataset)
        if model_config.model_name_or_path is None or args.teacher_model_name_or_path is None:
            raise ValueError("give the student with --model_name_or_path and the teacher with "
                             "--teacher_model_name_or_path")
        data = {"timings": {}}
    results = {"task": "toy" if toy else script_args.dataset_name, "student": model_config.model_name_or_path,
               "teacher_path": args.teacher_model_name_or_path}
    batch = args.per_device_eval_batch_size
    if toy:
        from hf_rlhf.models.loading import load_model, load_tokenizer

        teacher_config = ModelConfig(model_name_or_path=args.teacher_model_name_or_path)
        teacher, tokenizer = load_model(teacher_config), load_tokenizer(teacher_config)
        if model_config.model_name_or_path is None:  # the teacher's own weights, half of its layers
            model_config.model_name_or_path = student_from_teacher(teacher, tokenizer, script_args, args.output_dir)
        results["teacher"] = exact_match(teacher, tokenizer, data["held_out"], script_args, batch)
        train = teacher_answers(teacher, tokenizer, train, script_args, batch)
        del teacher
    print(f"[hf_rlhf] distillation: student {model_config.model_name_or_path}, teacher "
          f"{args.teacher_model_name_or_path} (beta={args.beta}, lmbda={args.lmbda})", flush=True)
    trainer = DistillationTrainer(model_config.model_name_or_path, args=args, train_dataset=train, eval_dataset=test,
                                  model_config=model_config)

    def evaluate() -> dict:
        if toy:
            model = trainer.accelerator.unwrap_model(trainer.model).policy
            return exact_match(model, trainer.processing_class, data["held_out"], script_args, batch)
        return {"loss": trainer.evaluate()["eval_loss"]} if test is not None else {}

    results["before"] = evaluate()
    train_start = time.perf_counter()
    metrics = train_run(trainer, resume)
    results["train"], results["train_s"] = metrics, round(time.perf_counter() - train_start, 1)
    exit_after_stop(trainer, args.output_dir, metrics, {"before": results["before"]})
    trainer.save_model(args.output_dir)
    results["after"] = evaluate()
    if toy and script_args.compare_sft:
        sft_start = time.perf_counter()
        student = sft_on_teacher_answers(model_config.model_name_or_path, trainer.processing_class, train, args,
                                         script_args)
        results["sft_on_teacher_outputs"] = exact_match(student, trainer.processing_class, data["held_out"],
                                                        script_args, batch)
        results["sft_s"] = round(time.perf_counter() - sft_start, 1)
    if toy:
        results["share_of_teacher"] = round(results["after"]["exact_match"] /
                                            max(results["teacher"]["exact_match"], 1e-9), 3)
    results["timings"] = data["timings"]
    results["wall_s"] = round(time.perf_counter() - start - sum(data["timings"].values()), 1)
    if trainer.is_world_process_zero():
        write_results(args.output_dir, results)
        print_outputs("distillation", args.output_dir, results)
        if toy:
            print_table(results)
    return results


if __name__ == "__main__":
    run_recipe(main)
