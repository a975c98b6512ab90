"""PPO's prompt sharing (`PPOConfig.prefix_sharing`, `hf_rlhf.rollout.shared_prompts`) on every architecture: the rows
of one prompt run as one row [prompt | completion 1 | ... | completion k] give the padded layout's log-probs,
values and gradients (to float rounding), or the trainer turns it off for that model, saying why."""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, PAD_ID, TOKENIZER, attentions, build, random_sequences

from hf_rlhf.collators import LeftPaddingCollator
from hf_rlhf.models.packing_check import PackingCheckError, check_packing_exact
from hf_rlhf.models.policy_value import PolicyAndValue, response_logits
from hf_rlhf.tensors import logprobs_from_logits
from hf_rlhf.toy import prompt_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

G = 3


def group_batch():
    """Two prompts (lengths 5 and 2), G responses each of lengths 1..4, left/right padded, prompts interleaved."""
    prompts = random_sequences([5, 2], seed=3)
    responses = random_sequences([4, 1, 3, 2, 4, 3], seed=4)
    rows = [0, 1, 0, 1, 0, 1]  # the rows of a prompt need not be consecutive (micro-batches are shuffled)
    query = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": prompts[r]} for r in rows])
    width = max(map(len, responses))
    response_ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    return query["input_ids"], query["attention_mask"], response_ids, response_mask


def sharing_refusal(model) -> str | None:
    try:
        check_packing_exact(model, "prefix_sharing", None)
    except PackingCheckError as err:
        return str(err)
    return None


@pytest.mark.parametrize("value", ["head", "model"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_shared_layout_equals_the_padded_layout(model_type, attn, value, record_property):
    if attn not in attentions(model_type):
        pytest.skip(f"{model_type} has no {attn} attention in transformers")
    policy = build(model_type, attn=attn)
    refusal = sharing_refusal(policy)
    if refusal is not None:  # sliding windows: the 4D mask would replace the model's window
        record_property("refusal", refusal)
        assert "sliding window" in refusal or "not exact" in refusal
        return
    value_model = build(model_type, "seq_cls", attn=attn, seed=2) if value == "model" else None
    module = PolicyAndValue(policy, value_model=value_model).eval()
    query_ids, query_mask, response_ids, response_mask = group_batch()
    mask = response_mask.bool()
    outputs = {}
    for share in (False, True):
        module.zero_grad()
        logits, values, _ = response_logits(module, query_ids, query_mask, response_ids, response_mask,
                                            temperature=0.7, share_prompts=share)
        logprobs = logprobs_from_logits(logits, response_ids)
        (logprobs[mask].sum() + values[mask].sum()).backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        outputs[share] = (logprobs.detach()[mask], values.detach()[mask], grads)
    (lp0, v0, g0), (lp1, v1, g1) = outputs[False], outputs[True]
    assert_close(lp1, lp0, atol=2e-5, rtol=1e-4)
    assert_close(v1, v0, atol=2e-5, rtol=1e-4)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        assert_close(g1[name], g0[name], atol=5e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mistral", "qwen2_moe"])
def test_grpo_decides_prefix_sharing_per_model(tmp_path, model_type):
    """num_generations > 1: sharing is on unless a model cannot take it (mistral's sliding window here), off for
    G = 1 and with prefix_sharing=False; prefix_sharing=True on a model that cannot take it is an error."""
    def trainer(**options):
        args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, rollout_batch_size=8,
                         num_ppo_epochs=1, response_length=4, max_steps=1, save_strategy="no", report_to="none",
                         disable_tqdm=True, **options)
        return PPOTrainer(build(model_type), lambda prompts, completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=prompt_dataset(8, seed=0), processing_class=TOKENIZER)

    can = model_type != "mistral"
    assert trainer(advantage_estimator="grpo", num_generations=4).share_prompts is can
    assert trainer(advantage_estimator="grpo", num_generations=4, prefix_sharing=False).share_prompts is False
    assert trainer(advantage_estimator="reinforce_pp").share_prompts is False  # one completion per prompt
    if can:
        assert trainer(advantage_estimator="reinforce_pp", prefix_sharing=True).share_prompts is True
    else:
        with pytest.raises(ValueError, match="prefix_sharing=True cannot be honoured: .*sliding window"):
            trainer(advantage_estimator="grpo", num_generations=4, prefix_sharing=True)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2_moe"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_training_with_shared_prompts_equals_training_without(tmp_path, model_type, estimator):
    """One rollout, two PPO epochs of GRPO / RLOO (KL in the loss / in the reward, micro-batches cutting groups apart)
    log the same losses, KL and entropy and end with the same weights with prefix_sharing on as off; the forwards
    with sharing run fewer rows (the prompts of a forward once each). (One rollout: a later one samples from weights
    a float rounding apart, and an MoE router's near tie can then sample other tokens.)"""
    def run(share: bool):
        args = PPOConfig(output_dir=str(tmp_path / f"out{share}"), per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, rollout_batch_size=8, num_ppo_epochs=2, response_length=4,
                         max_steps=2, logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-2,
                         seed=0, disable_tqdm=True, advantage_estimator=estimator, num_generations=4,
                         kl_in_loss=estimator == "grpo", kl_estimator="k3", kl_coef=0.1,
                         local_rollout_forward_batch_size=8, prefix_sharing=share, optim="sgd")
        trainer = PPOTrainer(build(model_type), lambda prompts, completions, **kw: [len(c) % 3 for c in completions],
                             args=args, train_dataset=prompt_dataset(16, seed=0), processing_class=TOKENIZER)
        assert trainer.share_prompts is share
        rows = []
        trainer.model.policy.register_forward_pre_hook(
            lambda module, a, kw: rows.append(kw["input_ids"].shape[0]) if kw.get("input_ids") is not None
            and kw["input_ids"].shape[1] > 1 and not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
            else None, with_kwargs=True)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return logs, {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}, rows

    (shared, w_shared, rows_shared), (apart, w_apart, rows_apart) = run(True), run(False)
    assert len(shared) == len(apart) == 2
    for a, b in zip(shared, apart):
        for key in ("loss", "grad_norm", "loss/policy_avg", "objective/kl", "objective/entropy", "objective/scores"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
    # SGD: Adam would divide float-rounding differences of near-zero gradients (an embedding row seen only under
    # the mask) by their own tiny RMS and make them a whole step apart
    for name in w_apart:
        assert_close(w_shared[name], w_apart[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert rows_apart == [4] * 4 and all(r < 4 for r in rows_shared), (rows_shared, rows_apart)
    start = dict(build(model_type).named_parameters())
    assert sum(not torch.equal(w_shared[n], start[n]) for n in start) > len(start) // 2  # it trained
