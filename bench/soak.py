"""Soak (issue 44, item 1): each trainer runs thousands of optimizer steps on the toy task in its own process, and its
memory, threads, file descriptors and step time must stay flat from the end of warm-up to the end.

    python bench/soak.py --plot docs/soak.png               # SFT, reward, DPO, PPO, GRPO, GRPO + tools, 2,000 steps
    python bench/soak.py --trainers sft,dpo --steps 300 --warmup 100 --out /tmp/soak.json

The toy rows are longer than the default toy configs' and of varying length (a prompt carries 2-8 solved tasks
before its own, a completion 1-4 more after its answer; PPO / GRPO sample 32 tokens), so the allocator sees a new
shape at almost every step. Each trainer runs in a child process (`--worker`), one intra-op thread, logging every 10
steps, a checkpoint every 500 (the last one kept), as a long run would.

Two probes:
  - outside, every `--sample_s` seconds: psutil on the child's pid: RSS, threads, open file descriptors;
  - inside, a callback: every 100 steps (a window) the window's wall and CPU seconds, `sys.getallocatedblocks()`,
    the objects the garbage collector tracks (`len(gc.get_objects())`), the live tensors among them, and the size of
    `trainer.state.log_history` (entries, bytes as JSON). It costs a few ms per window, the same in every window.

Growth is measured from the end of warm-up (`--warmup`, step 200) to the end: RSS as the median of the samples of the
first window after warm-up against the median of the last window's; step time as the median of the first five
windows after warm-up against the median of the last five (the machine is shared: single windows swing with the
other jobs, so the spread of the windows is reported too, and the CPU time of each window, which moves far less).

Writes the JSON (`--out`) after each trainer, so a cut run keeps what finished, then a markdown table and a PNG
(`--plot`): RSS and step time against the step, one line per trainer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRAINERS = ("sft", "reward", "dpo", "ppo", "grpo", "grpo_tools")
WINDOW = 100
SEP = "; "

# ---------------------------------------------------------------------------------------------------
# the toy data, longer than the default toy configs'


def solved(rng: random.Random, n: int) -> str:
    """`n` toy tasks with their answers, joined: "37+45=82; reverse kqbd=dbqk; ..." (context for a longer row)."""
    from hf_rlhf.toy import make_tasks

    rows = make_tasks(n, seed=rng.randrange(1 << 30))
    return SEP.join(r["prompt"] + r["answer"] for r in rows)


def long_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` rows {"prompt", "answer", "wrong", "tail"}: the prompt is 2-8 solved tasks then the task itself, the tail
    1-4 solved tasks written after the answer (varying lengths, so the shapes vary step to step)."""
    from hf_rlhf.toy import make_tasks
    from hf_rlhf.toy.tasks import wrong_answer

    rng = random.Random(seed)
    rows = []
    for task in make_tasks(n, seed=seed):
        rows.append({"prompt": solved(rng, rng.randint(2, 8)) + SEP + task["prompt"], "answer": task["answer"],
                     "wrong": wrong_answer(task["prompt"], task["answer"], rng),
                     "tail": SEP + solved(rng, rng.randint(1, 4))})
    return rows


