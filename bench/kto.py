"""KTO training rows/s and peak memory: hf_rlhf `KTOTrainer` (padded, padding-free, prefix-shared) vs `trl.KTOTrainer`.

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C A B C ...) so
that drifts in the load of this shared machine hit every configuration alike (`bench/harness.py`, as bench/dpo.py).
Every run trains the same seeded toy causal LM (`build_toy_model`, saved once and loaded from its path by both
libraries, sdpa, fp32, no activation checkpointing) with `loss_type="kto"` and the reference a frozen copy, for one
epoch over the same unpaired rows (the toy preference pairs split into `prompt` / `completion` / `label` rows and
shuffled, `hf_rlhf.toy.unpaired_dataset`; tokenized identically by both libraries, each row with its mismatched KL
completion) with the same optimizer, batch size, data order and seed. Per step both run the policy over the
mismatched sequences without gradients, the reference over both, and the policy over the matched ones with
gradients.

    padded          hf_rlhf's default: TRL's own `DataCollatorForUnpairedPreference`; logits (LM head, log-softmax)
                    only at the positions predicting a completion token (`use_logits_to_keep`), or the LM head in
                    chunks of completion tokens (`chunked_lm_head`, the default above a 4,096-token vocabulary).
    padding_free    hf_rlhf `padding_free=True`: the B sequences end to end in one row, the B mismatched ones in
                    another, no padding.
    prefix_sharing  hf_rlhf `prefix_sharing=True`: the policy over [prompt | completion] with gradients, keeping its
                    KV cache, then the mismatched completions without gradients over that cache (the reference the
                    same under no_grad): each prompt computed once, no mismatched token kept for the backward.
    trl             `trl.KTOTrainer` with the same settings (bf16 and gradient checkpointing off).

rows/s (printed as "pairs/s" by the shared harness: one row is one labelled completion) = rows trained on / wall
time of `trainer.train()` (model and dataset preparation excluded); peak RSS of each worker process.

    python bench/kto.py --repeats 3             # ~4 min on 2 idle CPU cores
    python bench/kto.py --repeats 3 --model llama40m --output bench/results/kto_llama40m.json
    python bench/kto.py --quick --repeats 1 --output /tmp/smoke.json     # smoke test, < 60 s
"""

from __future__ import annotations

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

DEFAULT_CONFIGS = ("padded", "padding_free", "prefix_sharing", "trl")
REFERENCE = "trl"
# "pairs": unpaired rows here (the shared harness's name for the unit of work)
PRESETS = {
    "full": dict(pairs=1024, batch_size=32, epochs=1, size="small", max_length=64),
    "quick": dict(pairs=128, batch_size=16, epochs=1, size="tiny", max_length=64),
}
HF_LAYOUTS = {"padded": {}, "padding_free": {"padding_free": True}, "prefix_sharing": {"prefix_sharing": True}}


# ----------------------------------------------------------------------------------------------- worker side
def real_tokens(feature: dict) -> int:
    """The tokens of one row as its matched and mismatched sequences hold them."""
    return 2 * len(feature["prompt_ids"]) + len(feature["completion_ids"]) + len(feature["KL_completion_ids"])


def build_trainer(name: str, model, tokenizer, dataset, settings: dict, output_dir: str):
    common = harness.training_kwargs(settings, output_dir)
    if name == "trl":
        from trl import KTOConfig, KTOTrainer

        return KTOTrainer(model=model, args=KTOConfig(gradient_checkpointing=False, **common), train_dataset=dataset,
                          processing_class=tokenizer)

    from hf_rlhf import KTOConfig, KTOTrainer

    args = KTOConfig(gradient_checkpointing=False, **common, **HF_LAYOUTS[name])
    return KTOTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)


def worker(name: str, settings: dict, threads: int) -> dict:
    import torch

    from hf_rlhf.toy import build_toy_tokenizer, unpaired_dataset

    torch.set_num_threads(threads)
    tokenizer = build_toy_tokenizer()
    dataset = unpaired_dataset(settings["pairs"] // 2, seed=0, split="train")
    return harness.train_saved_policy(name, settings, tokenizer, dataset, build_trainer, real_tokens)


# ----------------------------------------------------------------------------------------------- parent side
def model_note(settings: dict, first: dict) -> str:
    name = harness.policy_note(settings)
    return (f"Model: {name} (policy + frozen reference), {settings['pairs']} unpaired rows (\"pairs\" in the table), "
            f"{first['attn']}, fp32, AdamW lr 1e-3, loss_type kto, {first['threads']} torch thread(s); activation "
            f"checkpointing off; max_length {settings['max_length']}.")


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=("toy", "llama40m"), default="toy",
                        help="toy: the preset's toy Llama (a 107-token vocabulary); llama40m: a 42M Llama with a "
                             "16,000-token vocabulary (hf_rlhf's chunked LM head on), on 128 rows in batches of 16")


def configure(cli, settings: dict) -> dict:
    settings = dict(settings)
    if cli.model == "llama40m":
        settings.update(size="llama40m", pairs=128, batch_size=16)
    return settings


def main(argv: list[str] | None = None) -> None:
    harness.pair_benchmark_main(argv, script=__file__, description=__doc__.split("\n")[0],
                                default_configs=DEFAULT_CONFIGS, extra_configs=(), presets=PRESETS,
                                worker=worker, model_note=model_note, reference=REFERENCE, loss_exempt=(),
                                add_arguments=add_arguments, configure=configure,
                                worker_args=lambda cli: ["--model", cli.model])


if __name__ == "__main__":
    main()
