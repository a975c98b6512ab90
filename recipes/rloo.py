"""RLOO recipe, as `trl rloo` (trl/scripts/rloo.py): recipes/grpo.py with `RLOOConfig` / `RLOOTrainer`.

    hf-rlhf rloo                                            # the embedded toy task (configs/rloo_eval_toy.yaml)
    hf-rlhf rloo --model_name_or_path my/sft --dataset_name my/prompts --reward_funcs my_rewards.accuracy
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path too: recipes/grpo.py beside it

from grpo import RECIPES, ScriptArguments, run  # noqa: E402,F401 (the options `hf-rlhf rloo` takes)

from hf_rlhf import ModelConfig, RLOOConfig  # noqa: E402,F401
from hf_rlhf.cli.arguments import parse_recipe_args  # noqa: E402
from hf_rlhf.cli.errors import run_recipe  # noqa: E402
from hf_rlhf.toy.chain import ToyChainArguments  # noqa: E402,F401

TOY_CONFIG = os.path.join(RECIPES, "configs", "rloo_eval_toy.yaml")


def main(argv: list[str] | None = None) -> dict:
    return run("rloo", argv, TOY_CONFIG, parse=lambda *a: parse_recipe_args(*a))


if __name__ == "__main__":
    run_recipe(main)
