"""Drop-in check: the same small scripts run through `trl` 1.16 and through `hf_rlhf`, only the import changed.

Each script is written once, as a function of the library module (`trl` or `hf_rlhf`), the way a TRL user
writes it: `lib.SFTConfig(...)`, `lib.SFTTrainer(model=path, ...)`. Both runs start from the same tiny model
saved to a directory, the same toy tokenizer (it has a chat template) and the same seed, in fp32 on CPU, for 3
steps and one evaluation. Asserted: the training and evaluation losses agree to 1e-5 at every step, and the
logged metric names (train and eval logs) are the same.

Known differences, by design (values only; the names agree):
- the prompt / completion boundary (SFT, reward, DPO): where tokens merge across it (a prompt ending in a space,
  "37+45= " + "82" with a tokenizer that has " 8"), TRL tokenizes prompt + completion jointly, so the prompt's last
  token in training is not the one the model sees at inference; hf_rlhf keeps the prompt's own tokens
  (`prompt_tokenization="apart"`, the default), so its losses differ on such rows (0.005-0.05 here), and
  `prompt_tokenization="joint"` gives TRL's losses exactly (`test_prompt_ending_in_a_space` shows both). The number
  of rows affected is logged once per dataset. Implicit-prompt DPO pairs (the prompt extracted where the texts
  differ) are tokenized as whole texts, as TRL does.
- eval `entropy` / `mean_token_accuracy` (SFT) and `accuracy` / `margin` / `min_reward` / `max_reward` (reward)
  over more than one eval batch: TRL averages per-batch means and per-batch extremes; hf_rlhf logs the exact
  token / pair mean and the true min / max over the whole evaluation (and over ranks).
- `completion_only_loss=None`: TRL decides it once, from the train set's first row, and applies it to the eval
  sets too; hf_rlhf decides it per dataset (a prompt/completion eval set beside a text train set keeps its
  completion-only loss). The scripts use one format per case.
- KTO's `rewards/*`, `logps/*` over more than one batch (eval): TRL averages per-batch means; hf_rlhf logs the
  mean over every completion of that label.
- TRL's configs default to `bf16=True` and `gradient_checkpointing=True`; hf_rlhf's are device-aware (off on CPU).
  The scripts set both, so they compare the same arithmetic.
"""

import random

import numpy as np
import pytest
from datasets import Dataset, load_dataset
from transformers import set_seed

pytestmark = pytest.mark.integration

trl = pytest.importorskip("trl")
import hf_rlhf  # noqa: E402
from hf_rlhf.toy import (  # noqa: E402
    build_toy_model,
    build_toy_reward_model,
    build_toy_tokenizer,
    preference_dataset,
    sft_dataset,
    unpaired_dataset,
)

LIBRARIES = (trl, hf_rlhf)
# what the Trainer itself logs, the same through either library
TIMING_KEYS = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "train_runtime",
               "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss", "epoch"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    """A tiny causal LM and a tiny reward model, each saved with the tokenizer."""
    root = tmp_path_factory.mktemp("models")
    paths = {"lm": str(root / "lm"), "rm": str(root / "rm")}
    for key, build in (("lm", build_toy_model), ("rm", build_toy_reward_model)):
        build(tokenizer).save_pretrained(paths[key])
        tokenizer.save_pretrained(paths[key])
    return paths


def config_kwargs(output_dir: str) -> dict:
    return dict(output_dir=output_dir, max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="no",
                report_to="none", seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False, disable_tqdm=True)


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    set_seed(seed)


# ---------------------------------------------------------------------------------------------------
# the scripts: written once, run with lib = trl and lib = hf_rlhf


def sft_script(lib, model_path, tokenizer, train, evaluation, output_dir, peft_config=None, formatting_func=None,
               **config):
    seed_everything()
    args = lib.SFTConfig(**{**config_kwargs(output_dir), "max_length": 64, **config})
    extra = {"formatting_func": formatting_func} if formatting_func is not None else {}
    trainer = lib.SFTTrainer(model=model_path, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer, peft_config=peft_config, **extra)
    trainer.train()
    return trainer.state.log_history


