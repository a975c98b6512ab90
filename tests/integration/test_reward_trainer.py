"""RewardTrainer end to end on the toy world: the loss by hand, equal rewards across batch layouts, training,
evaluation, LoRA / QLoRA reward models that reload to the same rewards, the value-head model, reward stats."""

import json
import math
import os

import pytest
import torch
from datasets import Dataset
from torch.testing import assert_close
from transformers import AutoModelForSequenceClassification

from hf_rlhf import ModelConfig, RewardConfig, RewardTrainer
from hf_rlhf.models.value_head import ValueHeadModel, get_rewards, load_reward_stats
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, preference_dataset

pytestmark = pytest.mark.integration

LAYOUTS = {
    "right": {},
    "left": {"padding_side": "left"},
    "padding_free": {"padding_free": True},
    "prefix_sharing": {"prefix_sharing": True},
}


@pytest.fixture(scope="module")
def pairs():
    return preference_dataset(256, seed=1, split="train")


def make_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, learning_rate=3e-3,
                    max_steps=8, logging_steps=4, save_strategy="no", report_to="none", max_length=64,
                    seed=0, disable_tqdm=True, warmup_steps=0)
    defaults.update(kw)
    return RewardConfig(**defaults)


def rewards_alone(model, ids_list):
    """Each sequence run alone, unpadded, read at its last token: the reference. (N,)"""
    model.eval()
    with torch.no_grad():
        return torch.cat([get_rewards(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
                          for ids in ids_list])


def softplus(x):
    return math.log1p(math.exp(x))


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("coefficient", [None, 0.1])
def test_compute_loss_equals_the_formula_by_hand(tmp_path, tokenizer, pairs, margin, coefficient):
    rows = pairs.select(range(6))
    margins = [0.5, -0.25, 0.0, 1.0, 0.125, 2.0]
    if margin:
        rows = rows.add_column("margin", margins)
    model = build_toy_reward_model(tokenizer, "tiny").eval()
    trainer = RewardTrainer(model, args=make_args(tmp_path, center_rewards_coefficient=coefficient),
                            train_dataset=rows, processing_class=tokenizer)
    features = [trainer.train_dataset[i] for i in range(6)]
    with torch.no_grad():
        loss = trainer.compute_loss(model, trainer.data_collator(features)).item()

    chosen = rewards_alone(model, [f["chosen_ids"] for f in features]).tolist()
    rejected = rewards_alone(model, [f["rejected_ids"] for f in features]).tolist()
    m = margins if margin else [0.0] * 6
    expected = sum(softplus(-(c - r - g)) for c, r, g in zip(chosen, rejected, m)) / 6
    if coefficient:
        expected += coefficient * sum((c + r) ** 2 for c, r in zip(chosen, rejected)) / 6
    assert abs(loss - expected) < 1e-6, (loss, expected)


@pytest.mark.parametrize("kind", ["seq_cls", "value_head", "seq_cls_eager"])
def test_every_layout_gives_the_rewards_of_each_sequence_alone(tmp_path, tokenizer, pairs, kind):
    if kind == "value_head":
        model = ValueHeadModel(build_toy_model(tokenizer, "tiny", seed=3))
    else:
        model = build_toy_reward_model(tokenizer, "tiny", seed=3)
        if kind == "seq_cls_eager":
            model.set_attn_implementation("eager")
    model.eval()
    rows = pairs.select(range(8))
    reference = None
    for name, layout in LAYOUTS.items():
        trainer = RewardTrainer(model, args=make_args(tmp_path, **layout), train_dataset=rows,
                                processing_class=tokenizer)
        features = [trainer.train_dataset[i] for i in range(8)]
        with torch.no_grad():
            chosen, rejected = trainer._rewards(model, trainer.data_collator(features))
        if reference is None:
            reference = torch.cat([rewards_alone(model, [f["chosen_ids"] for f in features]),
                                   rewards_alone(model, [f["rejected_ids"] for f in features])])
        assert_close(torch.cat([chosen, rejected]), reference, atol=1e-5, rtol=0, msg=name)


def test_training_learns_logs_and_evaluates(tmp_path, tokenizer, pairs):
    rows = pairs.select(range(16))  # a fixed small set, so a few steps must fit it
    model = build_toy_reward_model(tokenizer, "tiny", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = {}

    def extra_metrics(eval_pred):
        seen["shape"], seen["labels"] = eval_pred.predictions.shape, eval_pred.label_ids
        rewards = torch.as_tensor(eval_pred.predictions)[:, 0]
        # TRL's layout: per eval batch of 4 pairs, 4 chosen rewards then 4 rejected
        chosen, rejected = rewards.reshape(4, 2, 4)[:, 0].reshape(-1), rewards.reshape(4, 2, 4)[:, 1].reshape(-1)
        seen["rewards"] = rewards
        return {"mean_gap": float((chosen - rejected).mean())}

    trainer = RewardTrainer(model, args=make_args(tmp_path, max_steps=24, logging_steps=8, learning_rate=1e-2,
                                                  per_device_eval_batch_size=4),
                            train_dataset=rows, eval_dataset=rows, processing_class=tokenizer,
                            compute_metrics=extra_metrics)
    first = trainer.evaluate()
    trainer.train()
    last = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"], logs
    for key in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"):
        assert key in logs[0] and "eval_" + key in last
    assert 0 <= logs[0]["accuracy"] <= 1
    assert logs[0]["min_reward"] <= logs[0]["mean_reward"] <= logs[0]["max_reward"]
    assert 0 < logs[0]["num_tokens"] < logs[-1]["num_tokens"] == last["eval_num_tokens"]
    assert last["eval_loss"] < first["eval_loss"] and last["eval_accuracy"] >= 0.9, (first, last)
    assert last["eval_mean_gap"] == pytest.approx(last["eval_margin"], abs=1e-5)
    assert seen["shape"] == (32, 1) and seen["labels"] == ()  # TRL 1.16's shapes
    rewards = seen["rewards"]
    assert last["eval_min_reward"] == pytest.approx(float(rewards.min()), abs=1e-5)
    assert last["eval_max_reward"] == pytest.approx(float(rewards.max()), abs=1e-5)
    assert last["eval_mean_reward"] == pytest.approx(float(rewards.mean()), abs=1e-5)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_not_a_reward_model_is_refused(tmp_path, tokenizer, pairs):
    with pytest.raises(ValueError, match="not a reward model"):
        RewardTrainer(build_toy_model(tokenizer, "tiny"), args=make_args(tmp_path), train_dataset=pairs,
                      processing_class=tokenizer)
    model = build_toy_reward_model(tokenizer, "tiny")
    model.score = torch.nn.Linear(64, 2, bias=False)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardTrainer(model, args=make_args(tmp_path), train_dataset=pairs, processing_class=tokenizer)


def test_lora_reward_model_saves_and_reloads_to_identical_rewards(tmp_path, tokenizer, pairs):
    from peft import PeftModel

    base_dir = str(tmp_path / "base")
    build_toy_reward_model(tokenizer, "tiny", seed=0).save_pretrained(base_dir)
    model_config = ModelConfig(model_name_or_path=base_dir, use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0)
    trainer = RewardTrainer(base_dir, args=make_args(tmp_path, learning_rate=1e-2), train_dataset=pairs,
                            processing_class=tokenizer, model_config=model_config)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "score.modules_to_save" in n for n in trainable)
    assert any("score" in n for n in trainable)  # the head trains with the adapter
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    expected = get_rewards(trainer.model.eval(), ids, mask)
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    assert not torch.allclose(get_rewards(base, ids, mask), expected, atol=1e-3)  # training changed the rewards
    reloaded = PeftModel.from_pretrained(base, out).eval()
    assert_close(get_rewards(reloaded, ids, mask), expected)


def test_qlora_reward_model_trains_on_cpu(tmp_path, tokenizer, pairs):
    bnb = pytest.importorskip("bitsandbytes")
    base_dir = str(tmp_path / "base")
    build_toy_reward_model(tokenizer, "tiny", seed=0).save_pretrained(base_dir)
    model_config = ModelConfig(model_name_or_path=base_dir, use_peft=True, load_in_4bit=True,
                               bnb_4bit_use_double_quant=True, lora_r=8, lora_alpha=16, lora_dropout=0.0)
    trainer = RewardTrainer(base_dir, args=make_args(tmp_path, learning_rate=1e-2, max_steps=6, logging_steps=2),
                            train_dataset=pairs, processing_class=tokenizer, model_config=model_config)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(x) for x in losses)
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(trainable[n], after[n]) for n in trainable if "lora_B" in n or "score" in n)


