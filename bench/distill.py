"""On-policy distillation completions/s and peak RSS: hf_rlhf `DistillationTrainer` vs `trl.DistillationTrainer`.

One process per run, each configuration in its own subprocess, rounds interleaved (A B A B ...) so that drifts in
the load of this shared machine hit both alike. Both libraries load the same seeded student and teacher toy Llamas
(`--preset qwen`: bench/scale.py's Qwen2.5-0.5B shape at 1 and 2 layers, random-word prompts) from their
directories (fp32, sdpa, no activation checkpointing, bf16 off), with the same optimizer, batch, beta and seed, and
decode greedily (`generation_kwargs={"do_sample": False}`) a set of prompts that is exactly one generation batch:
every step trains on all of them, so the completions, the work and the losses are the same (checked to 1e-4;
tests/compat/test_trl_distillation.py does the same per step).

    hf_rlhf     `DistillationTrainer`: PPOTrainer's rollout (generation_backend="generate"), the divergence from the
                full logits at this vocabulary (chunked above 4,096 entries: `chunked_lm_head=None`).
    hf_rlhf_lean  the same with `generation_backend="lean"` (hf_rlhf's own decoding loop: the same greedy tokens).
    trl         `trl.DistillationTrainer` 1.16 (its chunked divergence kernel, the torch path on a CPU).

completions/s = completions trained on / wall time of `trainer.train()` (model loading excluded); peak RSS: the
worker process's.

    python bench/distill.py --repeats 3              # ~4 min on 2 busy CPU cores
    python bench/distill.py --quick --repeats 1 --output /tmp/smoke.json     # smoke test, < 60 s
    python bench/distill.py --preset qwen --repeats 3 --output bench/results/distill_qwen.json
                                                # the Qwen2.5-0.5B shape (152k vocabulary): ~14 min on 2 cores
"""

from __future__ import annotations

