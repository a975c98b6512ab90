"""KTO recipe: Kahneman-Tversky optimisation of a causal LM from completions labelled good or bad.

    python recipes/kto.py                                  # the embedded toy task, end to end on a CPU
    python recipes/kto.py --config recipes/configs/kto_toy.yaml --max_steps 5
    accelerate launch recipes/kto.py --model_name_or_path ./my_sft --dataset_name my_rows.jsonl --use_peft

Toy task: the policy is the SFT recipe's output (`sft_model_path`, default `outputs/sft`; built first with
recipes/sft.py when missing), which imitates the toy demonstrator's systematic slip. The toy task's preference pairs
(chosen: the right answer; rejected: a wrong one, `toy_rejected_slip_rate` of them the slip itself) are split into
unpaired rows (`label` True for the chosen, False for the rejected; `hf_rlhf.toy.unpaired_dataset`), KTO trains on
them, and the recipe prints greedy exact match on held-out prompts before and after.

With `--dataset_name` (and `--model_name_or_path`): a real model and unpaired rows (`prompt`, `completion`, `label`) or
preference pairs in any TRL format (split into unpaired rows); the held-out split's KTO metrics before and after.
Options are the fields of `ScriptArguments`, `ToyChainArguments`, `hf_rlhf.ModelConfig` and `hf_rlhf.KTOConfig`, on
the command line or in a YAML file (`--config`); unknown options are errors. Writes the model (or adapter), the
tokenizer and `<output_dir>/results.json`. `--resume_from_checkpoint true` resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hf_rlhf import KTOConfig, KTOTrainer, ModelConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.data_loading import load_text_dataset
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.printing import print_outputs
from hf_rlhf.cli.results import exit_after_stop, write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.toy.chain import ToyChainArguments, ensure_sft_policy, is_toy_run, preference_metrics

RECIPES = os.path.dirname(os.path.abspath(__file__))
TOY_CONFIG = os.path.join(RECIPES, "configs", "kto_toy.yaml")


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.parquet file "
                                        "of unpaired rows or preference pairs. None: the embedded toy task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="test", metadata={"help": "Held-out split (if present)."})
    toy_rejected_slip_rate: float = field(
        default=0.5, metadata={"help": "Toy task: share of pairs whose rejected answer is the demonstrator's slip."})
    max_new_tokens: int = field(default=8, metadata={"help": "Toy task: greedy answer length for exact match."})


def toy_data(script_args, toy_args, model_config):
    """(train rows, held-out rows, held-out prompts): the SFT policy built first when missing. `toy_train_size` /
    `toy_test_size` count pairs; each gives two unpaired rows."""
    from hf_rlhf.cli.errors import RecipeOptionError
    from hf_rlhf.toy import prompt_dataset, unpaired_dataset

    if toy_args.toy_task != "arithmetic":
        raise RecipeOptionError(f"recipes/kto.py: the toy task is arithmetic only (--toy_task {toy_args.toy_task} is "
                                "the PPO recipe's)")
    ensure_sft_policy(toy_args, model_config, RECIPES)
    rows = {split: unpaired_dataset(size, seed=toy_args.toy_seed, split=split,
                                    rejected_slip_rate=script_args.toy_rejected_slip_rate)
            for split, size in (("train", toy_args.toy_train_size), ("test", min(toy_args.toy_test_size, 100)))}
    return rows["train"], rows["test"], prompt_dataset(toy_args.toy_test_size, seed=toy_args.toy_seed, split="test")


def main(argv: list[str] | None = None) -> dict:
    script_args, toy_args, model_config, args = parse_recipe_args(
        (ScriptArguments, ToyChainArguments, ModelConfig, KTOConfig), argv, TOY_CONFIG)
    toy = is_toy_run(script_args)
    resume = resume_argument(args.resume_from_checkpoint)
    if toy:  # the data first: a bad row fails before any model is loaded
        train, test, prompts = toy_data(script_args, toy_args, model_config)
    else:
        from hf_rlhf.data.kto import check_kto_rows

        train, test = load_text_dataset(script_args, lambda rows: check_kto_rows(rows, args))
        prompts = None
        if model_config.model_name_or_path is None:
            raise ValueError("give the policy with --model_name_or_path")
    print(f"[hf_rlhf] KTO ({args.loss_type}): policy {model_config.model_name_or_path}")
    trainer = KTOTrainer(model_config.model_name_or_path, args=args, train_dataset=train, eval_dataset=test,
                         model_config=model_config)

    def evaluate() -> dict:
        return preference_metrics(trainer, prompts, test, script_args.max_new_tokens, args.per_device_eval_batch_size,
                                  ("loss", "rewards/margins", "kl"))

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
        print_outputs("KTO", args.output_dir, results)
    return results


if __name__ == "__main__":
    run_recipe(main)
