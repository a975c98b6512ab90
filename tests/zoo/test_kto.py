"""KTO on every architecture: one batch's loss and gradients are the same with the logits computed everywhere (as
trl 1.16 on CPU), only where a completion token is predicted (`use_logits_to_keep`, the default), from the LM head a
chunk of tokens at a time (`chunked_lm_head=True`), in the padding-free and in the prefix-shared layouts, within
1e-5, or the trainer refuses the option when it is built (the layouts' self-check, a head that does not split off).
The KL reference point z0 (> 0: the policy is moved off its reference) is the same in each.
"""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, TOKENIZER, build

from hf_rlhf import KTOConfig, KTOTrainer
from hf_rlhf.models.lm_head import HeadSplitError
from hf_rlhf.models.packing_check import PackingCheckError
from hf_rlhf.toy import unpaired_dataset

ROWS = unpaired_dataset(4, seed=3, split="train")  # 8 rows, one batch


def loss_and_grads(tmp_path, model, **options):
    """(loss, z0, {name: grad}) of one batch of every row, the reference a frozen copy of `model` made before a
    perturbation of the policy (so that z0 and the rewards are not all 0)."""
    moe = {"router_aux_loss_coef": 0.0} if hasattr(model.config, "router_aux_loss_coef") else {}
    args = KTOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, save_strategy="no",
                     disable_tqdm=True, per_device_train_batch_size=8, **moe, **options)
    reference = build(model.config.model_type, seed=1).eval()
    trainer = KTOTrainer(model, reference, args=args, train_dataset=ROWS, processing_class=TOKENIZER)
    features = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    inputs = trainer._prepare_inputs(trainer.data_collator(features))
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    totals = trainer.metrics["train"].totals(trainer.accelerator)
    return loss.detach(), totals["kl"][0], grads


@pytest.mark.parametrize("option", ["use_logits_to_keep", "chunked_lm_head", "padding_free", "prefix_sharing"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_kto_loss_and_gradients_equal_full_logits(tmp_path, record_property, model_type, option):
    def policy(seed):
        model = build(model_type, seed=1)
        with torch.no_grad():  # the policy moved off its reference
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())) * 0.05)
        return model

    for seed in range(8):  # a move whose mismatched log-ratio is positive (z0 is clamped at 0): z0 is compared too
        full_loss, full_kl, full_grads = loss_and_grads(tmp_path, policy(seed), use_logits_to_keep=False,
                                                        chunked_lm_head=False)
        if full_kl > 0:
            break
    assert full_kl > 0
    options = {"use_logits_to_keep": {"chunked_lm_head": False}, "chunked_lm_head": {"chunked_lm_head": True},
               "padding_free": {"padding_free": True, "chunked_lm_head": False},
               "prefix_sharing": {"prefix_sharing": True, "chunked_lm_head": False}}[option]
    try:
        loss, kl, grads = loss_and_grads(tmp_path, policy(seed), **options)
    except (PackingCheckError, HeadSplitError) as err:  # the layout / the head split is refused for this model
        record_property("refusal", str(err))
        return
    assert_close(loss, full_loss, atol=1e-5, rtol=1e-5)
    assert abs(kl - full_kl) <= 1e-5
    assert grads.keys() == full_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, full_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    print(f"{model_type} {option}: |loss diff| {(loss - full_loss).abs().item():.2e}")


@pytest.mark.parametrize("model_type, collator", [("llama", "PromptCachedUnpairedCollator"),
                                                  ("mistral", "PrefixSharedUnpairedCollator")])
def test_prefix_sharing_reads_the_prompt_cache_or_falls_back(tmp_path, model_type, collator):
    """prefix_sharing reads the prompt's KV cache where the self-check finds it exact; a sliding-window cache (a
    window no shorter than max_length: the 4D-masked layout is exact there) falls back to the 4D-masked rows. Both
    give the padded layout's loss."""
    config = {"sliding_window": 64} if model_type == "mistral" else {}
    losses = {}
    for layout in ({}, {"prefix_sharing": True}):
        model = build(model_type, seed=1)
        for key, value in config.items():
            setattr(model.config, key, value)
        args = KTOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, save_strategy="no",
                         disable_tqdm=True, per_device_train_batch_size=8, chunked_lm_head=False, **layout)
        trainer = KTOTrainer(model, args=args, train_dataset=ROWS, processing_class=TOKENIZER)
        if layout:
            assert type(trainer.data_collator).__name__ == collator
        features = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        losses[bool(layout)] = trainer.compute_loss(trainer.model, trainer._prepare_inputs(
            trainer.data_collator(features))).detach()
    assert_close(losses[True], losses[False], atol=1e-5, rtol=1e-5)
