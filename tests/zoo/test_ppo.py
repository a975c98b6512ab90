"""PPO on every architecture: the rollout's scoring of a left-padded batch (log-probs, values, reference) equals
each row run alone and unpadded (the layout PPO trains on is the layout it sampled in), and a few PPO steps train."""

import pytest
import torch
from torch.testing import assert_close
from zoo_models import MODEL_TYPES, PAD_ID, TOKENIZER, build, random_sequences

from hf_rlhf.collators import LeftPaddingCollator
from hf_rlhf.models.policy_value import PolicyAndValue, response_logits
from hf_rlhf.models.value_head import backbone_of
from hf_rlhf.tensors import logprobs_from_logits
from hf_rlhf.toy import prompt_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer

PROMPT_LENGTHS, RESPONSE_LENGTHS = [6, 2, 4], [3, 5, 1]


def rollout_batch():
    """Left-padded prompts (B, Q) and right-padded responses (B, R), with masks, and the token lists."""
    prompts = random_sequences(PROMPT_LENGTHS, seed=7)
    responses = random_sequences(RESPONSE_LENGTHS, seed=8)
    query = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": p} for p in prompts])
    width = max(RESPONSE_LENGTHS)
    response_ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    return query["input_ids"], query["attention_mask"], response_ids, response_mask, prompts, responses


