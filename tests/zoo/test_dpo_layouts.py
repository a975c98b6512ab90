"""DPO's prefix-shared layout (each pair's prompt computed once) and padding-free layout (the 2B sequences end to end
in one row) give every architecture the completion log-probs and loss of TRL's padded chosen‖rejected layout within
1e-5, or the trainer refuses the layout when it is built (and the refusal is true)."""

import pytest
import torch
from torch.testing import assert_close

from hf_rlhf import DPOConfig, DPOTrainer
from hf_rlhf.packing_check import PackingCheckError
from hf_rlhf.toy import preference_dataset
from zoo_models import MODEL_TYPES, TOKENIZER, build

PAIRS = preference_dataset(6, seed=3, split="train")


def make_trainer(tmp_path, model, layout=None, check=True, router_loss_off=True):
    """`layout`: None (TRL's padded), "prefix_sharing" or "padding_free". An MoE model's load-balancing loss is off
    in all three (prefix sharing switches it off, with a warning): the DPO losses are compared."""
    moe = {"router_aux_loss_coef": 0.0} if router_loss_off and hasattr(model.config, "router_aux_loss_coef") else {}
    args = DPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, save_strategy="no",
                     disable_tqdm=True, packing_check=check, **({layout: True} if layout else {}), **moe)
    return DPOTrainer(model, args=args, train_dataset=PAIRS, processing_class=TOKENIZER)


def logps_and_loss(trainer):
    """((2B,) summed completion log-probs of the policy, chosen then rejected; the loss) of one batch of every pair."""
    features = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    inputs = trainer.data_collator(features)
    trainer.model.eval()
    with torch.no_grad():
        stats = trainer._statistics(trainer.model(**trainer._model_inputs(inputs)).logits, inputs)
        loss = trainer.compute_loss(trainer.model, inputs)
    return stats["logps"], loss, stats["lengths"]


@pytest.mark.parametrize("layout", ["prefix_sharing", "padding_free"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_layout_equals_padded_or_refuses(tmp_path, record_property, model_type, layout):
    model = build(model_type, seed=1).eval()
    padded, padded_loss, padded_lengths = logps_and_loss(make_trainer(tmp_path, model))
    try:
        trainer = make_trainer(tmp_path, model, layout)
    except PackingCheckError as err:
        message = str(err)
        assert model_type in message and f"{layout}=True" in message
        record_property("refusal", message)
        shared, _, _ = logps_and_loss(make_trainer(tmp_path, model, layout, check=False))
        assert (shared - padded).abs().max() > 1e-4  # the refusal is true: the layout changes the log-probs
        return
    shared, shared_loss, shared_lengths = logps_and_loss(trainer)
    assert torch.equal(shared_lengths, padded_lengths)
    assert_close(shared, padded, atol=1e-5, rtol=1e-5)
    assert_close(shared_loss, padded_loss, atol=1e-5, rtol=1e-5)
    print(f"{model_type} {layout}: max |logp diff| {(shared - padded).abs().max().item():.2e}")


def test_moe_prefix_sharing_with_the_default_router_loss_runs_its_frozen_reference(tmp_path, caplog):
    """Prefix sharing on an MoE policy with the config's router loss: the loss is switched off (with a warning) on the
    policy and on its frozen copy, whose forward with the 4D mask used to fail inside the router loss."""
    import logging

    model = build("qwen2_moe", seed=1).eval()
    model.config.output_router_logits = True  # as a checkpoint saved for training would have it
    with caplog.at_level(logging.WARNING, logger="hf_rlhf"):
        trainer = make_trainer(tmp_path, model, "prefix_sharing", router_loss_off=False)
    assert "load-balancing loss is not added" in caplog.text
    assert trainer.ref_model is not None and not trainer.ref_model.config.output_router_logits
    loss = logps_and_loss(trainer)[1]
    assert torch.isfinite(loss)
