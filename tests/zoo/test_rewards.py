"""Reward models of every architecture give each sequence the reward it has alone in every batch layout of
`RewardTrainer` (right / left padding, padding_free, prefix_sharing), as sequence-classification models and as
`ValueHeadModel`s; or the trainer refuses the layout when it is built (and the refusal is true)."""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, TOKENIZER, build

from hf_rlhf import RewardConfig, RewardTrainer
from hf_rlhf.models.packing_check import PackingCheckError
from hf_rlhf.models.value_head import ValueHeadModel, get_rewards
from hf_rlhf.toy import preference_dataset

LAYOUTS = {"right": {}, "left": {"padding_side": "left"}, "padding_free": {"padding_free": True},
           "prefix_sharing": {"prefix_sharing": True}}
CELLS = [(m, kind, layout) for m in MODEL_TYPES for kind in ("seq_cls", "value_head") for layout in LAYOUTS]
PAIRS = preference_dataset(6, seed=3, split="train")


def reward_model(model_type, kind):
    return build(model_type, "seq_cls", seed=1) if kind == "seq_cls" else ValueHeadModel(build(model_type, seed=1))


def make_trainer(tmp_path, model, layout, check=True):
    args = RewardConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, save_strategy="no",
                        disable_tqdm=True, packing_check=check, **LAYOUTS[layout])
    return RewardTrainer(model, args=args, train_dataset=PAIRS, processing_class=TOKENIZER)


def rewards(trainer, model):
    """(rewards of the trainer's batch (2B,), each sequence alone (2B,)), chosen then rejected."""
    features = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    with torch.no_grad():
        chosen, rejected = trainer._rewards(model, trainer.data_collator(features))
    sequences = [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features]
    alone = torch.cat([get_rewards(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
                       for s in sequences])
    return torch.cat([chosen, rejected]), alone


@pytest.mark.parametrize("model_type,kind,layout", CELLS, ids=["-".join(c) for c in CELLS])
def test_reward_layout_equals_each_sequence_alone_or_refuses(tmp_path, record_property, model_type, kind, layout):
    model = reward_model(model_type, kind).eval()
    try:
        trainer = make_trainer(tmp_path, model, layout)
    except PackingCheckError as err:
        message = str(err)
        assert model_type in message and f"{layout}=True" in message
        record_property("refusal", message)
        batched, alone = rewards(make_trainer(tmp_path, model, layout, check=False), model)
        assert (batched - alone).abs().max() > 1e-4  # the refusal is true: the layout changes the rewards
        return
    batched, alone = rewards(trainer, model)
    assert_close(batched, alone, atol=1e-5, rtol=1e-4)
