"""Distillation on every architecture: the divergence from the two models' last hidden states, a chunk of tokens at
a time (`chunked_lm_head=True`), equals the full logits' on a left-padded batch (Gemma 2's soft cap included), and a
few on-policy steps train the student toward a teacher of the same architecture."""

import pytest
import torch
from zoo_models import MODEL_TYPES, PAD_ID, TOKENIZER, build, random_sequences

from hf_rlhf import DistillationConfig, DistillationTrainer
from hf_rlhf.collators import LeftPaddingCollator
from hf_rlhf.toy import prompt_dataset


def trainer_for(tmp_path, model_type, chunked, **kw):
    args = DistillationConfig(output_dir=str(tmp_path / f"out{chunked}"), per_device_train_batch_size=2,
                              gradient_accumulation_steps=2, max_completion_length=4, max_steps=2, logging_steps=1,
                              save_strategy="no", report_to="none", learning_rate=1e-2, seed=0, disable_tqdm=True,
                              beta=0.5, temperature=0.9, chunked_lm_head=chunked, **kw)
    return DistillationTrainer(build(model_type), build(model_type, seed=1), args=args,
                               train_dataset=prompt_dataset(8, seed=0), processing_class=TOKENIZER)


def batch():
    prompts, responses = random_sequences([6, 2, 4], seed=7), random_sequences([3, 5, 1], seed=8)
    query = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": p} for p in prompts])
    width = max(map(len, responses))
    return {"prompt_ids": query["input_ids"], "prompt_mask": query["attention_mask"],
            "completion_ids": torch.tensor([r + [PAD_ID] * (width - len(r)) for r in responses]),
            "completion_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_chunked_divergence_equals_the_full_logits_and_steps_train(tmp_path, model_type, record_property):
    inputs = batch()
    losses, grads = {}, {}
    for chunked in (False, True):
        trainer = trainer_for(tmp_path, model_type, chunked)
        if chunked and trainer.heads is None:  # the model's head does not split off: refused by name in the log
            record_property("refusal", "LM head does not split")
            pytest.skip(f"{model_type}: the LM head does not split off")
        model = trainer.model.eval()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        losses[chunked] = loss.item()
        grads[chunked] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-7) and losses[True] > 0
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[True].items():
        torch.testing.assert_close(grad, grads[False][name], rtol=1e-4, atol=1e-6, msg=name)

    trainer = trainer_for(tmp_path, model_type, True)
    before = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    changed = [n for n, p in trainer.model.policy.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > len(before) // 2
