"""DPO training pairs/s: hf_rlhf `DPOTrainer` (padded, padding-free, prefix-shared) vs `trl.DPOTrainer`.

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C A B C ...) so
that drifts in the load of this shared machine hit every configuration alike. Every run trains the same seeded toy
causal LM (`build_toy_model`, saved once and loaded from its path by both libraries, sdpa, fp32, no activation
checkpointing) with `loss_type="sigmoid"` and the reference a frozen copy, for one epoch over the same toy
preference pairs (tokenized identically by both libraries: prompt_ids, chosen / rejected completion ids) with the
same optimizer, batch size, data order and seed. What differs is how a batch is laid out:

    padded          hf_rlhf's default: TRL's own `DataCollatorForPreference`, 2B right-padded rows; logits (LM head,
                    log-softmax) only at the positions predicting a completion token (`use_logits_to_keep`, the
                    default in every hf_rlhf layout here).
    padded_full_logits  (extra) the same with `use_logits_to_keep=False`: logits at every position, as trl 1.16
                    on CPU (its fused LM head scores only completion positions on CUDA / XPU with Triton). trl 1.16
                    has no option for it (TRL's `use_logits_to_keep` was deprecated in 0.28 and is gone).
    padding_free    hf_rlhf `padding_free=True` (TRL 1.16 has it switched off): the batch's 2B sequences end to end
                    in one row, no padding; on sdpa a dense mask the size of the row, quadratic in the batch's
                    tokens (measured here: 1.04x TRL on short prompts, 0.13x on long ones, --quick): it pays off with
                    flash attention, not on this CPU; leave it out of --prompts long runs.
    prefix_sharing  hf_rlhf `prefix_sharing=True`: one row per pair, [prompt | chosen | rejected]; the prompt is
                    computed once instead of twice, for the policy and for the reference.
    trl             `trl.DPOTrainer` with the same settings (bf16 and gradient checkpointing off).

pairs/s = pairs trained on / wall time of `trainer.train()` (model and dataset preparation excluded).
`--prompts long` puts the same 176-character instruction before every prompt (long-prompt pairs: where prefix
sharing saves the most), with max_length 256.

    python bench/dpo.py --repeats 3             # ~5 min on 2 busy CPU cores
    python bench/dpo.py --repeats 3 --prompts long --output bench/results/dpo_long.json
    python bench/dpo.py --repeats 3 --prompts long --model llama40m --configs padded,prefix_sharing,trl
    python bench/dpo.py --quick --repeats 1 --output /tmp/smoke.json     # smoke test, < 60 s
"""

from __future__ import annotations

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

DEFAULT_CONFIGS = ("padded", "padding_free", "prefix_sharing", "trl")
EXTRA_CONFIGS = ("padded_full_logits",)
REFERENCE = "trl"
PRESETS = {
    "full": dict(pairs=1024, batch_size=32, epochs=1, size="small", max_length=64),
    "quick": dict(pairs=128, batch_size=16, epochs=1, size="tiny", max_length=64),
}
LONG_PROMPT = "Answer the question below. Give the result only, with no words around it and no spaces; " * 2
LONG_MAX_LENGTH = 256
HF_LAYOUTS = {"padded": {}, "padding_free": {"padding_free": True}, "prefix_sharing": {"prefix_sharing": True},
              "padded_full_logits": {"use_logits_to_keep": False}}


# ----------------------------------------------------------------------------------------------- worker side
def real_tokens(feature: dict) -> int:
    """The tokens of one pair as both sequences hold them."""
    return 2 * len(feature["prompt_ids"]) + len(feature["chosen_ids"]) + len(feature["rejected_ids"])


def build_trainer(name: str, model, tokenizer, dataset, settings: dict, output_dir: str):
    common = harness.training_kwargs(settings, output_dir)
    if name == "trl":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(model=model, args=DPOConfig(gradient_checkpointing=False, **common), train_dataset=dataset,
                          processing_class=tokenizer)

    from hf_rlhf import DPOConfig, DPOTrainer

    args = DPOConfig(gradient_checkpointing=False, **common, **HF_LAYOUTS[name])
    return DPOTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)


def worker(name: str, settings: dict, threads: int) -> dict:
    import torch

    from hf_rlhf.toy import build_toy_tokenizer, preference_dataset

    torch.set_num_threads(threads)
    tokenizer = build_toy_tokenizer()
    dataset = preference_dataset(settings["pairs"], seed=0, split="train")
    if settings.get("prompts") == "long":
        dataset = dataset.map(lambda row: {"prompt": LONG_PROMPT + row["prompt"]})
    return harness.train_saved_policy(name, settings, tokenizer, dataset, build_trainer, real_tokens)


# ----------------------------------------------------------------------------------------------- parent side
def model_note(settings: dict, first: dict) -> str:
    name = harness.policy_note(settings)
    return (f"Model: {name} (policy + frozen reference), {settings['pairs']} pairs, {first['attn']}, fp32, "
            f"AdamW lr 1e-3, loss_type sigmoid, {first['threads']} torch thread(s); activation checkpointing off; "
            f"{settings['prompts']} prompts (max_length {settings['max_length']}).")


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", choices=("short", "long"), default="short",
                        help="short: the toy prompts; long: a 176-character instruction before each (max_length 256)")
    parser.add_argument("--model", choices=("toy", "llama40m"), default="toy",
                        help="toy: the preset's toy Llama (a 107-token vocabulary: the output layer is ~2 %% of the "
                             "forward); llama40m: a 42M Llama with a 16,000-token vocabulary (the output layer ~24 %% "
                             "of the forward, as in 0.5B hub models), on 128 pairs in batches of 16")


def configure(cli, settings: dict) -> dict:
    settings = dict(settings, prompts=cli.prompts)
    if cli.model == "llama40m":
        settings.update(size="llama40m", pairs=128, batch_size=16)
    if cli.prompts == "long":
        settings["max_length"] = LONG_MAX_LENGTH
    return settings


def main(argv: list[str] | None = None) -> None:
    harness.pair_benchmark_main(argv, script=__file__, description=__doc__.split("\n")[0],
                                default_configs=DEFAULT_CONFIGS, extra_configs=EXTRA_CONFIGS, presets=PRESETS,
                                worker=worker, model_note=model_note, reference=REFERENCE, loss_exempt=(),
                                add_arguments=add_arguments, configure=configure,
                                worker_args=lambda cli: ["--prompts", cli.prompts, "--model", cli.model])


if __name__ == "__main__":
    main()
