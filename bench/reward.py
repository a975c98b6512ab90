"""Reward-model training pairs/s: hf_rlhf `RewardTrainer` (padded, padding-free, prefix-shared) vs `trl.RewardTrainer`.

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C D A B C D ...)
so that drifts in the load of this shared machine hit every configuration alike. Every run trains the same seeded
toy reward model (`build_toy_reward_model`, sdpa, fp32, no activation checkpointing) for one epoch over the same
toy preference pairs (`hf_rlhf.toy.preference_dataset`, tokenized identically by both libraries: bos + prompt +
answer + eos) with the same optimizer, batch size, data order and seed. What differs is how a batch is laid out:

    padded          hf_rlhf `PairwiseCollator`: the 2B sequences right-padded to the batch's longest (as TRL).
    padding_free    hf_rlhf `padding_free=True`: the 2B sequences end to end in one row (made for flash attention).
    prefix_sharing  hf_rlhf `prefix_sharing=True`: one row per pair, [prompt | chosen answer | rejected answer];
                    the prompt both share is computed once instead of twice.
    trl             `trl.RewardTrainer` with the same settings (bf16 and gradient checkpointing off).
    extras (--configs): trl_defaults (TRL with its own default gradient checkpointing, still fp32).

pairs/s = pairs trained on / wall time of `trainer.train()` (model and dataset preparation excluded).

    python bench/reward.py                      # ~5 min on 2 busy CPU cores
    python bench/reward.py --quick --repeats 1 --output /tmp/smoke.json     # smoke test, < 60 s
"""

from __future__ import annotations

import sys

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

DEFAULT_CONFIGS = ("padded", "padding_free", "prefix_sharing", "trl")
EXTRA_CONFIGS = ("trl_defaults",)
REFERENCE = "trl"
PRESETS = {
    "full": dict(pairs=1024, batch_size=32, epochs=1, size="small", max_length=64),
    "quick": dict(pairs=128, batch_size=16, epochs=1, size="tiny", max_length=64),
}
HF_LAYOUTS = {"padded": {}, "padding_free": {"padding_free": True}, "prefix_sharing": {"prefix_sharing": True}}


# ----------------------------------------------------------------------------------------------- worker side
def real_tokens(feature: dict) -> int:
    """The tokens of one pair as both sequences hold them."""
    return len(feature["chosen_ids"]) + len(feature["rejected_ids"])


def build_trainer(name: str, model, tokenizer, dataset, settings: dict, output_dir: str):
    common = harness.training_kwargs(settings, output_dir)
    if name.startswith("trl"):
        from trl import RewardConfig, RewardTrainer

        if name == "trl":
            common["gradient_checkpointing"] = False
        return RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=dataset,
                             processing_class=tokenizer)

    from hf_rlhf import RewardConfig, RewardTrainer

    args = RewardConfig(gradient_checkpointing=False, **common, **HF_LAYOUTS[name])
    return RewardTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)


def worker(name: str, settings: dict, threads: int) -> dict:
    import contextlib
    import tempfile

    import torch

    from hf_rlhf.toy import build_toy_reward_model, build_toy_tokenizer, preference_dataset

    torch.set_num_threads(threads)
    tokenizer = build_toy_tokenizer()
    dataset = preference_dataset(settings["pairs"], seed=0, split="train")
    model = build_toy_reward_model(tokenizer, settings["size"], seed=0)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        trainer = build_trainer(name, model, tokenizer, dataset, settings, tmp)
        return harness.train_pairs(name, trainer, real_tokens)


# ----------------------------------------------------------------------------------------------- parent side
def model_note(settings: dict, first: dict) -> str:
    return (f"Model: toy `{settings['size']}` LlamaForSequenceClassification, {first['attn']}, fp32, AdamW lr 1e-3, "
            f"{first['threads']} torch thread(s); activation checkpointing off except in trl_defaults.")


def main(argv: list[str] | None = None) -> None:
    harness.pair_benchmark_main(argv, script=__file__, description=__doc__.split("\n")[0],
                                default_configs=DEFAULT_CONFIGS, extra_configs=EXTRA_CONFIGS, presets=PRESETS,
                                worker=worker, model_note=model_note, reference=REFERENCE,
                                loss_exempt=("trl_defaults",))


if __name__ == "__main__":
    main()
