"""Streamed datasets (`load_dataset("json", ..., streaming=True)`) for SFT, reward and DPO training.

- prepared lazily, a stream yields exactly the rows the in-memory preparation gives (every SFT format, preference
  pairs), and packing on the fly gives rows of at most `max_length` holding every token;
- a bad row fails when it streams, naming its index in the stream and its field (validation is lazy: rows are
  checked just before they are tokenized; only the first row is looked at up front, for the format);
- `max_steps` is required, as TRL; a streamed run trains and logs TRL's metric names.
"""

import pytest
import torch
from datasets import IterableDataset, load_dataset

from hf_rlhf import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from hf_rlhf.data import DataValidationError, prepare_preference_dataset, prepare_sft_dataset
from hf_rlhf.data.dpo import prepare_dpo_dataset
from hf_rlhf.toy import build_toy_model, build_toy_reward_model, preference_dataset, sft_dataset

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def stream(dataset, tmp_path, name="rows.jsonl") -> IterableDataset:
    """`dataset` written to a local jsonl and read back as a `datasets` stream."""
    path = str(tmp_path / name)
    dataset.to_json(path)
    streamed = load_dataset("json", data_files=path, split="train", streaming=True)
    assert isinstance(streamed, IterableDataset)
    return streamed


def sft_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                    report_to="none", save_strategy="no", learning_rate=1e-3, max_length=64, seed=0, use_cpu=True,
                    disable_tqdm=True)
    return SFTConfig(**{**defaults, **kw})


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "messages", "conversational_prompt_completion"])
def test_streamed_sft_rows_equal_in_memory_rows(tmp_path, tokenizer, fmt):
    rows = sft_dataset(12, seed=0, format=fmt)
    args = sft_args(tmp_path, max_length=24)  # some rows over-long: truncated the same way
    expected = prepare_sft_dataset(rows, tokenizer, args).to_list()
    assert list(prepare_sft_dataset(stream(rows, tmp_path), tokenizer, args)) == expected


def test_streamed_preference_rows_equal_in_memory_rows(tmp_path, tokenizer):
    pairs = preference_dataset(12, seed=0)
    args = RewardConfig(output_dir=str(tmp_path / "out"), max_length=20, use_cpu=True)  # drop over-long pairs
    expected = prepare_preference_dataset(pairs, tokenizer, args).to_list()
    assert 0 < len(expected) < 12
    assert list(prepare_preference_dataset(stream(pairs, tmp_path), tokenizer, args)) == expected


def test_bad_streamed_row_names_row_and_field_when_it_streams(tmp_path, tokenizer):
    rows = sft_dataset(8, seed=0).to_list()
    rows[5]["completion"] = ""
    from datasets import Dataset

    streamed = stream(Dataset.from_list(rows), tmp_path)
    prepared = prepare_sft_dataset(streamed, tokenizer, sft_args(tmp_path))  # lazy: nothing read past row 0 yet
    it = iter(prepared)
    for _ in range(5):
        next(it)  # rows 0-4 are fine
    with pytest.raises(DataValidationError, match=r"row 5, field 'completion': expected a non-empty string") as err:
        next(it)
    assert (err.value.row, err.value.field) == (5, "completion")

    pairs = preference_dataset(6, seed=0).to_list()
    pairs[3]["rejected"] = pairs[3]["chosen"]
    prepared = prepare_preference_dataset(stream(Dataset.from_list(pairs), tmp_path, "pairs.jsonl"), tokenizer,
                                          RewardConfig(output_dir=str(tmp_path / "out"), use_cpu=True))
    with pytest.raises(DataValidationError, match=r"row 3, field 'rejected': expected a response different"):
        list(prepared)


def test_streamed_overlong_error_names_the_row(tmp_path, tokenizer):
    rows = sft_dataset(8, seed=0)
    args = sft_args(tmp_path, max_length=12, overlong_policy="error")
    lengths = [len(r["input_ids"]) for r in prepare_sft_dataset(rows, tokenizer, sft_args(tmp_path))]
    first = next(i for i, n in enumerate(lengths) if n > 12)
    with pytest.raises(DataValidationError, match=rf"row {first}, field 'prompt\+completion': expected at most "
                                                  r"max_length=12"):
        list(prepare_sft_dataset(stream(rows, tmp_path), tokenizer, args))


def test_streamed_training_needs_max_steps(tmp_path, tokenizer):
    streamed = stream(sft_dataset(8, seed=0), tmp_path)
    with pytest.raises(ValueError, match="streamed IterableDataset.*set max_steps > 0"):
        SFTTrainer(build_toy_model(tokenizer), args=sft_args(tmp_path, max_steps=-1), train_dataset=streamed,
                   processing_class=tokenizer)
    with pytest.raises(ValueError, match="set max_steps > 0"):
        RewardTrainer(build_toy_reward_model(tokenizer),
                      args=RewardConfig(output_dir=str(tmp_path / "rm"), use_cpu=True, max_steps=-1),
                      train_dataset=stream(preference_dataset(8, seed=0), tmp_path, "pairs.jsonl"),
                      processing_class=tokenizer)