def reward_script(lib, model_path, tokenizer, train, evaluation, output_dir, seen=None, **config):
    seed_everything()
    args = lib.RewardConfig(**{**config_kwargs(output_dir), "max_length": 64, **config})

    def compute_metrics(eval_pred):
        if seen is not None:
            seen[lib.__name__] = (np.asarray(eval_pred.predictions), eval_pred.label_ids)
        return {}

    trainer = lib.RewardTrainer(model=model_path, args=args, train_dataset=train, eval_dataset=evaluation,
                                processing_class=tokenizer, compute_metrics=compute_metrics)
    trainer.train()
    return trainer.state.log_history


# ---------------------------------------------------------------------------------------------------
# comparison


def split_logs(history: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [h for h in history if "loss" in h]
    evaluation = [h for h in history if "eval_loss" in h]
    return train, evaluation


def compare(histories: dict, relative: bool = False) -> float:
    """Assert equal losses (1e-5; `relative`: 1e-5 of the loss when it exceeds 1, for losses of size 50 as
    `sppo_hard`'s, where fp32 rounding alone is that large) and equal metric names between the two runs; return the
    largest loss gap."""
    (trl_train, trl_eval), (ours_train, ours_eval) = (split_logs(histories[lib]) for lib in LIBRARIES)
    assert len(trl_train) == len(ours_train) == 3 and len(trl_eval) == len(ours_eval) == 1
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(trl_train, ours_train)]
    gaps += [abs(trl_eval[0]["eval_loss"] - ours_eval[0]["eval_loss"])]
    for theirs, ours in zip(trl_train + trl_eval, ours_train + ours_eval):
        assert set(theirs) - TIMING_KEYS == set(ours) - TIMING_KEYS, (sorted(theirs), sorted(ours))
        num_tokens = "eval_num_tokens" if "eval_loss" in theirs else "num_tokens"
        assert theirs[num_tokens] == ours[num_tokens]  # the same definition: real tokens trained on so far
    scale = max(1.0, *(abs(h["loss"]) for h in trl_train)) if relative else 1.0
    assert max(gaps) <= 1e-5 * scale, (gaps, [h["loss"] for h in trl_train], [h["loss"] for h in ours_train])
    return max(gaps)


def run_both(script, tmp_path, *args, relative: bool = False, **kwargs) -> float:
    histories = {lib: script(lib, *args, output_dir=str(tmp_path / lib.__name__), **kwargs) for lib in LIBRARIES}
    gap = compare(histories, relative)
    print(f"max |loss diff| {gap:.2e}; metric names: {sorted(set(split_logs(histories[hf_rlhf])[0][0]) - TIMING_KEYS)}")
    return gap


def streamed(dataset: Dataset, tmp_path, name: str):
    path = str(tmp_path / f"{name}.jsonl")
    dataset.to_json(path)
    return load_dataset("json", data_files=path, split="train", streaming=True)


# ---------------------------------------------------------------------------------------------------
# cases


@pytest.mark.parametrize("fmt,packing", [("text", False), ("prompt_completion", False), ("messages", False),
                                         ("text", True), ("prompt_completion", True), ("messages", True)])
def test_sft(tmp_path, tokenizer, model_dirs, fmt, packing):
    run_both(sft_script, tmp_path, model_dirs["lm"], tokenizer, sft_dataset(24, seed=0, format=fmt),
             sft_dataset(8, seed=1, format=fmt), packing=packing)


def test_sft_lora(tmp_path, tokenizer, model_dirs):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    run_both(sft_script, tmp_path, model_dirs["lm"], tokenizer, sft_dataset(24, seed=0),
             sft_dataset(8, seed=1), peft_config=lora, learning_rate=1e-2)


def _question_answer(n: int, seed: int) -> Dataset:
    rows = sft_dataset(n, seed=seed)
    return Dataset.from_dict({"question": rows["prompt"], "answer": rows["completion"]})


def test_sft_formatting_func(tmp_path, tokenizer, model_dirs):
    run_both(sft_script, tmp_path, model_dirs["lm"], tokenizer, _question_answer(24, 0), _question_answer(8, 1),
             formatting_func=lambda row: f"{row['question']}{row['answer']}")


@pytest.mark.parametrize("packing", [False, True])
def test_sft_streamed(tmp_path, tokenizer, model_dirs, packing):
    run_both(sft_script, tmp_path, model_dirs["lm"], tokenizer,
             streamed(sft_dataset(40, seed=0, format="text"), tmp_path, "train"),
             sft_dataset(8, seed=1, format="text"), packing=packing)