def test_value_head_init_training_and_reload(tmp_path, tokenizer, pairs):
    causal = build_toy_model(tokenizer, "small", seed=0)
    model = ValueHeadModel(causal)
    hidden = causal.config.hidden_size
    std = model.v_head.weight.std().item()
    assert 0.75 / math.sqrt(hidden + 1) < std < 1.25 / math.sqrt(hidden + 1)
    assert (model.v_head.bias == 0).all()

    trainer = RewardTrainer(model, args=make_args(tmp_path, max_steps=4), train_dataset=pairs,
                            processing_class=tokenizer)
    head_before = model.v_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(head_before, model.v_head.weight)
    trainer.save_model()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    expected = get_rewards(model.eval(), batch["input_ids"], batch["attention_mask"])
    reloaded = ValueHeadModel.from_pretrained(trainer.args.output_dir).eval()
    assert_close(get_rewards(reloaded, batch["input_ids"], batch["attention_mask"]), expected)


def test_lora_value_head_reloads_to_identical_rewards(tmp_path, tokenizer, pairs):
    base_dir = str(tmp_path / "base")
    build_toy_model(tokenizer, "tiny", seed=0).save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    model = ValueHeadModel(AutoModelForCausalLM.from_pretrained(base_dir))
    trainer = RewardTrainer(model, args=make_args(tmp_path, max_steps=4, learning_rate=1e-2), train_dataset=pairs,
                            processing_class=tokenizer,
                            model_config=ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0))
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert "v_head.weight" in trainable and all("lora_" in n or n.startswith("v_head") for n in trainable)
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    expected = get_rewards(trainer.model.eval(), batch["input_ids"], batch["attention_mask"])
    reloaded = ValueHeadModel.from_pretrained(out).eval()
    assert_close(get_rewards(reloaded, batch["input_ids"], batch["attention_mask"]), expected)


