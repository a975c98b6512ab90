"""LoRA adapters are initialised from `args.seed`, whatever the global RNG did before: every rank of a multi-process
run (and a single-process run) starts from the same adapter. Without it ZeRO-3 mixes the ranks' different inits."""

import pytest
import torch

from hf_rlhf import ModelConfig, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, build_toy_tokenizer, preference_dataset, sft_dataset

pytestmark = pytest.mark.integration

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


def adapter(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_A" in n}


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_lora_init_follows_args_seed(tmp_path, kind):
    tokenizer = build_toy_tokenizer()
    made = []
    for noise in (1, 1000):
        torch.rand(noise)  # another rank / process has consumed the global RNG differently
        common = dict(output_dir=str(tmp_path / str(noise)), report_to="none", seed=3, max_length=32)
        if kind == "sft":
            made.append(adapter(SFTTrainer(build_toy_model(tokenizer, "tiny"), args=SFTConfig(**common),
                                           train_dataset=sft_dataset(8, seed=0), processing_class=tokenizer,
                                           model_config=ModelConfig(**LORA))))
        else:
            made.append(adapter(RewardTrainer(build_toy_reward_model(tokenizer, "tiny"), args=RewardConfig(**common),
                                              train_dataset=preference_dataset(8, seed=0), processing_class=tokenizer,
                                              model_config=ModelConfig(**LORA))))
    assert made[0].keys() == made[1].keys() and made[0]
    for name in made[0]:
        torch.testing.assert_close(made[0][name], made[1][name])
