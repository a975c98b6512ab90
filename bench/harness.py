"""What every benchmark here shares: one subprocess per run, and the JSON report with the machine it ran on.

The benchmarks run as scripts (`python bench/<name>.py`), so they import this module as `harness`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def run_worker(script: str, args: list[str], extra_pythonpath: str | None = None) -> dict:
    """Run `python <script> <args>` in a fresh process and return the JSON object on its last stdout line.

    Args:
        extra_pythonpath: a directory put first on the worker's PYTHONPATH (a side-installed reference library).

    Raises:
        RuntimeError: the worker failed; the message ends with its stderr.
    """
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_pythonpath, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def training_kwargs(settings: dict, output_dir: str) -> dict:
    """TrainingArguments both libraries get in the SFT and reward benchmarks: one epoch at a constant 1e-3 with
    AdamW, fp32 on the CPU, fixed seeds and data order, no logging, saving, worker processes or pinned memory.

    Args:
        settings: with "batch_size", "epochs" and "max_length".
    """
    return dict(
        output_dir=output_dir, per_device_train_batch_size=settings["batch_size"], num_train_epochs=settings["epochs"],
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        max_length=settings["max_length"], logging_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, data_seed=0, use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, dataloader_pin_memory=False,
    )


def versions(packages: tuple[str, ...], **fixed: str) -> dict:
    """Installed versions of `packages` (None when missing), after the `fixed` entries."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict = dict(fixed)
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows of the processor."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_report(path: str, report: dict, versions: dict) -> None:
    """Write `report` plus the machine (cores, CPU model, torch's CPU capability, platform, Python, `versions`) as
    JSON to `path`, and say where."""
    machine = {"cpus": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform(),
               "python": platform.python_version(), "versions": versions}
    try:  # the kernels torch dispatches to (AVX2, AVX512 ...) set the float path, and so the trained models
        import torch

        machine["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**report, "machine": machine}, indent=2) + "\n")
    print(f"wrote {path}")


def finish(output: str, command: str, report: dict, packages: tuple[str, ...], sections: dict[str, str] | None = None,
           **fixed_versions: str) -> None:
    """Print the benchmark's table, notes and extra `sections` (title -> markdown) and how to reproduce it, then
    write `report` (which holds "table" and "notes") with the command and the machine to `output`."""
    sections = sections or {}
    print("\n" + report["table"] + "\n\n" + "\n".join(f"- {n}" for n in report["notes"])
          + "".join(f"\n\n{title}:\n\n{text}" for title, text in sections.items())
          + f"\n\nReproduce: `{command}`")
    write_report(output, {"command": command, **report}, versions(packages, **fixed_versions))


# ----------------------------------------------------------------------------------------------- pair benchmarks
# bench/reward.py and bench/dpo.py: pairs/s of hf_rlhf's pair layouts against TRL's trainer, same driver


class CountingCollator:
    """Wraps a collator; counts the pairs and real tokens (`real_tokens(feature)`) it received and the positions the
    model computes on."""

    def __init__(self, collator, real_tokens):
        self.collator, self.count_tokens = collator, real_tokens
        self.pairs = self.real_tokens = self.positions = 0

    def __call__(self, features):
        self.pairs += len(features)
        self.real_tokens += sum(self.count_tokens(f) for f in features)
        batch = self.collator(features)
        self.positions += batch["input_ids"].numel()
        return batch


def train_pairs(name: str, trainer, real_tokens) -> dict:
    """Run `trainer.train()` with its collator counted (`CountingCollator`) and timed; what a pair benchmark's worker
    reports of it."""
    import time

    import torch

    counter = trainer.data_collator = CountingCollator(trainer.data_collator, real_tokens)
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    result = trainer.train()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    args = trainer.args
    return {
        "config": name,
        "seconds": seconds,
        "pairs": counter.pairs,
        "pairs_per_s": counter.pairs / seconds,
        # the process's CPU time: on a shared machine it moves far less with the load than the wall time does
        "cpu_seconds": cpu_seconds,
        "pairs_per_cpu_s": counter.pairs / cpu_seconds,
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


def train_saved_policy(name: str, settings: dict, tokenizer, dataset, build_trainer, real_tokens) -> dict:
    """A preference benchmark's worker body (DPO, KTO): the policy (`settings["size"]`: a toy Llama, or
    bench/generation.py's 42M `llama40m`) and `tokenizer` saved to a temporary directory, from which both libraries
    load it (and TRL its reference); `build_trainer(name, path, tokenizer, dataset, settings, output_dir)`'s trainer
    trained there (`train_pairs`). stdout carries the worker's JSON, so what the libraries print goes to stderr."""
    import contextlib
    import tempfile

    from hf_rlhf.toy import build_toy_model

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        model = os.path.join(tmp, "model")
        if settings["size"] == "llama40m":  # 42M parameters, vocabulary 16,000
            import generation as generation_bench

            generation_bench.build_model("llama40m", tokenizer).save_pretrained(model)
        else:
            build_toy_model(tokenizer, settings["size"], seed=0).save_pretrained(model)
        tokenizer.save_pretrained(model)
        trainer = build_trainer(name, model, tokenizer, dataset, settings, os.path.join(tmp, "out"))
        return train_pairs(name, trainer, real_tokens)


def policy_note(settings: dict) -> str:
    """The model of a preference benchmark, as its report names it."""
    if settings["size"] == "llama40m":
        return "a 42M-parameter Llama (hidden 512, 8 layers, vocabulary 16,000: bench/generation.py's llama40m)"
    return f"toy `{settings['size']}` LlamaForCausalLM"


def check_same_pair_work(runs: list[dict], settings: dict, loss_exempt: tuple[str, ...] = ()) -> None:
    """Every run trained on every pair once, on the same real tokens, fp32 (the losses agree: same data order;
    configurations in `loss_exempt` compute the loss another way and are not compared)."""
    for key in ("pairs", "real_tokens", "steps"):
        values = {run[key] for run in runs}
        if len(values) != 1:
            raise AssertionError(f"runs trained on different work: {key} = {sorted(values)}")
    if runs[0]["pairs"] != settings["pairs"] * settings["epochs"]:
        raise AssertionError(f"runs did not see every pair: {runs[0]}")
    if any(run["bf16"] for run in runs):
        raise AssertionError("a run used bf16")
    losses = [run["train_loss"] for run in runs if run["config"] not in loss_exempt]
    if max(losses) - min(losses) > 1e-3:
        raise AssertionError(f"train losses differ across configurations: {losses}")


def summarize_pairs(runs: list[dict], configs: list[str], repeats: int, reference: str) -> dict:
    """config -> pairs/s per round, their median, and (with `reference` run) the per-round ratios and their median."""
    import statistics

    by = {(run["round"], run["config"]): run for run in runs}
    summary = {}
    for name in configs:
        pps = [by[r, name]["pairs_per_s"] for r in range(repeats)]
        rss = [by[r, name]["peak_rss_mb"] for r in range(repeats)]
        entry = {"pairs_per_s": pps, "median_pairs_per_s": statistics.median(pps), "steps": by[0, name]["steps"],
                 "peak_rss_mb": rss, "median_peak_rss_mb": statistics.median(rss),
                 "positions_per_pair": by[0, name]["positions_per_pair"], "train_loss": by[0, name]["train_loss"],
                 "activation_checkpointing": by[0, name]["activation_checkpointing"]}
        if reference in configs:
            ratios = [by[r, name]["pairs_per_s"] / by[r, reference]["pairs_per_s"] for r in range(repeats)]
            entry["ratios_vs_trl"] = ratios
            entry["median_ratio_vs_trl"] = statistics.median(ratios)
            if all("pairs_per_cpu_s" in by[r, n] for r in range(repeats) for n in (name, reference)):
                cpu = [by[r, name]["pairs_per_cpu_s"] / by[r, reference]["pairs_per_cpu_s"] for r in range(repeats)]
                entry["cpu_ratios_vs_trl"] = cpu
                entry["median_cpu_ratio_vs_trl"] = statistics.median(cpu)
            entry["median_rss_ratio_vs_trl"] = statistics.median(
                by[r, name]["peak_rss_mb"] / by[r, reference]["peak_rss_mb"] for r in range(repeats))
        summary[name] = entry
    return summary


def pairs_table(summary: dict) -> str:
    lines = ["| config | median pairs/s | median ratio vs TRL | ratio vs TRL in CPU time | median peak RSS MB "
             "| peak RSS vs TRL | positions computed per pair | train loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, entry in summary.items():
        ratio = f"{entry['median_ratio_vs_trl']:.2f}×" if "median_ratio_vs_trl" in entry else "–"
        cpu = f"{entry['median_cpu_ratio_vs_trl']:.2f}×" if "median_cpu_ratio_vs_trl" in entry else "–"
        rss_ratio = f"{entry['median_rss_ratio_vs_trl']:.2f}×" if "median_rss_ratio_vs_trl" in entry else "–"
        lines.append(f"| {name} | {entry['median_pairs_per_s']:,.1f} | {ratio} | {cpu} "
                     f"| {entry['median_peak_rss_mb']:,.0f} "
                     f"| {rss_ratio} | {entry['positions_per_pair']:.1f} | {entry['train_loss']:.4f} |")
    return "\n".join(lines)


def pair_benchmark_main(argv: list[str] | None, *, script: str, description: str, default_configs: tuple,
                        extra_configs: tuple, presets: dict, worker, model_note, reference: str = "trl",
                        loss_exempt: tuple[str, ...] = (), add_arguments=None, configure=None,
                        worker_args=None) -> None:
    """The command line of a pair benchmark: `--worker NAME` runs one configuration (`worker(name, settings,
    threads) -> dict`, printed as JSON); otherwise every configuration runs in its own subprocess, rounds
    interleaved, and the medians, paired ratios and notes (`model_note(settings, first_run) -> str`) are printed
    and written to `--output`. A script's own options: `add_arguments(parser)`, `configure(cli, settings) ->
    settings`, and `worker_args(cli) -> list[str]` handed on to its workers."""
    import argparse

    name = Path(script).stem
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="tiny data and model: a smoke run of < 60 s")
    parser.add_argument("--output", default=f"bench/results/{name}.json", help="JSON results path")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every run (default 1: on a shared 2-core machine, 2 threads wait on "
                             "each other whenever one is descheduled)")
    parser.add_argument("--configs", default=",".join(default_configs),
                        help=f"comma-separated, from {default_configs + extra_configs}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    if add_arguments:
        add_arguments(parser)
    cli = parser.parse_args(argv)
    settings = presets["quick" if cli.quick else "full"]
    if configure:
        settings = configure(cli, settings)

    if cli.worker:
        import resource

        run = worker(cli.worker, settings, cli.threads)
        # the whole worker's (Linux: KiB)
        run["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(run))
        return

    configs = [c.strip() for c in cli.configs.split(",") if c.strip()]
    unknown = set(configs) - set(default_configs + extra_configs)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}")
    command = f"python bench/{name}.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    for r in range(cli.repeats):
        for config in configs:
            run = {"round": r, **run_worker(script, ["--worker", config, "--threads", str(cli.threads)]
                                            + (worker_args(cli) if worker_args else [])
                                            + (["--quick"] if cli.quick else []))}
            runs.append(run)
            print(f"round {r + 1}/{cli.repeats} {config:>15}: {run['pairs_per_s']:7.1f} pairs/s ({run['pairs']} "
                  f"pairs, {run['real_tokens']:,} real tokens, {run['positions_per_pair']:.1f} positions/pair, "
                  f"{run['steps']} steps, {run['seconds']:.1f} s ({run.get('cpu_seconds', 0):.1f} s CPU), "
                  f"loss {run['train_loss']:.4f}, "
                  f"load {run['load_before']:.1f})", flush=True)
    check_same_pair_work(runs, settings, loss_exempt)
    summary = summarize_pairs(runs, configs, cli.repeats, reference)
    first = runs[0]
    notes = [
        f"Same work in every run: {first['pairs']} toy preference pairs ({first['real_tokens']:,} real tokens), "
        f"1 epoch, batch {settings['batch_size']} pairs, {first['steps']} optimizer steps, same data order (the "
        "train losses agree).",
        model_note(settings, first),
        f"Medians of {cli.repeats} interleaved rounds; ratios are medians of per-round ratios. Shared machine: "
        f"load average {min(r['load_before'] for r in runs):.1f}–{max(r['load_before'] for r in runs):.1f} "
        f"on {os.cpu_count()} cores.",
    ]
    if reference in configs:
        notes.append("Per-round ratios vs trl: " + "; ".join(
            f"{n} {', '.join(f'{x:.2f}' for x in e['ratios_vs_trl'])}" for n, e in summary.items() if n != reference))
        if all("cpu_ratios_vs_trl" in e for e in summary.values()):
            notes.append("Per-round ratios vs trl in pairs per CPU-second (each worker's CPU time): " + "; ".join(
                f"{n} {', '.join(f'{x:.2f}' for x in e['cpu_ratios_vs_trl'])}" for n, e in summary.items()
                if n != reference))
    finish(cli.output, command, {"settings": settings, "configs": configs, "summary": summary,
                                 "table": pairs_table(summary), "notes": notes, "runs": runs},
           ("torch", "transformers", "trl", "datasets", "accelerate"))