def test_reward_stats_are_stored_with_the_model(tmp_path, tokenizer, pairs):
    rows = pairs.select(range(40))
    model = build_toy_reward_model(tokenizer, "tiny", seed=0)
    trainer = RewardTrainer(model, args=make_args(tmp_path, max_steps=2, store_reward_stats=True,
                                                  per_device_eval_batch_size=16),
                            train_dataset=rows, processing_class=tokenizer)
    metrics = trainer.train().metrics
    trainer.save_model()
    out = trainer.args.output_dir

    features = [trainer.train_dataset[i] for i in range(40)]
    rewards = rewards_alone(model, [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features])
    mean, std = rewards.double().mean().item(), rewards.double().std(correction=0).item()
    assert metrics["reward_mean"] == pytest.approx(mean, abs=1e-5)
    assert metrics["reward_std"] == pytest.approx(std, abs=1e-5)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["reward_mean"] == pytest.approx(mean, abs=1e-5)
    assert load_reward_stats(out) == {"reward_mean": metrics["reward_mean"], "reward_std": metrics["reward_std"]}
    assert AutoModelForSequenceClassification.from_pretrained(out).config.reward_std == metrics["reward_std"]

    # a seeded sample of the train set, and any other dataset
    trainer.args.reward_stats_num_samples = 8
    sample = trainer.compute_reward_stats()
    assert sample != {"reward_mean": mean, "reward_std": std} and sample == trainer.compute_reward_stats()
    other = trainer.compute_reward_stats(pairs.select(range(40, 48)))
    assert load_reward_stats(model) == other


