"""DPO recipe: direct preference optimisation of a causal LM (every TRL loss type, SimPO, ORPO).

    python recipes/dpo.py                                  # the embedded toy task, end to end on a CPU
    python recipes/dpo.py --config recipes/configs/dpo_toy.yaml --max_steps 5
    accelerate launch recipes/dpo.py --config recipes/configs/dpo_qwen_lora.yaml

Toy task: the policy is the SFT recipe's output (`sft_model_path`, default `outputs/sft`; built first with
recipes/sft.py when missing), which imitates the toy demonstrator's systematic slip. DPO trains it on generated
pairs whose chosen answer is right and rejected one wrong (`toy_rejected_slip_rate` of them the slip itself), and the
recipe prints greedy exact match on held-out prompts before and after.

With `--dataset_name` (and `--model_name_or_path`): a real model and a preference dataset in any TRL format; the
held-out split's DPO metrics (reward accuracy, margin) before and after. Options are the fields of
`ScriptArguments`, `ToyChainArguments`, `hf_rlhf.ModelConfig` and `hf_rlhf.DPOConfig`, on the command line or in a
YAML file (`--config`); unknown options are errors. Writes the model (or adapter), the tokenizer and
`<output_dir>/results.json`. `--resume_from_checkpoint true` resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hf_rlhf import DPOConfig, DPOTrainer, ModelConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.data_loading import load_text_dataset
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.cli.printing import print_outputs
from hf_rlhf.cli.results import exit_after_stop, write_results
from hf_rlhf.cli.resume import resume_argument, train_run
from hf_rlhf.toy.chain import ToyChainArguments, ensure_sft_policy, is_toy_run, preference_metrics

RECIPES = os.path.dirname(os.path.abspath(__file__))
TOY_CONFIG = os.path.join(RECIPES, "configs", "dpo_toy.yaml")


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.parquet file "
                                        "of preference pairs. None: the embedded toy task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="test", metadata={"help": "Held-out split (if present)."})
    toy_rejected_slip_rate: float = field(
        default=0.5, metadata={"help": "Toy task: share of pairs whose rejected answer is the demonstrator's slip."})
    max_new_tokens: int = field(default=8, metadata={"help": "Toy task: greedy answer length for exact match."})


def toy_data(script_args, toy_args, model_config):
    """(train pairs, held-out pairs, held-out prompts): the SFT policy built first when missing."""
    from hf_rlhf.cli.errors import RecipeOptionError
    from hf_rlhf.toy import preference_dataset, prompt_dataset

    if toy_args.toy_task != "arithmetic":
        raise RecipeOptionError(f"recipes/dpo.py: the toy task is arithmetic only (--toy_task {toy_args.toy_task} is "
                                "the PPO recipe's)")
    ensure_sft_policy(toy_args, model_config, RECIPES)
    pairs = {split: preference_dataset(size, seed=toy_args.toy_seed, split=split,
                                       rejected_slip_rate=script_args.toy_rejected_slip_rate)
             for split, size in (("train", toy_args.toy_train_size), ("test", min(toy_args.toy_test_size, 200)))}
    return pairs["train"], pairs["test"], prompt_dataset(toy_args.toy_test_size, seed=toy_args.toy_seed, split="test")


def main(argv: list[str] | None = None) -> dict:
    script_args, toy_args, model_config, args = parse_recipe_args(
        (ScriptArguments, ToyChainArguments, ModelConfig, DPOConfig), argv, TOY_CONFIG)
    toy = is_toy_run(script_args)
    resume = resume_argument(args.resume_from_checkpoint)
    if toy:  # the data first: a bad row fails before any model is loaded
        train, test, prompts = toy_data(script_args, toy_args, model_config)
    else:
        from hf_rlhf.data.dpo import check_dpo_rows

        train, test = load_text_dataset(script_args, lambda rows: check_dpo_rows(rows, args))
        prompts = None
        if model_config.model_name_or_path is None:
            raise ValueError("give the policy with --model_name_or_path")
    print(f"[hf_rlhf] DPO ({'+'.join(args.loss_type)}): policy {model_config.model_name_or_path}")
    trainer = DPOTrainer(model_config.model_name_or_path, args=args, train_dataset=train, eval_dataset=test,
                         model_config=model_config)

    def evaluate() -> dict:
        return preference_metrics(trainer, prompts, test, script_args.max_new_tokens, args.per_device_eval_batch_size,
                                  ("loss", "rewards/accuracies", "rewards/margins"))

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
        print_outputs("DPO", args.output_dir, results)
    return results


if __name__ == "__main__":
    run_recipe(main)