@pytest.mark.parametrize("packing", [False, True])
def test_streamed_sft_trains_packing_on_the_fly(tmp_path, tokenizer, packing):
    streamed = stream(sft_dataset(40, seed=0, format="text"), tmp_path)
    # before the trainer: building a config resets accelerate's state
    tokens = sum(len(r["input_ids"]) for r in prepare_sft_dataset(sft_dataset(40, seed=0, format="text"),
                                                                  tokenizer, sft_args(tmp_path)))
    model = build_toy_model(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SFTTrainer(model, args=sft_args(tmp_path, packing=packing), train_dataset=streamed,
                         processing_class=tokenizer)
    if packing:
        packed = list(trainer.train_dataset)
        assert all(len(r["input_ids"]) <= 64 for r in packed) and len(packed) < 40
        assert sum(len(r["input_ids"]) for r in packed) == tokens  # every token, none lost
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(logs[0])
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_streamed_reward_trains(tmp_path, tokenizer):
    streamed = stream(preference_dataset(24, seed=0), tmp_path)
    model = build_toy_reward_model(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = RewardConfig(output_dir=str(tmp_path / "rm"), per_device_train_batch_size=4, max_steps=3,
                        logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-3, use_cpu=True,
                        disable_tqdm=True, store_reward_stats=True, reward_stats_num_samples=8)
    trainer = RewardTrainer(model, args=args, train_dataset=streamed, processing_class=tokenizer)
    metrics = trainer.train().metrics
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and {"accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"} <= set(
        logs[0])
    assert "reward_mean" in metrics and metrics["reward_std"] > 0
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def implicit_prompt(pairs):
    """The same pairs with the prompt inside both texts (TRL's implicit-prompt format)."""
    return pairs.map(lambda r: {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]},
                     remove_columns=["prompt"])


@pytest.mark.parametrize("fmt", ["explicit", "implicit", "conversational"])
@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_streamed_dpo_rows_equal_in_memory_rows(tmp_path, tokenizer, fmt, policy):
    pairs = preference_dataset(16, seed=0, conversational=fmt == "conversational")
    pairs = implicit_prompt(pairs) if fmt == "implicit" else pairs
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_length=12, overlong_policy=policy, use_cpu=True)
    expected = prepare_dpo_dataset(pairs, tokenizer, args).to_list()
    assert 0 < len(expected) <= 16
    if policy == "drop":
        assert len(expected) < 16  # some pairs over max_length: dropped the same way
    assert list(prepare_dpo_dataset(stream(pairs, tmp_path), tokenizer, args)) == expected


def test_bad_streamed_dpo_row_names_row_and_field_when_it_streams(tmp_path, tokenizer):
    from datasets import Dataset

    pairs = preference_dataset(8, seed=0).to_list()
    pairs[5]["rejected"] = pairs[5]["chosen"]
    args = DPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True)
    prepared = prepare_dpo_dataset(stream(Dataset.from_list(pairs), tmp_path), tokenizer, args)  # lazy
    it = iter(prepared)
    for _ in range(5):
        next(it)  # rows 0-4 are fine
    with pytest.raises(DataValidationError, match=r"row 5, field 'rejected': expected a response different"):
        next(it)

    args = DPOConfig(output_dir=str(tmp_path / "out"), max_length=10, overlong_policy="error", use_cpu=True)
    lengths = [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
               for r in prepare_dpo_dataset(preference_dataset(8, seed=0), tokenizer, DPOConfig(
                   output_dir=str(tmp_path / "out"), use_cpu=True))]
    first = next(i for i, n in enumerate(lengths) if n > 10)
    with pytest.raises(DataValidationError, match=rf"row {first}, field 'chosen/rejected': expected prompt \+ "
                                                  r"completion of at most max_length=10"):
        list(prepare_dpo_dataset(stream(preference_dataset(8, seed=0), tmp_path, "pairs.jsonl"), tokenizer, args))


def test_dpo_trains_on_an_endless_stream(tmp_path, tokenizer):
    """A stream with no end (a generator of pairs) trains max_steps batches: nothing reads it whole up front (it was
    loaded into memory before, which never returns on an endless stream; this one raises past 1,000 rows)."""
    from datasets import IterableDataset

    pairs = preference_dataset(64, seed=0).to_list()
    read = []

    def endless():
        for i in range(1000):
            read.append(i)
            yield pairs[i % len(pairs)]
        raise RuntimeError("the stream was read past 1,000 rows")

    streamed = IterableDataset.from_generator(endless)
    model = build_toy_model(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                     report_to="none", save_strategy="no", learning_rate=1e-3, max_length=32, use_cpu=True,
                     disable_tqdm=True, beta=0.5)
    with pytest.raises(ValueError, match="set max_steps > 0"):
        DPOTrainer(model, args=DPOConfig(output_dir=str(tmp_path / "x"), use_cpu=True, max_steps=-1),
                   train_dataset=streamed, processing_class=tokenizer)
    trainer = DPOTrainer(model, args=args, train_dataset=streamed, processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and {"rewards/chosen", "rewards/margins", "logps/chosen", "logits/rejected"} <= set(logs[0])
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert len(read) < 100  # a few batches' worth (and look-aheads), not the stream
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