def test_conversational_pairs_with_margin_train(tmp_path, tokenizer):
    rows = preference_dataset(64, seed=2, conversational=True)
    rows = rows.add_column("margin", [1.0] * len(rows))
    trainer = RewardTrainer(build_toy_reward_model(tokenizer, "tiny"), args=make_args(tmp_path, max_steps=2),
                            train_dataset=rows, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["margin"].tolist() == [1.0] * 4
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_bad_pairs_fail_before_training(tmp_path, tokenizer):
    from hf_rlhf.data import DataValidationError

    rows = Dataset.from_list([{"prompt": "1+2=", "chosen": "3", "rejected": "4"},
                              {"prompt": "2+2=", "chosen": "4", "rejected": "4"}])
    with pytest.raises(DataValidationError, match="row 1, field 'rejected'"):
        RewardTrainer(build_toy_reward_model(tokenizer, "tiny"), args=make_args(tmp_path), train_dataset=rows,
                      processing_class=tokenizer)


def test_value_head_model_resumes_from_a_checkpoint_exactly(tmp_path, tokenizer, pairs):
    # a ValueHeadModel is not a PreTrainedModel: the shared trainer base saves it with its own save_pretrained and
    # resumes it with load_checkpoint (this raised NotImplementedError before)
    def run(output_dir, max_steps, resume=None):
        model = ValueHeadModel(build_toy_model(tokenizer, "tiny", seed=5))
        args = make_args(tmp_path, output_dir=str(output_dir), max_steps=max_steps, logging_steps=1,
                         save_strategy="steps", save_steps=2)
        trainer = RewardTrainer(model, args=args, train_dataset=pairs, processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", 4)  # writes checkpoint-2 (and -4) on its way
    resumed = run(tmp_path / "resumed", 4, resume=str(tmp_path / "full" / "checkpoint-2"))
    losses = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    resumed_losses = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 2}
    assert resumed_losses == {step: losses[step] for step in (3, 4)}
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_tokenizer_without_pad_token_pads_with_eos_and_scores_the_real_last_token(tmp_path, tokenizer, pairs):
    """As TRL: no pad token -> eos pads. Scores are read at the attention mask's last position, so a sequence that
    ends in eos is scored at its eos (transformers' own pooling would stop before it), the same as alone."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    trainer = RewardTrainer(build_toy_reward_model(tok), args=make_args(tmp_path, max_steps=2),
                            train_dataset=pairs, processing_class=tok)
    assert tok.pad_token_id == tok.eos_token_id == trainer.model.config.pad_token_id
    trainer.train()
    features = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(features)
    sequences = [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features]
    assert all(ids[-1] == tok.eos_token_id for ids in sequences)
    model = trainer.model.eval()
    with torch.no_grad():
        batched = get_rewards(model, batch["input_ids"], batch["attention_mask"])
    assert_close(batched, rewards_alone(model, sequences), atol=1e-5, rtol=0)


def test_evaluate_prepares_raw_pairs_passed_to_it(tmp_path, tokenizer, pairs):
    """As TRL: `evaluate(eval_dataset=raw_pairs)` tokenizes the pairs like an eval set given at init."""
    raw = preference_dataset(12, seed=4, split="test")
    args = make_args(tmp_path, max_steps=1, per_device_eval_batch_size=4)
    at_init = RewardTrainer(build_toy_reward_model(tokenizer), args=args, train_dataset=pairs, eval_dataset=raw,
                            processing_class=tokenizer).evaluate()
    trainer = RewardTrainer(build_toy_reward_model(tokenizer), args=args, train_dataset=pairs,
                            processing_class=tokenizer)
    passed = trainer.evaluate(eval_dataset=raw)
    assert passed["eval_loss"] == pytest.approx(at_init["eval_loss"], abs=1e-6)
    assert passed["eval_accuracy"] == at_init["eval_accuracy"]