def last_task_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the completion starts with the answer of the prompt's last task, else 0.0 (the context before it is
    solved tasks, which `answer_for_prompt` alone would not skip)."""
    from hf_rlhf.toy import answer_for_prompt

    scores = []
    for prompt, completion in zip(prompts, completions):
        answer = answer_for_prompt(prompt.split(SEP)[-1])
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        scores.append(float(text.strip().startswith(answer)))
    return scores


# ---------------------------------------------------------------------------------------------------
# the six toy trainers


def build(kind: str, steps: int, output_dir: str, callbacks=()):
    """The toy trainer of `kind`: `steps` optimizer steps, a log every 10 steps, a checkpoint every 500 (one kept)."""
    from datasets import Dataset

    from hf_rlhf.toy import build_toy_model, build_toy_tokenizer, build_toy_tool_tokenizer

    common = dict(output_dir=output_dir, max_steps=steps, logging_steps=10, save_strategy="steps", save_steps=500,
                  save_total_limit=1, report_to="none", seed=0, disable_tqdm=True, learning_rate=1e-4,
                  dataloader_num_workers=0)
    callbacks = list(callbacks)
    rows = long_rows(2048)
    if kind == "sft":
        from hf_rlhf import SFTConfig, SFTTrainer

        tokenizer = build_toy_tokenizer()
        data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["answer"] + r["tail"]} for r in rows])
        args = SFTConfig(per_device_train_batch_size=8, max_length=256, **common)
        return SFTTrainer(build_toy_model(tokenizer), args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=callbacks)
    if kind in ("reward", "dpo"):
        tokenizer = build_toy_tokenizer()
        data = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["answer"] + r["tail"],
                                   "rejected": r["wrong"] + r["tail"]} for r in rows])
        if kind == "reward":
            from hf_rlhf import RewardConfig, RewardTrainer
            from hf_rlhf.toy import build_toy_reward_model

            args = RewardConfig(per_device_train_batch_size=8, max_length=256, **common)
            return RewardTrainer(build_toy_reward_model(tokenizer), args=args, train_dataset=data,
                                 processing_class=tokenizer, callbacks=callbacks)
        from hf_rlhf import DPOConfig, DPOTrainer

        args = DPOConfig(per_device_train_batch_size=8, max_length=256, **common)
        return DPOTrainer(build_toy_model(tokenizer), args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=callbacks)
    from hf_rlhf import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer

    # one rollout of 8 completions feeds two optimizer steps (two mini-batches of 4, one epoch)
    rollout = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, num_ppo_epochs=1, temperature=1.0,
                   response_length=32)
    if kind == "ppo":
        tokenizer = build_toy_tokenizer()
        prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
        args = PPOConfig(num_mini_batches=2, kl_target=0.5, kl_horizon=200, reward_normalization="running",
                         **rollout, **common)
        return PPOTrainer(build_toy_model(tokenizer), last_task_reward, args=args, train_dataset=prompts,
                          processing_class=tokenizer, callbacks=callbacks)
    if kind == "grpo":
        tokenizer = build_toy_tokenizer()
        prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
        args = GRPOConfig(num_generations=4, steps_per_generation=2, beta=0.04, **rollout, **common)
        return GRPOTrainer(build_toy_model(tokenizer), last_task_reward, args=args, train_dataset=prompts,
                           processing_class=tokenizer, callbacks=callbacks)
    # GRPO with a tool: the first turn of each row calls `add` (a random policy writes no call itself), later turns
    # are sampled; the tool result comes back as a user turn
    from chaos import scripted_first_turn

    from hf_rlhf.toy import tool_prompt_dataset, tool_reward
    from hf_rlhf.toy.tool_task import add

    tokenizer = build_toy_tool_tokenizer()
    args = PPOConfig(advantage_estimator="grpo", num_generations=4, num_mini_batches=2, kl_in_loss=True,
                     max_tool_calling_iterations=2, tool_call_timeout=30.0,
                     **{**rollout, "response_length": 100}, **common)
    trainer = PPOTrainer(build_toy_model(tokenizer), tool_reward, args=args, processing_class=tokenizer,
                         train_dataset=tool_prompt_dataset(2048, seed=1), callbacks=callbacks, tools=[add])
    trainer.rollout_maker.engine = scripted_first_turn(tokenizer, trainer.rollout_maker.engine)
    return trainer


# ---------------------------------------------------------------------------------------------------
# the inside probe (in the child)


TOKENS = [0]  # prompt + completion tokens the trainer has computed on (the work of a step moves as a policy learns)


def count_tokens(trainer, kind: str) -> None:
    """Count the real tokens of every batch (SFT, reward, DPO: the collated attention mask) or rollout (PPO, GRPO:
    the prompt and response masks of its experience) into `TOKENS`."""
    if kind in ("sft", "reward", "dpo"):
        collate = trainer.data_collator

        def counted_collate(features):
            batch = collate(features)
            TOKENS[0] += int(sum(v.sum() for k, v in batch.items() if k.endswith("attention_mask")))
            return batch

        trainer.data_collator = counted_collate
        return
    make = trainer._make_experience

    def counted_make(rows, indices, **kwargs):
        experience, stats = make(rows, indices, **kwargs)
        TOKENS[0] += int(experience.query_mask.sum() + experience.response_mask.sum())
        return experience, stats

    trainer._make_experience = counted_make


def live_tensors(objects) -> int:
    import torch

    return sum(1 for o in objects if isinstance(o, torch.Tensor))


def make_probe(path: str, window: int = WINDOW):
    """A callback writing one JSON line per `window` optimizer steps to `path` (see the module docstring)."""
    from transformers import TrainerCallback

    class SoakProbe(TrainerCallback):
        def __init__(self):
            self.file = open(path, "a", buffering=1)
            self.last = None

        def record(self, state, **extra):
            wall, cpu = time.perf_counter(), time.process_time()
            objects = gc.get_objects()
            line = {"step": state.global_step, "time": time.time(), "tokens": TOKENS[0],
                    "blocks": sys.getallocatedblocks(),
                    "gc_objects": len(objects), "tensors": live_tensors(objects),
                    "log_entries": len(state.log_history), "log_bytes": len(json.dumps(state.log_history)), **extra}
            del objects
            if self.last is not None:
                line["window_s"] = wall - self.last[0]
                line["window_cpu_s"] = cpu - self.last[1]
            self.file.write(json.dumps(line) + "\n")
            # the probe's own cost is left out of the next window
            self.last = (time.perf_counter(), time.process_time())

        def on_train_begin(self, args, state, control, **kwargs):
            self.record(state)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % window == 0:
                self.record(state)

        def on_train_end(self, args, state, control, **kwargs):
            self.file.close()

    return SoakProbe()


def worker(kind: str, steps: int, probe_path: str) -> None:
    import torch

    torch.set_num_threads(1)  # one core's work: the other core samples, and the other jobs share the machine
    with tempfile.TemporaryDirectory(prefix=f"soak-{kind}-") as tmp:
        trainer = build(kind, steps, tmp, [make_probe(probe_path)])
        count_tokens(trainer, kind)
        trainer.train()


# ---------------------------------------------------------------------------------------------------
# the outside probe and the summary (in the parent)


def run_one(kind: str, steps: int, sample_s: float, workdir: str) -> dict:
    """Start the worker of `kind`, sample it every `sample_s` s until it ends; its samples and its probe lines."""
    import psutil

    probe_path = os.path.join(workdir, f"{kind}.jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench")]),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    log = open(os.path.join(workdir, f"{kind}.log"), "w")
    start = time.time()
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", kind, "--steps", str(steps),
                              "--probe", probe_path], env=env, stdout=log, stderr=subprocess.STDOUT)
    process = psutil.Process(child.pid)
    samples = []
    while child.poll() is None:
        try:
            with process.oneshot():
                samples.append({"time": time.time(), "rss_mib": process.memory_info().rss / 2**20,
                                "threads": process.num_threads(), "fds": process.num_fds(),
                                "load": os.getloadavg()[0]})
        except psutil.NoSuchProcess:
            break
        time.sleep(sample_s)
    log.close()
    if child.wait() != 0:
        with open(log.name) as f:
            raise RuntimeError(f"soak worker {kind} failed ({child.returncode}):\n{f.read()[-4000:]}")
    with open(probe_path) as f:
        probes = [json.loads(line) for line in f]
    return {"trainer": kind, "wall_s": round(time.time() - start, 1), "samples": samples, "probes": probes}


def step_at(probes: list[dict], t: float) -> float:
    """The step at wall time `t`, interpolated between the probe lines (the samples carry no step of their own)."""
    import numpy as np

    return float(np.interp(t, [p["time"] for p in probes], [p["step"] for p in probes]))


def growth(before: float, after: float) -> float:
    return round(100.0 * (after / before - 1.0), 2)


def summarize(run: dict, warmup: int, windows_compared: int = 5) -> dict:
    """Growth from the end of warm-up to the end (see the module docstring) of one trainer's run."""
    probes = run["probes"]
    # only while training: not the imports and model building before, nor the teardown after
    samples = run["samples"] = [s for s in run["samples"] if probes[0]["time"] <= s["time"] <= probes[-1]["time"]]
    for s in samples:
        s["step"] = round(step_at(probes, s["time"]), 1)
    end = probes[-1]["step"]
    first = [s for s in samples if warmup <= s["step"] < warmup + WINDOW]
    last = [s for s in samples if s["step"] >= end - WINDOW]
    after_warmup = [s for s in samples if s["step"] >= warmup]
    windows = [p for p in probes if "window_s" in p and p["step"] > warmup]
    early, late = windows[:windows_compared], windows[-windows_compared:]
    at_warmup = min((p for p in probes if p["step"] >= warmup), key=lambda p: p["step"])
    out = {"trainer": run["trainer"], "steps": end, "wall_s": run["wall_s"], "samples": len(samples)}
    if first and last:
        rss0, rss1 = statistics.median(s["rss_mib"] for s in first), statistics.median(s["rss_mib"] for s in last)
        out.update(rss_mib_warmup=round(rss0, 1), rss_mib_end=round(rss1, 1), rss_growth_pct=growth(rss0, rss1),
                   rss_mib_max_after_warmup=round(max(s["rss_mib"] for s in after_warmup), 1))
        for key in ("threads", "fds"):
            out[f"{key}_warmup_end"] = [first[-1][key], last[-1][key]]
            out[f"{key}_range_after_warmup"] = [min(s[key] for s in after_warmup), max(s[key] for s in after_warmup)]
    if early and late:
        for key, name in (("window_s", "step_ms"), ("window_cpu_s", "step_cpu_ms")):
            t0 = statistics.median(p[key] for p in early) * 1000 / WINDOW
            t1 = statistics.median(p[key] for p in late) * 1000 / WINDOW
            every = [p[key] * 1000 / WINDOW for p in windows]
            out.update({f"{name}_warmup": round(t0, 2), f"{name}_end": round(t1, 2),
                        f"{name}_drift_pct": growth(t0, t1),
                        f"{name}_window_range": [round(min(every), 2), round(max(every), 2)]})
    if early and late and "tokens" in probes[0]:
        previous = {p["step"]: p["tokens"] for p in probes}

        def tokens(p):  # tokens of the window
            return max(p["tokens"] - previous[p["step"] - WINDOW], 1)

        t0 = statistics.median(p["window_cpu_s"] * 1e6 / tokens(p) for p in early)  # CPU ms per 1,000 tokens
        t1 = statistics.median(p["window_cpu_s"] * 1e6 / tokens(p) for p in late)
        out.update(cpu_ms_per_1k_tokens_warmup=round(t0, 2), cpu_ms_per_1k_tokens_end=round(t1, 2),
                   cpu_ms_per_1k_tokens_drift_pct=growth(t0, t1),
                   tokens_per_step_warmup_end=[round(statistics.median(map(tokens, part)) / WINDOW)
                                               for part in (early, late)])
    for key in ("blocks", "gc_objects", "tensors", "log_entries", "log_bytes"):
        out[f"{key}_warmup_end"] = [at_warmup[key], probes[-1][key]]
    out["load_range"] = [round(min(s["load"] for s in samples), 1), round(max(s["load"] for s in samples), 1)]
    return out