@pytest.mark.parametrize("value", ["head", "model"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_rollout_scoring_of_a_left_padded_batch_equals_each_row_alone(model_type, value):
    value_model = build(model_type, "seq_cls", seed=2) if value == "model" else None
    module = PolicyAndValue(build(model_type), value_model=value_model).eval()
    reference = build(model_type, seed=1)
    query_ids, query_mask, response_ids, response_mask, prompts, responses = rollout_batch()
    with torch.no_grad():
        logits, values, _ = response_logits(module, query_ids, query_mask, response_ids, response_mask)
        logprobs = logprobs_from_logits(logits, response_ids)
        ref_logprobs = logprobs_from_logits(
            response_logits(reference, query_ids, query_mask, response_ids, response_mask)[0], response_ids)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([prompt + response])  # unpadded, no mask, default positions
            span = slice(len(prompt) - 1, len(prompt) + len(response) - 1)  # outputs that predict the response
            out = module(ids)
            n = len(response)
            assert_close(logprobs[row, :n], logprobs_from_logits(out.logits[:, span], ids[:, len(prompt):])[0],
                         atol=1e-5, rtol=1e-4, msg=f"log-probs, row {row}")
            assert_close(values[row, :n], out.token_values[0, span], atol=1e-5, rtol=1e-4, msg=f"values, row {row}")
            ref = logprobs_from_logits(reference(ids, use_cache=False).logits[:, span], ids[:, len(prompt):])[0]
            assert_close(ref_logprobs[row, :n], ref, atol=1e-5, rtol=1e-4, msg=f"reference, row {row}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_few_ppo_steps_train(tmp_path, model_type):
    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     rollout_batch_size=4, num_ppo_epochs=1, response_length=4, max_steps=2, logging_steps=1,
                     save_strategy="no", report_to="none", learning_rate=1e-2, seed=0, disable_tqdm=True,
                     kl_estimator="k3")
    prompts = prompt_dataset(8, seed=0)
    # the reward: a sequence-classification model of the same architecture, with the same (toy) tokenizer
    trainer = PPOTrainer(build(model_type), build(model_type, "seq_cls", seed=3), args=args, train_dataset=prompts,
                         processing_class=TOKENIZER, reward_processing_class=TOKENIZER)
    before = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("objective/kl" in h and torch.isfinite(torch.tensor(h["objective/kl"]))
                                  for h in logs), logs
    changed = [n for n, p in trainer.model.policy.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > len(before) // 2, (len(changed), len(before))


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2", "qwen2_moe"])
def test_old_logprobs_from_the_loss_equal_the_rollout_forward(tmp_path, model_type, monkeypatch):
    """GRPO with one optimizer step per rollout, β fixed in the loss: the rollout skips its policy forward and the
    loss's detached log-probs are the old ones (`PPOConfig.old_logprobs_in_loss`). The run logs the same losses,
    KL and entropy and ends with the same weights as with the rollout forward (forced back on), with one policy
    forward fewer per rollout micro-batch."""
    def run(skip: bool):
        if not skip:
            monkeypatch.setattr(PPOConfig, "old_logprobs_in_loss", property(lambda self: False))
        args = PPOConfig(output_dir=str(tmp_path / f"out{skip}"), per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, rollout_batch_size=8, num_ppo_epochs=1, response_length=4,
                         max_steps=2, logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-2,
                         seed=0, disable_tqdm=True, advantage_estimator="grpo", num_generations=4, kl_in_loss=True,
                         kl_estimator="k3", kl_coef=0.1, local_rollout_forward_batch_size=8,
                         logprobs_from_generation=False)  # forced back on: the rollout's own forward, every rollout
        assert args.old_logprobs_in_loss is skip
        trainer = PPOTrainer(build(model_type), lambda prompts, completions, **kw: [len(c) % 3 for c in completions],
                             args=args, train_dataset=prompt_dataset(16, seed=0), processing_class=TOKENIZER)
        calls = []
        # on the transformer body, which every policy forward runs (a no-grad rollout forward runs it alone)
        backbone_of(trainer.model.policy).register_forward_pre_hook(
            lambda module, args: calls.append(torch.is_grad_enabled()))
        trainer.train()
        monkeypatch.undo()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        weights = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}
        return logs, weights, calls

    (skipped, w_skipped, calls_skipped), (full, w_full, calls_full) = run(True), run(False)
    for a, b in zip(skipped, full):
        for key in ("loss", "grad_norm", "loss/policy_avg", "loss/kl_avg", "objective/kl", "objective/entropy",
                    "objective/rlhf_reward", "objective/scores", "val/ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, a[key], b[key])
    for name in w_full:
        assert_close(w_skipped[name], w_full[name], atol=1e-5, rtol=1e-4, msg=name)
    no_grad = lambda calls: sum(not grad for grad in calls)  # noqa: E731  rollout forwards (generation steps too)
    assert no_grad(calls_full) - no_grad(calls_skipped) == 2  # one policy forward per rollout, 2 rollouts


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("lora", [False, True])
def test_beta_zero_builds_and_runs_no_reference(tmp_path, model_type, lora):
    """β fixed at 0 (TRL's GRPO default): no frozen copy is built, no reference forward runs (adapters-off either),
    the KL metrics are not logged, and the policy trains; the same run with a tiny β makes the reference forward."""
    from peft import LoraConfig

    def run(kl_coef):
        args = PPOConfig(output_dir=str(tmp_path / f"out{kl_coef}"), per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, rollout_batch_size=8, num_ppo_epochs=1, response_length=4,
                         max_steps=2, logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-2,
                         seed=0, disable_tqdm=True, advantage_estimator="grpo", num_generations=4, kl_in_loss=True,
                         kl_coef=kl_coef, local_rollout_forward_batch_size=8)
        peft_config = LoraConfig(r=4, target_modules="all-linear") if lora else None
        trainer = PPOTrainer(build(model_type), lambda prompts, completions, **kw: [len(c) % 3 for c in completions],
                             args=args, train_dataset=prompt_dataset(16, seed=0), processing_class=TOKENIZER,
                             peft_config=peft_config)
        reference_calls = []
        original = trainer.rollout_maker._reference_logprobs
        trainer.rollout_maker._reference_logprobs = lambda *a: reference_calls.append(1) or original(*a)
        before = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters() if p.requires_grad}
        trainer.train()
        changed = any(not torch.equal(p, before[n]) for n, p in trainer.model.policy.named_parameters()
                      if p.requires_grad)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return trainer, reference_calls, changed, logs

    trainer, calls, changed, logs = run(0.0)
    assert trainer.ref_model is None and not calls and changed
    assert all("objective/kl" not in h and "loss/kl_avg" not in h and "objective/entropy" in h for h in logs)
    trainer, calls, changed, logs = run(0.01)
    assert (trainer.ref_model is None) == lora and len(calls) == 2  # adapters off, or the frozen copy
    assert all("objective/kl" in h and "loss/kl_avg" in h for h in logs)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_rollout_forwards_in_length_sorted_chunks_equal_one_forward(tmp_path, model_type):
    """`group_by_length`: the rollout's forwards take the rows sorted by prompt length, in chunks of
    `local_rollout_forward_batch_size`, each cut to its own width; log-probs, values and reference log-probs come
    back in the rows' order and equal one forward of the whole padded batch (to float rounding), as do in-order
    chunks (group_by_length=False), which are cut to their width too."""
    from hf_rlhf.rollout.rollout_maker import RolloutMaker

    module = PolicyAndValue(build(model_type)).eval()
    reference = build(model_type, seed=1)
    prompts = random_sequences([6, 2, 4, 1, 5, 3], seed=7)
    responses = random_sequences([3, 5, 1, 4, 2, 5], seed=8)
    query = LeftPaddingCollator(PAD_ID, passthrough=False)([{"input_ids": p} for p in prompts])
    width = max(map(len, responses))
    response_ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in responses])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    mask = response_mask.bool()

    def forward(size, grouping):
        args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to="none", kl_coef=0.05,
                         local_rollout_forward_batch_size=size, group_by_length=grouping, temperature=0.7)
        maker = RolloutMaker(args, TOKENIZER, None, None, ref_model=reference)
        chunks = maker._row_chunks(query["attention_mask"])
        with torch.no_grad():
            out = maker._forward(module, query["input_ids"], query["attention_mask"], response_ids, response_mask)
        return [c.tolist() for c in chunks], out

    whole_chunks, whole = forward(6, None)
    assert whole_chunks == [[0, 1, 2, 3, 4, 5]]
    for grouping, expected in ((None, [[3, 1], [5, 2], [4, 0]]), (False, [[0, 1], [2, 3], [4, 5]])):
        chunks, out = forward(2, grouping)
        assert chunks == expected
        for name, got, want in zip(("log-probs", "values", "reference"), out, whole):
            assert got.shape == want.shape
            assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-4, msg=f"{name}, group_by_length={grouping}")


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2_moe"])
def test_length_grouping_changes_no_rollout_and_no_step(tmp_path, model_type):
    """One greedy rollout made in length-sorted chunks of 2 rows gives the tokens, log-probs and reference of one
    chunk of all 8, and an optimizer step whose micro-batches are re-cut by length (dapo: the step's token mean)
    ends at the weights of the randomly cut step (SGD: Adam's first step, ~lr x sign(gradient), would turn the
    rounding of near-zero gradients into lr-sized differences); with bnpo (a token mean per micro-batch) the default
    keeps the random cut, bit for bit."""
    def trainer_for(loss_type="dapo", **options):
        args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                         gradient_accumulation_steps=4, rollout_batch_size=8, num_ppo_epochs=1, response_length=5,
                         max_steps=1, save_strategy="no", report_to="none", learning_rate=1e-2, seed=0,
                         disable_tqdm=True, kl_coef=0.1, loss_type=loss_type, generation_kwargs={"do_sample": False},
                         optim="sgd", **options)
        return PPOTrainer(build(model_type), lambda prompts, completions, **kw: [len(c) % 3 for c in completions],
                          args=args, train_dataset=prompt_dataset(8, seed=1), processing_class=TOKENIZER)

    rows = [dict(zip(prompt_dataset(8, seed=1).column_names, values)) for values in zip(
        *prompt_dataset(8, seed=1).to_dict().values())]
    experiences = {}
    for size, grouping in ((8, False), (2, None)):
        trainer = trainer_for(local_rollout_forward_batch_size=size, group_by_length=grouping)
        prepared = [dict(row, **trainer.train_dataset[i]) for i, row in enumerate(rows)]
        experiences[size] = trainer.rollout_maker.make(trainer.model, prepared, kl_coef=0.1)[0]
    one, chunked = experiences[8], experiences[2]
    assert len(set(chunked.query_mask.sum(1).tolist())) > 2  # prompts of several lengths
    assert torch.equal(chunked.response_ids, one.response_ids)
    mask = one.response_mask.bool()
    for name in ("old_logprobs", "ref_logprobs", "old_values"):
        assert_close(getattr(chunked, name)[mask], getattr(one, name)[mask], atol=1e-5, rtol=1e-4, msg=name)

    def weights_after_a_step(**options):
        trainer = trainer_for(local_rollout_forward_batch_size=8, **options)
        cuts = []
        original = trainer.compute_loss
        trainer.compute_loss = lambda model, inputs, **kw: cuts.append(inputs["query_mask"].sum(1).tolist()) or \
            original(model, inputs, **kw)
        trainer.train()
        return {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}, cuts

    (grouped, grouped_cut), (plain, plain_cut) = weights_after_a_step(), weights_after_a_step(group_by_length=False)
    assert grouped_cut != plain_cut and sorted(sum(grouped_cut, [])) == sorted(sum(plain_cut, []))
    assert [max(c) for c in grouped_cut] == sorted(max(c) for c in grouped_cut)  # micro-batches by length
    for name in plain:
        assert_close(grouped[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    (bnpo, bnpo_cut), (bnpo_plain, bnpo_plain_cut) = (weights_after_a_step(loss_type="bnpo"),
                                                      weights_after_a_step(loss_type="bnpo", group_by_length=False))
    assert bnpo_cut == bnpo_plain_cut
    assert all(torch.equal(bnpo[name], bnpo_plain[name]) for name in bnpo_plain)
