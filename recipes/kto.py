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
from dataclasses import dataclass, field

from hf_rlhf import KTOConfig, KTOTrainer, ModelConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.toy.chain import ToyChainArguments, preference_toy_data, run_preference_recipe

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
    from hf_rlhf.toy import unpaired_dataset

    return preference_toy_data("kto", unpaired_dataset, script_args, toy_args, model_config, RECIPES, max_test=100)


def main(argv: list[str] | None = None) -> dict:
    from hf_rlhf.data.kto import check_kto_rows

    parsed = parse_recipe_args((ScriptArguments, ToyChainArguments, ModelConfig, KTOConfig), argv, TOY_CONFIG)
    args = parsed[3]
    return run_preference_recipe("KTO", KTOTrainer, parsed, toy_data, check_kto_rows,
                                 ("loss", "rewards/margins", "kl"), args.loss_type)


if __name__ == "__main__":
    run_recipe(main)