def per_token(s: dict) -> str:
    if "cpu_ms_per_1k_tokens_warmup" not in s:
        return "not recorded"
    return (f"{s['cpu_ms_per_1k_tokens_warmup']} → {s['cpu_ms_per_1k_tokens_end']} "
            f"({s['cpu_ms_per_1k_tokens_drift_pct']:+} %; {'→'.join(map(str, s['tokens_per_step_warmup_end']))})")


def table(summaries: list[dict]) -> str:
    lines = ["| trainer | steps | RSS MiB warm-up → end (growth; max after warm-up) | step ms warm-up → end (drift; "
             "window range) | CPU ms per step (drift) | CPU ms per 1k tokens (drift; tokens per step) | threads | "
             "fds | live tensors | gc objects | log_history (entries, KiB) | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if "rss_growth_pct" not in s or "step_ms_drift_pct" not in s:
            lines.append(f"| {s['trainer']} | {s['steps']} | too short to compare | | | | | | | | | |")
            continue
        lines.append(
            f"| {s['trainer']} | {s['steps']:,} | {s['rss_mib_warmup']} → {s['rss_mib_end']} "
            f"({s['rss_growth_pct']:+} %; {s['rss_mib_max_after_warmup']}) | {s['step_ms_warmup']} → "
            f"{s['step_ms_end']} ({s['step_ms_drift_pct']:+} %; {s['step_ms_window_range'][0]}-"
            f"{s['step_ms_window_range'][1]}) | {s['step_cpu_ms_warmup']} → {s['step_cpu_ms_end']} "
            f"({s['step_cpu_ms_drift_pct']:+} %) | {per_token(s)} | "
            f"{'→'.join(map(str, s['threads_warmup_end']))} | "
            f"{'→'.join(map(str, s['fds_warmup_end']))} | {'→'.join(map(str, s['tensors_warmup_end']))} | "
            f"{s['gc_objects_warmup_end'][0]:,}→{s['gc_objects_warmup_end'][1]:,} | "
            f"{s['log_entries_warmup_end'][1]}, {s['log_bytes_warmup_end'][1] / 1024:.0f} | "
            f"{s['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for run in runs:
        top.plot([s["step"] for s in run["samples"]], [s["rss_mib"] for s in run["samples"]], label=run["trainer"])
        windows = [p for p in run["probes"] if "window_s" in p]
        for ax, key in ((middle, "window_s"), (bottom, "window_cpu_s")):
            ax.plot([p["step"] for p in windows], [p[key] * 1000 / WINDOW for p in windows], marker=".",
                    label=run["trainer"])
    for ax in (top, middle, bottom):
        ax.axvline(warmup, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    top.set_ylabel("RSS (MiB), sampled\nfrom outside")
    middle.set_ylabel(f"step time (ms, wall),\nmean of {WINDOW}-step windows")
    bottom.set_ylabel("step CPU time (ms),\nsame windows")
    for ax in (middle, bottom):
        ax.set_yscale("log")
    bottom.set_xlabel("optimizer step (dotted: end of warm-up)")
    top.legend(ncol=3, fontsize=8)
    top.set_title("Soak: toy trainers, one process each, 1 thread, 2 shared cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated: {', '.join(TRAINERS)}")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--sample_s", type=float, default=3.0)
    parser.add_argument("--out", default="bench/results/soak.json", help="the JSON, rewritten after each trainer")
    parser.add_argument("--plot", default=None, help="the PNG (default: next to --out)")
    parser.add_argument("--workdir", default=None, help="the probes and workers' logs (default: a temporary folder)")
    parser.add_argument("--report", default=None, help="comma-separated JSON files of earlier runs: their table "
                        "and plot (runs of the same trainer: the last one), nothing run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.probe)
        return []
    if args.report:
        runs = {}
        for path in args.report.split(","):
            with open(path) as f:
                runs.update({run["trainer"]: run for run in json.load(f)["runs"]})
        summaries = [summarize(run, args.warmup) for run in runs.values()]
        print(table(summaries))
        plot(list(runs.values()), args.plot or os.path.splitext(args.out)[0] + ".png", args.warmup)
        return summaries
    from harness import versions

    workdir = args.workdir or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(workdir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    command = "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs, summaries = [], []
    for kind in args.trainers.split(","):
        run = run_one(kind, args.steps, args.sample_s, workdir)
        summary = summarize(run, args.warmup)
        print(json.dumps(summary), flush=True)
        runs.append(run)
        summaries.append(summary)
        with open(args.out, "w") as f:
            json.dump({"command": command.strip(), "summaries": summaries, "runs": runs, "cpus": os.cpu_count(),
                       "versions": versions(("torch", "transformers", "psutil"))}, f)
    print("\n" + table(summaries))
    plot(runs, args.plot or os.path.splitext(args.out)[0] + ".png", args.warmup)
    return summaries


if __name__ == "__main__":
    main()