def test_reward(tmp_path, tokenizer, model_dirs):
    seen = {}
    run_both(reward_script, tmp_path, model_dirs["rm"], tokenizer, preference_dataset(24, seed=0),
             preference_dataset(8, seed=1), seen=seen)
    # compute_metrics gets TRL's arrays: (2N, 1) rewards, per eval batch its chosen then its rejected; no labels
    (theirs, their_labels), (ours, our_labels) = seen["trl"], seen["hf_rlhf"]
    assert theirs.shape == ours.shape == (16, 1) and their_labels == our_labels == ()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_reward_streamed(tmp_path, tokenizer, model_dirs):
    run_both(reward_script, tmp_path, model_dirs["rm"], tokenizer,
             streamed(preference_dataset(24, seed=0), tmp_path, "pairs"), preference_dataset(8, seed=1))


def test_sft_bf16_checkpoint_trains_every_parameter_in_fp32(tmp_path, tokenizer):
    """A checkpoint saved in bf16 (most hub models), full fine-tuning with the default config: both libraries load it
    in float32, so even the smallest update (norm weights at a 2e-5 learning rate) lands and the losses agree. With
    pure-bf16 weights (`dtype="auto"` here) the norm weights' updates round away."""
    import torch

    path = str(tmp_path / "bf16")
    build_toy_model(tokenizer).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    initial = {n: p.float().clone() for n, p in build_toy_model(tokenizer).to(torch.bfloat16).named_parameters()}
    trained, histories = {}, {}
    for lib in LIBRARIES:
        seed_everything()
        args = lib.SFTConfig(**{**config_kwargs(str(tmp_path / lib.__name__)), "max_length": 64,
                                "learning_rate": 2e-5})
        trainer = lib.SFTTrainer(model=path, args=args, train_dataset=sft_dataset(24, seed=0),
                                 eval_dataset=sft_dataset(8, seed=1), processing_class=tokenizer)
        trainer.train()
        histories[lib] = trainer.state.log_history
        trained[lib] = dict(trainer.model.named_parameters())
    print("loss curves (trl, hf_rlhf):", [[h["loss"] for h in split_logs(histories[lib])[0]] for lib in LIBRARIES])
    compare(histories)
    for lib in LIBRARIES:
        assert all(p.dtype == torch.float32 for p in trained[lib].values()), lib.__name__
        unchanged = [n for n, p in trained[lib].items() if torch.equal(p.detach().float(), initial[n])]
        assert not unchanged, (lib.__name__, unchanged)

    # the opt-in: weights kept in their saved bf16; the norm weights' tiny updates round away
    from hf_rlhf import ModelConfig

    seed_everything()
    args = hf_rlhf.SFTConfig(**{**config_kwargs(str(tmp_path / "bf16_weights")), "max_length": 64,
                                "learning_rate": 2e-5, "eval_strategy": "no"})
    trainer = hf_rlhf.SFTTrainer(model=path, args=args, train_dataset=sft_dataset(24, seed=0),
                                 processing_class=tokenizer, model_config=ModelConfig(dtype="auto"))
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    unchanged = [n for n, p in params.items() if torch.equal(p.detach().float(), initial[n])]
    assert unchanged and all("norm" in n for n in unchanged), unchanged


# ---------------------------------------------------------------------------------------------------
# DPO: every loss type TRL 1.16 takes, the reference a frozen copy of the policy (TRL's for a model path)


def dpo_script(lib, model_path, tokenizer, train, evaluation, output_dir, peft_config=None, compute_metrics=None,
               **config):
    seed_everything()
    args = lib.DPOConfig(**{**config_kwargs(output_dir), "max_length": 64, **config})
    trainer = lib.DPOTrainer(model=model_path, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer, peft_config=peft_config, compute_metrics=compute_metrics)
    trainer.train()
    return trainer.state.log_history


DPO_CASES = [{"loss_type": t} for t in ("sigmoid", "hinge", "ipo", "nca_pair", "robust", "bco_pair", "sppo_hard",
                                        "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                                        "sigmoid_norm")] + [
    {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.5, "label_smoothing": 0.1},
    {"loss_type": "sigmoid", "precompute_ref_log_probs": True},
    {"loss_type": "sigmoid", "use_weighting": True, "ld_alpha": 0.5, "f_divergence_type": "js_divergence"},
]


@pytest.mark.parametrize("config", DPO_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))  # ~1.3 s each
def test_dpo(tmp_path, tokenizer, model_dirs, config):
    pairs = preference_dataset(16, seed=1)
    held_out = preference_dataset(8, seed=2)
    gap = run_both(dpo_script, tmp_path, model_dirs["lm"], tokenizer, pairs, held_out, relative=True, **config)
    print(f"DPO {config}: max |loss diff| {gap:.2e}")