import contextlib
import os
import sys

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`

CONFIGS = ("hf_rlhf", "hf_rlhf_lean", "trl")
EXTRA = {"hf_rlhf_lean": {"generation_backend": "lean"}}  # hf_rlhf's own decoding loop (hf_rlhf.generation)
# the prompts are one generation batch, so every step trains on all of them whatever order each library draws them
# in: the completions, the work and the losses are the same
PRESETS = {
    "full": dict(batch_size=16, steps=24, accumulation=2, completion_length=16, student="tiny", teacher="small"),
    "quick": dict(batch_size=8, steps=4, accumulation=2, completion_length=8, student="tiny", teacher="tiny"),
    # a real vocabulary and width (bench/scale.py's Qwen2.5-0.5B shape, random weights, depth cut): the divergence's
    # (tokens, V) tensors, the generation's logits and the optimizer states dominate, not the libraries' imports
    "qwen": dict(batch_size=8, steps=4, accumulation=2, completion_length=64, prompt_length=32, shape="qwen2.5-0.5b",
                 student=1, teacher=2),
    # the same path at bench/scale.py's SmolLM2-135M shape (49,152 entries: the chunked divergence), for the smoke test
    "smoke_shape": dict(batch_size=4, steps=2, accumulation=2, completion_length=8, prompt_length=8,
                        shape="smollm2-135m", student=1, teacher=2),
}


def vocabulary(settings: dict) -> int:
    import scale  # bench/scale.py

    return scale.SHAPES[settings["shape"]]["vocab_size"]


def models_and_prompts(settings: dict, tmp: str):
    """(student dir, teacher dir, tokenizer, prompt rows) of a preset: toy Llamas saved under `tmp` and toy prompts,
    or bench/scale.py's shape at `student` / `teacher` layers (built once, cached) and seeded random-word prompts."""
    from transformers import PreTrainedTokenizerFast

    if "shape" in settings:
        import random

        import scale  # bench/scale.py
        from datasets import Dataset

        paths = {role: scale.prepare_model(settings["shape"], settings[role]) for role in ("student", "teacher")}
        tokenizer = PreTrainedTokenizerFast.from_pretrained(paths["student"])  # the word-level one (not Qwen2's)
        rng = random.Random(0)
        prompts = Dataset.from_list([{"prompt": scale.words(scale.random_ids(rng, settings["prompt_length"],
                                                                             len(tokenizer)))}
                                     for _ in range(settings["batch_size"])])
        return paths["student"], paths["teacher"], tokenizer, prompts
    from hf_rlhf.toy import build_toy_model, build_toy_tokenizer, prompt_dataset

    tokenizer = build_toy_tokenizer()
    paths = {}
    for role, seed in (("student", 0), ("teacher", 1)):
        paths[role] = os.path.join(tmp, role)
        build_toy_model(tokenizer, settings[role], seed=seed).save_pretrained(paths[role])
        tokenizer.save_pretrained(paths[role])
    return paths["student"], paths["teacher"], tokenizer, prompt_dataset(settings["batch_size"], seed=0)


def worker(name: str, settings: dict, threads: int) -> dict:
    import tempfile
    import time

    import torch

    torch.set_num_threads(threads)
    lib = __import__(name.removesuffix("_lean"))
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        student, teacher, tokenizer, prompts = models_and_prompts(settings, tmp)
        init = {"dtype": "float32", "device_map": None}
        args = lib.DistillationConfig(
            output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=settings["batch_size"] // 2,
            gradient_accumulation_steps=settings["accumulation"], max_steps=settings["steps"], learning_rate=1e-3,
            lr_scheduler_type="constant", max_completion_length=settings["completion_length"], beta=0.5,
            generation_kwargs={"do_sample": False}, logging_strategy="no", save_strategy="no", report_to="none",
            disable_tqdm=True, seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False,
            model_init_kwargs=init, teacher_model_init_kwargs=init, dataloader_num_workers=0, **EXTRA.get(name, {}))
        trainer = lib.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                          train_dataset=prompts, processing_class=tokenizer)
        load_before = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        result = trainer.train()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    completions = trainer.state.global_step * settings["batch_size"]
    return {"config": name, "seconds": seconds, "pairs": completions, "pairs_per_s": completions / seconds,
            "cpu_seconds": cpu_seconds, "pairs_per_cpu_s": completions / cpu_seconds,
            "steps": trainer.state.global_step,
            "train_loss": result.training_loss, "positions_per_pair": float(settings["completion_length"]),
            "threads": torch.get_num_threads(), "load_before": load_before, "load_after": os.getloadavg()[0],
            "activation_checkpointing": False}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import resource

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny data and models: a smoke run (--preset quick)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full",
                        help="full: toy models (default); qwen: the Qwen2.5-0.5B shape, 1-layer student, 2-layer "
                             "teacher, 8 x 64 tokens a step")
    parser.add_argument("--output", default="bench/results/distill.json", help="JSON results path")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}; trl is the reference (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every run (default 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.quick and cli.preset != "full":
        parser.error(f"--quick is --preset quick; got --preset {cli.preset} as well")
    preset = "quick" if cli.quick else cli.preset
    configs = [c for c in cli.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS) or "trl" not in configs:
        parser.error(f"--configs: names of {', '.join(CONFIGS)}, trl among them; got {cli.configs!r}")
    settings = PRESETS[preset]
    if cli.worker:
        run = worker(cli.worker, settings, cli.threads)
        run["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the whole worker's
        print(json.dumps(run))
        return
    command = "python bench/distill.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    for r in range(cli.repeats):
        for config in configs:
            run = {"round": r, **harness.run_worker(__file__, ["--worker", config, "--threads", str(cli.threads)]
                                                    + ["--preset", preset])}
            runs.append(run)
            print(f"round {r + 1}/{cli.repeats} {config:>8}: {run['pairs_per_s']:7.1f} completions/s "
                  f"({run['steps']} steps, {run['seconds']:.1f} s, loss {run['train_loss']:.5f}, peak RSS "
                  f"{run['peak_rss_mb']:.0f} MB, load {run['load_before']:.1f})", flush=True)
    for key in ("pairs", "steps"):
        if len({run[key] for run in runs}) != 1:
            raise AssertionError(f"runs trained on different work: {key}")
    losses = [run["train_loss"] for run in runs]
    if max(losses) - min(losses) > 1e-4 * max(abs(min(losses)), 1e-3):
        raise AssertionError(f"the runs' losses differ ({losses}): not the same completions")
    summary = harness.summarize_pairs(runs, configs, cli.repeats, "trl")
    table = harness.pairs_table(summary).replace("pairs/s", "completions/s").replace("per pair", "per completion")
    notes = [f"Same work in every run: {runs[0]['pairs']} greedy completions of {settings['completion_length']} "
             f"tokens at most, {runs[0]['steps']} optimizer steps of {settings['batch_size']} (per device "
             f"{settings['batch_size'] // 2} x {settings['accumulation']} accumulation), beta 0.5.",
             (f"Student: {settings['shape']} shape, {settings['student']} layer(s); teacher: the same shape, "
              f"{settings['teacher']} layers; vocabulary {vocabulary(settings):,}; random weights; "
              if "shape" in settings else
              f"Student: toy `{settings['student']}` Llama; teacher: toy `{settings['teacher']}` Llama; ") +
             f"{runs[0]['threads']} torch thread(s); fp32.",
             f"Medians of {cli.repeats} interleaved rounds; ratios are medians of per-round ratios. Load average "
             f"{min(r['load_before'] for r in runs):.1f}-{max(r['load_before'] for r in runs):.1f} on "
             f"{os.cpu_count()} cores."]
    harness.finish(cli.output, command, {"settings": settings, "summary": summary, "table": table, "notes": notes,
                                         "runs": runs}, ("torch", "transformers", "trl", "accelerate"))


if __name__ == "__main__":
    main()
