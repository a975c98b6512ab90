"""Real (non-pad) tokens/s of SFT on long-tailed data: hf_rlhf padded, hf_rlhf packed, `trl.SFTTrainer(packing=True)`.

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C A B C ...) so
that drifts in the load of this shared machine hit every configuration alike. Every run trains the same seeded
tiny Llama (sdpa, fp32, no activation checkpointing) for one epoch over the same pre-tokenized examples with the
same optimizer, batch size and seed, so all runs train on the same real tokens; what differs is how the batches
are laid out:

    padded         hf_rlhf `PaddingCollator`: right-padding to the longest example of each batch (dynamic padding,
                   as TRL's default collator does; neither groups by length). The honest unpacked baseline.
    packed         hf_rlhf `SFTConfig(packing=True)`: `trl.pack_dataset` bfd rows of <= max_length, collated as
                   (B, T) rows with restarting position ids (`PackingCollator(flatten=False)` on sdpa).
    trl_packed     `trl.SFTConfig(packing=True, packing_strategy="bfd")`: the same bfd rows, which TRL flattens
                   into one (1, B*T) row per batch (its padding-free collator, made for flash attention).
    extras (--configs): packed_flat (hf_rlhf packed, flattened into one row like TRL), trl_padded (TRL without
                   packing), packed_bs1 / trl_packed_bs1 (packed at batch 1 x 8 accumulation steps: the same rows per
                   optimizer step, one row per forward).

real tokens/s = (tokens of the examples the collator received) / (wall time of `trainer.train()`).

    python bench/sft_packing.py                 # ~10 min on 2 busy CPU cores
    python bench/sft_packing.py --quick --repeats 1 --output /tmp/smoke.json    # smoke test, < 60 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

DEFAULT_CONFIGS = ("padded", "packed", "trl_packed")
EXTRA_CONFIGS = ("packed_flat", "packed_bs1", "trl_padded", "trl_packed_bs1")
REFERENCES = ("padded", "trl_packed")  # the ratio columns
PRESETS = {
    # lengths ~ lognormal(median, sigma) clipped to [min_length, max_length]: most short, a few long
    "full": dict(examples=1024, max_length=512, min_length=8, median=40, sigma=1.0, batch_size=8, epochs=1,
                 model=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)),
    "quick": dict(examples=64, max_length=128, min_length=8, median=24, sigma=0.8, batch_size=8, epochs=1,
                  model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
}


# ----------------------------------------------------------------------------------------------- worker side
def long_tail_dataset(tokenizer, settings: dict, seed: int = 0):
    """Pre-tokenized `text`-style rows: bos + a run of toy tasks + eos, lengths long-tailed. One column: input_ids."""
    import random

    from datasets import Dataset

    from hf_rlhf.toy import make_tasks

    rng = random.Random(f"bench.sft_packing:{seed}")
    lo, hi = settings["min_length"], settings["max_length"]
    lengths = [min(hi, max(lo, round(rng.lognormvariate(0.0, settings["sigma"]) * settings["median"])))
               for _ in range(settings["examples"])]
    tasks = [t["prompt"] + t["answer"] + "\n" for t in make_tasks(2 * hi, seed=seed)]
    stream, starts, offset = "".join(tasks), [], 0
    for task in tasks:
        starts.append(offset)
        offset += len(task)
    eos = tokenizer.eos_token_id
    rows = []
    for length in lengths:
        start = starts[rng.randrange(len(starts) // 2)]  # a task start in the first half: >= hi characters follow
        ids = tokenizer(stream[start : start + length - 2])["input_ids"] + [eos]  # the toy tokenizer adds bos
        assert len(ids) == length, (len(ids), length)
        rows.append(ids)
    return Dataset.from_dict({"input_ids": rows})


def build_model(tokenizer, settings: dict, attn: str):
    import torch
    from transformers import LlamaForCausalLM

    from hf_rlhf.toy import toy_model_config

    config = toy_model_config(tokenizer, "tiny")
    for key, value in settings["model"].items():
        setattr(config, key, value)
    config.num_key_value_heads = config.num_attention_heads
    config.max_position_embeddings = settings["max_length"]
    config._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


class CountingCollator:
    """Wraps a collator; counts real tokens and examples in the features, and positions in the batches."""

    def __init__(self, collator):
        self.collator = collator
        self.real_tokens = self.examples = self.positions = 0

    def __call__(self, features):
        self.real_tokens += sum(len(f["input_ids"]) for f in features)
        self.examples += sum(len(f.get("seq_lengths") or [1]) for f in features)
        batch = self.collator(features)
        self.positions += batch["input_ids"].numel()
        return batch


def build_trainer(name: str, model, tokenizer, dataset, settings: dict, output_dir: str):
    common = {**harness.training_kwargs(settings, output_dir), "gradient_checkpointing": False}
    if name.endswith("_bs1"):  # the same rows per optimizer step, one row per forward
        common.update(per_device_train_batch_size=1, gradient_accumulation_steps=settings["batch_size"])
    if name.startswith("trl"):
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(packing=name != "trl_padded", packing_strategy="bfd", **common)
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)

    from hf_rlhf import SFTConfig, SFTTrainer
    from hf_rlhf.collators import PackingCollator

    args = SFTConfig(packing=name != "padded", packing_strategy="bfd", **common)
    collator = PackingCollator(pad_token_id=tokenizer.pad_token_id, flatten=True) if name == "packed_flat" else None
    return SFTTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer, data_collator=collator)


def worker(name: str, settings: dict, threads: int, attn: str) -> dict:
    import contextlib
    import hashlib
    import tempfile

    import torch

    from hf_rlhf.toy import build_toy_tokenizer

    torch.set_num_threads(threads)
    tokenizer = build_toy_tokenizer()
    dataset = long_tail_dataset(tokenizer, settings)
    model = build_model(tokenizer, settings, attn)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        trainer = build_trainer(name, model, tokenizer, dataset, settings, tmp)
        counter = trainer.data_collator = CountingCollator(trainer.data_collator)
        rows = trainer.train_dataset
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - start
    packing = [list(n) for n in rows["seq_lengths"]] if "seq_lengths" in rows.column_names else None
    return {
        "config": name,
        "seconds": seconds,
        "real_tokens": counter.real_tokens,
        "tokens_per_s": counter.real_tokens / seconds,
        "examples": counter.examples,
        "dataset_examples": len(dataset),
        "dataset_tokens": sum(map(len, dataset["input_ids"])),
        "rows": len(rows),
        "steps": trainer.state.global_step,
        "fill": counter.real_tokens / max(counter.positions, 1),  # real tokens / positions the model computed on
        "packing_hash": hashlib.sha1(json.dumps(packing).encode()).hexdigest()[:12] if packing else None,
        "train_loss": result.training_loss,
        "bf16": bool(trainer.args.bf16),
        "activation_checkpointing": checkpointing(trainer.model),
        "attn": trainer.model.config._attn_implementation,
        "vocab_size": trainer.model.config.vocab_size,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def checkpointing(model) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (TRL's default: on) to is_activation_checkpointing
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


# ----------------------------------------------------------------------------------------------- parent side
def run_worker(name: str, cli: argparse.Namespace) -> dict:
    return harness.run_worker(__file__, ["--worker", name, "--threads", str(cli.threads), "--attn", cli.attn]
                              + (["--quick"] if cli.quick else []))


def check_same_work(runs: list[dict], epochs: int) -> None:
    """Every run trained on every example `epochs` times, and the packed trainers on the same bfd rows."""
    for key in ("real_tokens", "examples"):
        values = {run[key] for run in runs}
        if len(values) != 1:
            raise AssertionError(f"runs trained on different work: {key} = {sorted(values)}")
    first = runs[0]
    expected = (first["dataset_tokens"] * epochs, first["dataset_examples"] * epochs)
    if (first["real_tokens"], first["examples"]) != expected:
        raise AssertionError(f"runs did not see every example {epochs} time(s): {first}")
    hashes = {run["packing_hash"] for run in runs if run["config"] in ("packed", "trl_packed", "packed_flat")}
    if len(hashes) > 1:
        raise AssertionError(f"packed trainers built different rows: {hashes}")
    if any(run["bf16"] or run["activation_checkpointing"] for run in runs):
        raise AssertionError("a run used bf16 or activation checkpointing")


def summarize(runs: list[dict], configs: list[str], repeats: int) -> dict:
    by = {(run["round"], run["config"]): run for run in runs}
    summary = {}
    for name in configs:
        tps = [by[r, name]["tokens_per_s"] for r in range(repeats)]
        entry = {"tokens_per_s": tps, "median_tokens_per_s": statistics.median(tps),
                 "steps": by[0, name]["steps"], "rows": by[0, name]["rows"], "fill": by[0, name]["fill"]}
        for ref in REFERENCES:
            if ref in configs:
                ratios = [by[r, name]["tokens_per_s"] / by[r, ref]["tokens_per_s"] for r in range(repeats)]
                entry[f"ratios_vs_{ref}"] = ratios
                entry[f"median_ratio_vs_{ref}"] = statistics.median(ratios)
        summary[name] = entry
    return summary


def markdown_table(summary: dict) -> str:
    lines = ["| config | median real tokens/s | median ratio vs padded | median ratio vs TRL packed "
             "| optimizer steps | positions holding real tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, entry in summary.items():
        def ratio(ref, entry=entry):
            return f"{entry[f'median_ratio_vs_{ref}']:.2f}×" if f"median_ratio_vs_{ref}" in entry else "–"

        lines.append(f"| {name} | {entry['median_tokens_per_s']:,.0f} | {ratio('padded')} | {ratio('trl_packed')} "
                     f"| {entry['steps']} | {entry['fill']:.0%} |")
    return "\n".join(lines)


def report_notes(runs: list[dict], summary: dict, settings: dict, configs: list[str], repeats: int) -> list[str]:
    """What was run and how to read the table, as markdown bullet texts."""
    first = runs[0]
    notes = [
        f"Same work in every run: {first['examples']:,} examples, {first['real_tokens']:,} real tokens, 1 epoch, "
        f"batch {settings['batch_size']} rows, lengths lognormal(median {settings['median']}, sigma "
        f"{settings['sigma']}) in [{settings['min_length']}, {settings['max_length']}], bfd rows of "
        f"{settings['max_length']}.",
        f"Model: Llama {settings['model']}, vocab {first['vocab_size']}, {first['attn']}, fp32, no activation "
        f"checkpointing, AdamW lr 1e-3, {first['threads']} torch thread(s).",
        "padded = dynamic right-padding to each batch's longest example (what TRL's default collator does): "
        "a fair baseline, not a fixed max_length pad.",
        f"Medians of {repeats} interleaved rounds; ratios are medians of per-round ratios. Shared machine: "
        f"load average {min(r['load_before'] for r in runs):.1f}–{max(r['load_before'] for r in runs):.1f} "
        f"on {os.cpu_count()} cores, repeats vary by tens of percent.",
    ]
    for ref in REFERENCES:
        per_round = {name: [f"{x:.2f}" for x in entry[f"ratios_vs_{ref}"]] for name, entry in summary.items()
                     if f"ratios_vs_{ref}" in entry and name != ref}
        if per_round:
            ratios = "; ".join(f"{name} {', '.join(values)}" for name, values in per_round.items())
            notes.append(f"Per-round ratios vs {ref}: {ratios}")
    losses = {name: statistics.median(run["train_loss"] for run in runs if run["config"] == name) for name in configs}
    notes.append("Mean training loss over the epoch: " + ", ".join(f"{n} {v:.5f}" for n, v in losses.items())
                 + " (equal losses = the same computation: same rows, order and init; the padded runs take "
                 f"{settings['batch_size']}-example steps, more of them, hence their lower mean).")
    return notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny data and model: a smoke run of < 60 s")
    parser.add_argument("--output", default="bench/results/sft_packing.json", help="JSON results path")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every run (default 1: on a shared 2-core machine, 2 threads wait on "
                             "each other whenever one is descheduled)")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {DEFAULT_CONFIGS + EXTRA_CONFIGS}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    settings = PRESETS["quick" if cli.quick else "full"]

    if cli.worker:
        print(json.dumps(worker(cli.worker, settings, cli.threads, cli.attn)))
        return

    configs = [c.strip() for c in cli.configs.split(",") if c.strip()]
    unknown = set(configs) - set(DEFAULT_CONFIGS + EXTRA_CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}")
    command = " ".join(["python bench/sft_packing.py", *(argv if argv is not None else sys.argv[1:])])
    runs = []
    for r in range(cli.repeats):
        for name in configs:
            run = {"round": r, **run_worker(name, cli)}
            runs.append(run)
            print(f"round {r + 1}/{cli.repeats} {name:>15}: {run['tokens_per_s']:8,.0f} real tokens/s "
                  f"({run['real_tokens']:,} tokens of {run['examples']:,} examples in {run['rows']:,} rows, "
                  f"{run['steps']} steps, {run['seconds']:.1f} s, load {run['load_before']:.1f})", flush=True)
    check_same_work(runs, settings["epochs"])
    summary = summarize(runs, configs, cli.repeats)
    table = markdown_table(summary)
    notes = report_notes(runs, summary, settings, configs, cli.repeats)
    harness.finish(cli.output, command, {"settings": settings, "configs": configs, "summary": summary, "table": table,
                                         "notes": notes, "runs": runs},
                   ("torch", "transformers", "trl", "datasets", "accelerate"))


if __name__ == "__main__":
    main()
