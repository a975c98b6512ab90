"""DPO's prefix-shared layout (each pair's prompt computed once) and padding-free layout (the 2B sequences end to end
in one row) give every architecture the completion log-probs and loss of TRL's padded chosen‖rejected layout within
1e-5, or the trainer refuses the layout when it is built (and the refusal is true). In every layout, logits computed
only where a completion token is predicted (`use_logits_to_keep`, the default) give the log-probs, loss and gradients
of the full logits within 1e-5; so does the padded layout run without its right-padding mask (sdpa's causal kernel).
"""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, TOKENIZER, build

from hf_rlhf import DPOConfig, DPOTrainer
from hf_rlhf.models.packing_check import PackingCheckError
from hf_rlhf.toy import preference_dataset

PAIRS = preference_dataset(6, seed=3, split="train")


def make_trainer(tmp_path, model, layout=None, check=True, router_loss_off=True, **kwargs):
    """`layout`: None (TRL's padded), "prefix_sharing" or "padding_free". An MoE model's load-balancing loss is off
    in all three (prefix sharing switches it off, with a warning): the DPO losses are compared."""
    moe = {"router_aux_loss_coef": 0.0} if router_loss_off and hasattr(model.config, "router_aux_loss_coef") else {}
    args = DPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, save_strategy="no",
                     disable_tqdm=True, packing_check=check, **({layout: True} if layout else {}), **moe, **kwargs)
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


def loss_logps_and_grads(trainer, inputs, keep_logits: bool, drop_padding_mask: bool = False):
    """(loss, policy (2B,) log-probs, reference (chosen, rejected), {name: grad}) of one batch, in train mode."""
    trainer._keeps_logits = {"policy": keep_logits, "reference": keep_logits}
    trainer._drop_padding_mask = drop_padding_mask
    model = trainer.model.train()
    model.zero_grad()
    model_inputs = trainer._model_inputs(inputs)
    with torch.no_grad():
        outputs, stats = trainer._forward(model, model_inputs, inputs, keep_logits)
        reference = torch.cat(trainer._reference_logps(model_inputs, inputs))
    full = outputs.logits.shape[1] == inputs["input_ids"].shape[1]
    assert full != keep_logits  # the path under test really computes fewer positions
    if "completion_mask" in inputs:  # padded: the mask goes only where asked
        assert ("attention_mask" in model_inputs) != drop_padding_mask
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), stats["logps"], reference, grads


@pytest.mark.parametrize("layout", [None, "prefix_sharing", "padding_free"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_completion_only_logits_equal_the_full_logits(tmp_path, model_type, layout):
    """Absolute positions (gpt2, opt), softcapped logits (gemma2), an MoE policy with its router loss on (qwen2_moe,
    off under prefix sharing): the logits at completion positions are the full forward's. Layouts the self-check
    refuses on a model are built unchecked: kept and full logits still come from the same forward."""
    model = build(model_type, seed=1)
    trainer = make_trainer(tmp_path, model, layout, check=False, router_loss_off=False,
                           **({"ld_alpha": 0.5, "use_weighting": True} if model_type == "llama" else {}))
    assert trainer._keeps_logits == {"policy": True, "reference": True}
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    kept = loss_logps_and_grads(trainer, inputs, True)
    full = loss_logps_and_grads(trainer, inputs, False)
    for a, b in zip(kept[:3], full[:3]):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert kept[3].keys() == full[3].keys() and len(full[3]) > 0
    for name in full[3]:
        assert_close(kept[3][name], full[3][name], atol=1e-5, rtol=1e-5, msg=name)


def test_full_logits_when_asked(tmp_path):
    """`use_logits_to_keep=False` computes every position; `prediction_step` returns the full (2B, T, V) logits, of
    the masked forward (the padding positions' too, as TRL's)."""
    trainer = make_trainer(tmp_path, build("llama", seed=1), use_logits_to_keep=False)
    assert trainer._keeps_logits == {"policy": False, "reference": False}
    trainer = make_trainer(tmp_path, build("llama", seed=1))
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss, logits, labels = trainer.prediction_step(trainer.model, inputs, prediction_loss_only=False)
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.equal(labels, inputs["input_ids"])
    assert trainer._drop_padding_mask and (inputs["attention_mask"] == 0).any()
    with torch.no_grad():
        masked = trainer.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert_close(logits, masked, atol=1e-5, rtol=1e-5)
    assert_close(trainer.prediction_step(trainer.model, inputs, prediction_loss_only=True)[0], loss)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_padded_rows_without_their_mask_equal_the_masked_ones(tmp_path, model_type):
    """Right-padded rows, causal attention: the real tokens' log-probs, loss and gradients are those of the masked
    forward. The trainer drops the mask on sdpa where the model's self-check agrees, and not for an MoE router loss
    (it reads the mask)."""
    model = build(model_type, seed=1)
    trainer = make_trainer(tmp_path, model)
    assert trainer._drop_padding_mask == (model.config._attn_implementation == "sdpa")
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    assert (inputs["attention_mask"] == 0).any()  # rows of different lengths: there is padding to leave unmasked
    causal = loss_logps_and_grads(trainer, inputs, True, drop_padding_mask=True)
    masked = loss_logps_and_grads(trainer, inputs, True, drop_padding_mask=False)
    for a, b in zip(causal[:3], masked[:3]):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name in masked[3]:
        assert_close(causal[3][name], masked[3][name], atol=1e-5, rtol=1e-5, msg=name)
    if model_type == "qwen2_moe":
        assert not make_trainer(tmp_path, build(model_type, seed=1), router_loss_off=False)._drop_padding_mask