def test_dpo_lora(tmp_path, tokenizer, model_dirs):
    """A LoRA policy: the reference is the same model with its adapter off, in both libraries (no second model)."""
    from peft import LoraConfig

    pairs = preference_dataset(16, seed=1)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    gap = run_both(dpo_script, tmp_path, model_dirs["lm"], tokenizer, pairs, preference_dataset(8, seed=2),
                   relative=True, peft_config=lora)
    print(f"DPO LoRA: max |loss diff| {gap:.2e}")


def test_dpo_compute_metrics(tmp_path, tokenizer, model_dirs):
    """`compute_metrics` with TRL's signature (an `EvalPrediction`) gets what TRL's gives it: the policy's logits
    (2B, T, V) of each eval batch, chosen rows then rejected, and the input ids as labels; what it returns is
    logged as `eval_<name>` by both."""
    seen = {}

    def metrics_of(lib):
        def compute_metrics(eval_pred):
            seen[lib.__name__] = (np.asarray(eval_pred.predictions), np.asarray(eval_pred.label_ids))
            return {"mean_logit": float(np.asarray(eval_pred.predictions).mean())}
        return compute_metrics

    histories = {lib: dpo_script(lib, model_dirs["lm"], tokenizer, preference_dataset(16, seed=1),
                                 preference_dataset(8, seed=2), output_dir=str(tmp_path / lib.__name__),
                                 compute_metrics=metrics_of(lib)) for lib in LIBRARIES}
    compare(histories, relative=True)
    (theirs, their_labels), (ours, our_labels) = seen["trl"], seen["hf_rlhf"]
    assert theirs.shape == ours.shape and theirs.shape[0] == 16 and theirs.shape[2] == len(tokenizer)
    np.testing.assert_array_equal(our_labels, their_labels)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    evals = [split_logs(histories[lib])[1][0]["eval_mean_logit"] for lib in LIBRARIES]
    assert evals[0] == pytest.approx(evals[1], abs=1e-6)


@pytest.mark.parametrize("prompt", ["explicit", "implicit"])
def test_dpo_conversational(tmp_path, tokenizer, model_dirs, prompt):
    """Conversational pairs through the chat template, with the prompt as a column or inside both sides (TRL
    extracts it as the common prefix)."""
    def rows(n, seed):
        data = preference_dataset(n, seed=seed, conversational=True)
        if prompt == "implicit":
            data = Dataset.from_dict({"chosen": [p + c for p, c in zip(data["prompt"], data["chosen"])],
                                      "rejected": [p + r for p, r in zip(data["prompt"], data["rejected"])]})
        return data

    gap = run_both(dpo_script, tmp_path, model_dirs["lm"], tokenizer, rows(16, 1), rows(8, 2), relative=True)
    print(f"DPO conversational {prompt} prompt: max |loss diff| {gap:.2e}")


# ---------------------------------------------------------------------------------------------------
# KTO: unpaired rows (and pairs split into them), the KL reference point from mismatched completions


