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
from dataclasses import dataclass, field

from hf_rlhf import DPOConfig, DPOTrainer, ModelConfig
from hf_rlhf.cli.arguments import parse_recipe_args
from hf_rlhf.cli.errors import run_recipe
from hf_rlhf.toy.chain import ToyChainArguments, preference_toy_data, run_preference_recipe

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
    """(train rows, held-out rows, held-out prompts): the SFT policy built first when missing."""
    from hf_rlhf.toy import preference_dataset

    return preference_toy_data("dpo", preference_dataset, script_args, toy_args, model_config, RECIPES, max_test=200)


def main(argv: list[str] | None = None) -> dict:
    from hf_rlhf.data.dpo import check_dpo_rows

    parsed = parse_recipe_args((ScriptArguments, ToyChainArguments, ModelConfig, DPOConfig), argv, TOY_CONFIG)
    args = parsed[3]
    return run_preference_recipe("DPO", DPOTrainer, parsed, toy_data, check_dpo_rows,
                                 ("loss", "rewards/accuracies", "rewards/margins"), "+".join(args.loss_type))


if __name__ == "__main__":
    run_recipe(main)
