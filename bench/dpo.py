"""DPO training pairs/s: hf_rlhf `DPOTrainer` (padded, padding-free, prefix-shared) vs `trl.DPOTrainer`.

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C A B C ...) so
that drifts in the load of this shared machine hit every configuration alike. Every run trains the same seeded toy
causal LM (`build_toy_model`, saved once and loaded from its path by both libraries, sdpa, fp32, no activation
checkpointing) with `loss_type="sigmoid"` and the reference a frozen copy, for one epoch over the same toy
preference pairs (tokenized identically by both libraries: prompt_ids, chosen / rejected completion ids) with the
same optimizer, batch size, data order and seed. What differs is how a batch is laid out:

    padded          hf_rlhf's default: TRL's own `DataCollatorForPreference`, 2B right-padded rows.
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
    python bench/dpo.py --quick --repeats 1 --output /tmp/smoke.json     # smoke test, < 60 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

DEFAULT_CONFIGS = ("padded", "padding_free", "prefix_sharing", "trl")
EXTRA_CONFIGS = ()
REFERENCE = "trl"
PRESETS = {
    "full": dict(pairs=1024, batch_size=32, epochs=1, size="small", max_length=64),
    "quick": dict(pairs=128, batch_size=16, epochs=1, size="tiny", max_length=64),
}
LONG_PROMPT = "Answer the question below. Give the result only, with no words around it and no spaces; " * 2
LONG_MAX_LENGTH = 256
HF_LAYOUTS = {"padded": {}, "padding_free": {"padding_free": True}, "prefix_sharing": {"prefix_sharing": True}}


# ----------------------------------------------------------------------------------------------- worker side
class CountingCollator:
    """Wraps a collator; counts the pairs and real tokens it received and the positions the model computes on."""

    def __init__(self, collator):
        self.collator = collator
        self.pairs = self.real_tokens = self.positions = 0

    def __call__(self, features):
        self.pairs += len(features)
        self.real_tokens += sum(2 * len(f["prompt_ids"]) + len(f["chosen_ids"]) + len(f["rejected_ids"])
                                for f in features)
        batch = self.collator(features)
        self.positions += batch["input_ids"].numel()
        return batch


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
    import contextlib
    import tempfile

    import torch

    from hf_rlhf.toy import build_toy_model, build_toy_tokenizer, preference_dataset

    torch.set_num_threads(threads)
    tokenizer = build_toy_tokenizer()
    dataset = preference_dataset(settings["pairs"], seed=0, split="train")
    if settings.get("prompts") == "long":
        dataset = dataset.map(lambda row: {"prompt": LONG_PROMPT + row["prompt"]})
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        model = os.path.join(tmp, "model")  # both libraries load the policy (and TRL its reference) from a path
        build_toy_model(tokenizer, settings["size"], seed=0).save_pretrained(model)
        tokenizer.save_pretrained(model)
        trainer = build_trainer(name, model, tokenizer, dataset, settings, os.path.join(tmp, "out"))
        counter = trainer.data_collator = CountingCollator(trainer.data_collator)
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - start
    args = trainer.args
    return {
        "config": name,
        "seconds": seconds,
        "pairs": counter.pairs,
        "pairs_per_s": counter.pairs / seconds,
        "real_tokens": counter.real_tokens,
        "positions_per_pair": counter.positions / max(counter.pairs, 1),  # token positions the model computed on
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "bf16": bool(args.bf16),
        "activation_checkpointing": bool(args.gradient_checkpointing or getattr(args, "activation_checkpointing", 0)),
        "attn": trainer.model.config._attn_implementation,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


# ----------------------------------------------------------------------------------------------- parent side
def run_worker(name: str, cli: argparse.Namespace) -> dict:
    return harness.run_worker(__file__, ["--worker", name, "--threads", str(cli.threads), "--prompts", cli.prompts]
                              + (["--quick"] if cli.quick else []))


def check_same_work(runs: list[dict], settings: dict) -> None:
    """Every run trained on every pair once, on the same real tokens, fp32 (the losses agree: same data order)."""
    for key in ("pairs", "real_tokens", "steps"):
        values = {run[key] for run in runs}
        if len(values) != 1:
            raise AssertionError(f"runs trained on different work: {key} = {sorted(values)}")
    if runs[0]["pairs"] != settings["pairs"] * settings["epochs"]:
        raise AssertionError(f"runs did not see every pair: {runs[0]}")
    if any(run["bf16"] for run in runs):
        raise AssertionError("a run used bf16")
    losses = [run["train_loss"] for run in runs]
    if max(losses) - min(losses) > 1e-3:
        raise AssertionError(f"train losses differ across configurations: {losses}")


def summarize(runs: list[dict], configs: list[str], repeats: int) -> dict:
    by = {(run["round"], run["config"]): run for run in runs}
    summary = {}
    for name in configs:
        pps = [by[r, name]["pairs_per_s"] for r in range(repeats)]
        entry = {"pairs_per_s": pps, "median_pairs_per_s": statistics.median(pps), "steps": by[0, name]["steps"],
                 "positions_per_pair": by[0, name]["positions_per_pair"], "train_loss": by[0, name]["train_loss"],
                 "activation_checkpointing": by[0, name]["activation_checkpointing"]}
        if REFERENCE in configs:
            ratios = [by[r, name]["pairs_per_s"] / by[r, REFERENCE]["pairs_per_s"] for r in range(repeats)]
            entry["ratios_vs_trl"] = ratios
            entry["median_ratio_vs_trl"] = statistics.median(ratios)
        summary[name] = entry
    return summary


def markdown_table(summary: dict) -> str:
    lines = ["| config | median pairs/s | median ratio vs TRL | positions computed per pair | train loss |",
             "|---|---:|---:|---:|---:|"]
    for name, entry in summary.items():
        ratio = f"{entry['median_ratio_vs_trl']:.2f}×" if "median_ratio_vs_trl" in entry else "–"
        lines.append(f"| {name} | {entry['median_pairs_per_s']:,.1f} | {ratio} | {entry['positions_per_pair']:.1f} "
                     f"| {entry['train_loss']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="tiny data and model: a smoke run of < 60 s")
    parser.add_argument("--output", default="bench/results/dpo.json", help="JSON results path")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every run (default 1: on a shared 2-core machine, 2 threads wait on "
                             "each other whenever one is descheduled)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {DEFAULT_CONFIGS + EXTRA_CONFIGS}")
    parser.add_argument("--prompts", choices=("short", "long"), default="short",
                        help="short: the toy prompts; long: a 176-character instruction before each (max_length 256)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    settings = dict(PRESETS["quick" if cli.quick else "full"], prompts=cli.prompts)
    if cli.prompts == "long":
        settings["max_length"] = LONG_MAX_LENGTH

    if cli.worker:
        print(json.dumps(worker(cli.worker, settings, cli.threads)))
        return

    configs = [c.strip() for c in cli.configs.split(",") if c.strip()]
    unknown = set(configs) - set(DEFAULT_CONFIGS + EXTRA_CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}")
    command = "python bench/dpo.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    for r in range(cli.repeats):
        for name in configs:
            run = {"round": r, **run_worker(name, cli)}
            runs.append(run)
            print(f"round {r + 1}/{cli.repeats} {name:>15}: {run['pairs_per_s']:7.1f} pairs/s ({run['pairs']} pairs, "
                  f"{run['real_tokens']:,} real tokens, {run['positions_per_pair']:.1f} positions/pair, "
                  f"{run['steps']} steps, {run['seconds']:.1f} s, loss {run['train_loss']:.4f}, "
                  f"load {run['load_before']:.1f})", flush=True)
    check_same_work(runs, settings)
    summary = summarize(runs, configs, cli.repeats)
    table = markdown_table(summary)
    first = runs[0]
    notes = [
        f"Same work in every run: {first['pairs']} toy preference pairs, {cli.prompts} prompts "
        f"({first['real_tokens']:,} real tokens), "
        f"1 epoch, batch {settings['batch_size']} pairs, {first['steps']} optimizer steps, same data order (the "
        "train losses agree).",
        f"Model: toy `{settings['size']}` LlamaForCausalLM (policy + frozen reference), {first['attn']}, fp32, AdamW "
        f"lr 1e-3, loss_type sigmoid, {first['threads']} torch thread(s); activation checkpointing off.",
        f"Medians of {cli.repeats} interleaved rounds; ratios are medians of per-round ratios. Shared machine: "
        f"load average {min(r['load_before'] for r in runs):.1f}–{max(r['load_before'] for r in runs):.1f} "
        f"on {os.cpu_count()} cores.",
    ]
    if REFERENCE in configs:
        notes.append("Per-round ratios vs trl: " + "; ".join(
            f"{n} {', '.join(f'{x:.2f}' for x in e['ratios_vs_trl'])}" for n, e in summary.items() if n != REFERENCE))
    harness.finish(cli.output, command, {"settings": settings, "configs": configs, "summary": summary, "table": table,
                                         "notes": notes, "runs": runs},
                   ("torch", "transformers", "trl", "datasets", "accelerate"))


if __name__ == "__main__":
    main()