def kto_script(lib, model_path, tokenizer, train, evaluation, output_dir, peft_config=None, **config):
    seed_everything()
    args = lib.KTOConfig(**{**config_kwargs(output_dir), "max_length": 64, **config})
    trainer = lib.KTOTrainer(model=model_path, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return trainer.state.log_history


KTO_CASES = [{}, {"loss_type": "apo_zero_unpaired"}, {"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7},
             {"precompute_ref_log_probs": True}, {"rows": "paired"}, {"rows": "conversational"}, {"lora": True}]


@pytest.mark.parametrize("case", KTO_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_kto(tmp_path, tokenizer, model_dirs, case):
    config = dict(case)
    rows, extra = config.pop("rows", "unpaired"), {}
    if config.pop("lora", False):
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                          task_type="CAUSAL_LM")
    make = {"unpaired": lambda n, seed: unpaired_dataset(n, seed=seed),
            "paired": lambda n, seed: preference_dataset(n, seed=seed),  # split into unpaired rows by the trainers
            "conversational": lambda n, seed: unpaired_dataset(n, seed=seed, conversational=True)}[rows]
    gap = run_both(kto_script, tmp_path, model_dirs["lm"], tokenizer, make(8, 1), make(4, 2), **extra, **config)
    print(f"KTO {case}: max |loss diff| {gap:.2e}")


# ---------------------------------------------------------------------------------------------------
# The prompt / completion boundary: prompts ending in a space, with a tokenizer that merges " 7" into one token


def space_merging_tokenizer(base):
    """The toy tokenizer plus one token per digit with a leading space (" 7"), as GPT-2-style BPEs have: "37+45= "
    ends in a " " token, while "37+45= 82" has " 8" where the prompt's " " was (tokens merge across the boundary)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    vocab = dict(base.get_vocab())
    for digit in "0123456789":
        vocab[" " + digit] = len(vocab)
    backend.model = models.BPE(vocab=vocab, merges=[(" ", d) for d in "0123456789"], unk_token=base.unk_token)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[\s\S]"), behavior="isolated")  # a character, its space
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=base.bos_token, eos_token=base.eos_token,
                                   pad_token=base.pad_token, unk_token=base.unk_token, padding_side="right",
                                   additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
                                   model_max_length=256, chat_template=base.chat_template)


@pytest.fixture(scope="module")
def spaced(tmp_path_factory, tokenizer):
    """The space-merging tokenizer, and a tiny causal LM and reward model saved with it."""
    merging = space_merging_tokenizer(tokenizer)
    assert merging("1= ")["input_ids"][-1] != merging("1= 2")["input_ids"][-2]  # " " + "2" -> " 2"
    root = tmp_path_factory.mktemp("spaced")
    paths = {"lm": str(root / "lm"), "rm": str(root / "rm")}
    for key, build in (("lm", build_toy_model), ("rm", build_toy_reward_model)):
        build(merging).save_pretrained(paths[key])
        merging.save_pretrained(paths[key])
    return merging, paths


def _spaced_prompts(data: Dataset) -> Dataset:
    return data.map(lambda row: {"prompt": row["prompt"] + " "})


@pytest.mark.parametrize("trainer", ["sft", "reward", "dpo"])
def test_prompt_ending_in_a_space(tmp_path, spaced, trainer, caplog):
    """Prompts ending in a space ("37+45= " + "82"): TRL tokenizes prompt + completion jointly (" 8" replaces the
    prompt's last token " "); hf_rlhf by default keeps the prompt's own tokens, as the model sees them at inference,
    so its losses differ; `prompt_tokenization="joint"` gives TRL's losses exactly. The rows affected are logged."""
    merging, paths = spaced
    script, model, make = {
        "sft": (sft_script, paths["lm"], lambda n, seed: sft_dataset(n, seed=seed)),
        "reward": (reward_script, paths["rm"], lambda n, seed: preference_dataset(n, seed=seed)),
        "dpo": (dpo_script, paths["lm"], lambda n, seed: preference_dataset(n, seed=seed)),
    }[trainer]
    train, evaluation = _spaced_prompts(make(16, 1)), _spaced_prompts(make(8, 2))
    histories = {trl: script(trl, model, merging, train, evaluation, output_dir=str(tmp_path / "trl"))}
    with caplog.at_level("WARNING", logger="hf_rlhf"):
        ours = {mode: script(hf_rlhf, model, merging, train, evaluation, output_dir=str(tmp_path / mode),
                             prompt_tokenization=mode) for mode in ("apart", "joint")}
    gap = compare({trl: histories[trl], hf_rlhf: ours["joint"]}, relative=True)
    theirs, apart = split_logs(histories[trl])[0], split_logs(ours["apart"])[0]
    default = max(abs(a["loss"] - b["loss"]) for a, b in zip(theirs, apart))
    print(f"{trainer}, prompts ending in a space: max |loss diff| vs TRL: joint {gap:.2e}, "
          f"apart (default) {default:.3f}")
    assert default > 1e-3
    config = {"sft": "SFTConfig", "reward": "RewardConfig", "dpo": "DPOConfig"}[trainer]
    logged = [r.getMessage() for r in caplog.records if f"{config}.prompt_tokenization" in r.getMessage()]
    assert any("of 16 rows: tokens merge across the prompt / completion boundary" in m for m in logged), logged
