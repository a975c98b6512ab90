"""Critic-free RL episodes/s and peak RSS: hf_rlhf's GRPO / RLOO (`PPOTrainer` with `advantage_estimator`) against
`trl.GRPOTrainer` / `trl.RLOOTrainer` (the installed TRL, 1.16).

One process per run (no DDP), each configuration in its own subprocess, rounds interleaved (A B C D A B C D ...) so
that drifts in the load of this shared machine hit every configuration alike. Every run loads the same saved toy
Llama policy and tokenizer, takes the same prompts in the same order and does the same work: G completions per
prompt, the same completions per optimizer step (micro-batch x gradient accumulation, one generation per step),
one pass over each generation (TRL's `num_iterations=1`, hf_rlhf's `num_ppo_epochs=1`), response length and stop
token (eos), temperature, AdamW and learning rate, fp32, one torch thread, one log per step, the same Python reward
function. The KL is where each TRL trainer puts it:
  grpo: β = 0.04 in the loss, k3 per token, token mean over the step (TRL's `beta=0.04`, `loss_type="dapo"`;
        hf_rlhf `kl_in_loss=True, kl_estimator="k3", kl_coef=0.04`); group-normalised advantages. TRL 1.16's
        default is `beta=0.0` (no reference model, no KL): `--grpo_beta 0` measures that (hf_rlhf `kl_coef=0`).
  rloo: β = 0.05 as a reward penalty, β·Σ k1 subtracted from the score (TRL's default `beta=0.05`; hf_rlhf
        `kl_coef=0.05`).
hf_rlhf runs with its defaults otherwise: with G > 1 completions per prompt that includes `prefix_sharing` (the
prompt computed once for the completions of a forward); `hf_rlhf_grpo_unshared` is the same run with it off, to
measure that saving alone, and `hf_rlhf_grpo_ungrouped` the same with `group_by_length` off (each step's
micro-batches cut at random instead of by length).
Episodes (completions generated) and optimizer steps are counted in every run and checked equal across a pair.

episodes/s = completions generated / wall time of `trainer.train()` (episodes/CPU-s: / its CPU time, one thread,
steadier than wall time on a loaded machine). Steady episodes/s = the completions of steps 2..N / the wall time from
the end of step 1 to the end of step N: the rate a long run trains at, without what `train()` pays once (accelerate's
`free_memory()` gc.collect, the first step's warm-up), which weighs ~10 % in these 12-step runs on both sides.
Peak RSS = the worker's high-water mark at the end (VmHWM). Each run also times where `train()` went (bench/ppo.py's
`PhaseTimer`: generation, forwards by model, backward, optimizer, gc) and counts the bytes of weights, trainable
parameters and optimizer state.

The value group (`--configs value`) measures what the critic-free estimators save: hf_rlhf REINFORCE++ (no value
function) against PPO/GAE with a value head on the policy backbone and with a separate value model, on the same
prompts, one completion per prompt, the same KL (β = 0.05, k1, in the reward) and the same steps.

    python bench/critic_free.py                          # ~10 min on 2 busy CPU cores
    python bench/critic_free.py --configs value          # what PPO's value head / value model costs
    python bench/critic_free.py --configs hf_rlhf_grpo_generate,hf_rlhf_grpo_lean,trl_grpo --repeats 5
    python bench/critic_free.py --quick --repeats 1      # smoke run: 4 workers, ~2 min on 2 busy cores
    python bench/critic_free.py --configs hf_rlhf_grpo,hf_rlhf_grpo_unshared,trl_grpo --prompts long --repeats 3
    python bench/critic_free.py --world longtail --configs hf_rlhf_grpo,trl_grpo --repeats 5
    python bench/critic_free.py --world longtail --model llama25m --configs hf_rlhf_grpo,trl_grpo --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # bench/harness.py: these scripts run as `python bench/<name>.py`
import ppo as ppo_bench  # bench/ppo.py: PhaseTimer, peak_rss_mb, backbone, memory_report

# config -> (library, advantage estimator, value function)
CONFIGS = {
    "hf_rlhf_grpo": ("hf_rlhf", "grpo", None), "trl_grpo": ("trl", "grpo", None),
    "hf_rlhf_rloo": ("hf_rlhf", "rloo", None), "trl_rloo": ("trl", "rloo", None),
    # hf_rlhf GRPO with an explicit `PPOConfig.generation_backend` (hf_rlhf_grpo: the trainer's default)
    "hf_rlhf_grpo_generate": ("hf_rlhf", "grpo", None), "hf_rlhf_grpo_lean": ("hf_rlhf", "grpo", None),
    "hf_rlhf_grpo_unshared": ("hf_rlhf", "grpo", None),  # prefix_sharing=False: every completion runs its prompt
    "hf_rlhf_grpo_ungrouped": ("hf_rlhf", "grpo", None),  # group_by_length=False: micro-batches cut at random
    # the value group: what the value function costs, on PPO's one sample per prompt (--configs value)
    "hf_rlhf_reinforce_pp": ("hf_rlhf", "reinforce_pp", None),
    "hf_rlhf_ppo_value_head": ("hf_rlhf", "gae", "head"),
    "hf_rlhf_ppo_value_model": ("hf_rlhf", "gae", "model"),
}
DEFAULT_CONFIGS = ("hf_rlhf_grpo", "trl_grpo", "hf_rlhf_rloo", "trl_rloo")
VALUE_CONFIGS = ("hf_rlhf_reinforce_pp", "hf_rlhf_ppo_value_head", "hf_rlhf_ppo_value_model")
BACKENDS = {"hf_rlhf_grpo_generate": "generate", "hf_rlhf_grpo_lean": "lean"}
OPTIONS = {"hf_rlhf_grpo_unshared": {"prefix_sharing": False},  # PPOConfig options of a configuration
           "hf_rlhf_grpo_ungrouped": {"group_by_length": False}}
REFERENCE = {"hf_rlhf_grpo": "trl_grpo", "hf_rlhf_grpo_generate": "trl_grpo", "hf_rlhf_grpo_lean": "trl_grpo",
             "hf_rlhf_grpo_unshared": "trl_grpo", "hf_rlhf_grpo_ungrouped": "trl_grpo",
             "hf_rlhf_rloo": "trl_rloo", "hf_rlhf_ppo_value_head": "hf_rlhf_reinforce_pp",
             "hf_rlhf_ppo_value_model": "hf_rlhf_reinforce_pp"}
PRESETS = {
    # completions per optimizer step = micro x grad_accum = prompts_per_step x num_generations
    "full": dict(model_size="small", micro=16, grad_accum=2, num_generations=8, response_length=16, steps=12),
    "quick": dict(model_size="tiny", micro=4, grad_accum=2, num_generations=4, response_length=8, steps=2),
    # --world longtail: a world this bench's other presets never exercise (issue 42): prompts of 12-218 tokens with
    # a long tail, 4 prompts x G = 4 completions per optimizer step (one generation per step), 32-token completions,
    # GRPO's β = 0.05 with k3 in the loss
    "longtail": dict(model_size="small", micro=16, grad_accum=1, num_generations=4, response_length=32, steps=12),
}
# --world longtail's prompt lengths in tokens: log-normal (median 40, σ 0.8), clipped to [12, 218]; most prompts
# short, a few several times longer, as chat prompts with and without documents or few-shot examples
LONGTAIL = dict(median=40, sigma=0.8, low=12, high=218)
COMMON = dict(temperature=0.7, learning_rate=1e-5)
# --prompts long: every prompt behind this instruction (89 tokens of the character-level toy tokenizer), as chat
# templates and system prompts make real GRPO prompts several times longer than these 6-16 token toy prompts
LONG_PROMPT_PREFIX = "you are a careful solver. read the task, work it out, then write only the answer. task: "
KL = {"grpo": 0.04, "rloo": 0.05, "reinforce_pp": 0.05, "gae": 0.05}  # TRL's default betas (GRPO, RLOO)


def digit_reward(prompts, completions, **kwargs):
    """A verifiable-style reward that varies with a random policy's text: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


# ----------------------------------------------------------------------------------------------- worker side
def trainer_options(settings: dict, output_dir: str) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=settings["micro"],
                gradient_accumulation_steps=settings["grad_accum"], max_steps=settings["steps"], logging_steps=1,
                save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=True, bf16=False,
                dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0, **COMMON)


def build_trl(estimator: str, model_dir: str, prompts, settings: dict, output_dir: str):
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config, trainer_class = (GRPOConfig, GRPOTrainer) if estimator == "grpo" else (RLOOConfig, RLOOTrainer)
    args = config(**trainer_options(settings, output_dir), num_generations=settings["num_generations"],
                  max_completion_length=settings["response_length"], beta=settings["betas"][estimator],
                  num_iterations=1)
    trainer = trainer_class(model=model_dir, reward_funcs=digit_reward, args=args, train_dataset=prompts)
    return trainer, {"policy": trainer.model, "reference": trainer.ref_model}


def build_hf_rlhf(estimator: str, model_dir: str, prompts, settings: dict, output_dir: str, value: str | None = None,
                  backend: str | None = None, name: str | None = None):
    from hf_rlhf import PPOConfig, PPOTrainer

    kl = dict(kl_in_loss=True, kl_estimator="k3") if estimator == "grpo" else dict(kl_estimator="k1")
    if backend is not None:
        kl["generation_backend"] = backend
    args = PPOConfig(**trainer_options(settings, output_dir), advantage_estimator=estimator,
                     num_generations=num_generations(estimator, settings), num_ppo_epochs=1,
                     rollout_batch_size=settings["micro"] * settings["grad_accum"],
                     response_length=settings["response_length"], kl_coef=settings["betas"][estimator], **kl,
                     **OPTIONS.get(name, {}))
    # the value model: a one-label classifier on the policy's weights (TRL's PPO examples start it from the RM)
    trainer = PPOTrainer(model_dir, digit_reward, args=args, train_dataset=prompts,
                         value_model=model_dir if value == "model" else None)
    module = trainer.model
    return trainer, {"policy": module.policy, "reference": trainer.ref_model,
                     "value": module.value_model if value == "model" else module.value_head}


def num_generations(estimator: str, settings: dict) -> int:
    return settings["num_generations"] if estimator in ("grpo", "rloo") else 1


def worker(name: str, settings: dict, threads: int, model_dir: str) -> dict:
    import psutil
    import torch
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_post_hook

    library, estimator, value = CONFIGS[name]
    if library == "trl":
        import trl  # noqa: F401
    else:
        import hf_rlhf.trainers.ppo_trainer  # noqa: F401
    torch.set_num_threads(threads)
    rss_import = ppo_bench.peak_rss_mb()
    group = num_generations(estimator, settings)
    prompts = Dataset.from_list(json.loads(Path(model_dir, f"prompts_g{group}.json").read_text()))
    timer, steps = ppo_bench.PhaseTimer(), []
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON
        if library == "trl":
            trainer, models = build_trl(estimator, model_dir, prompts, settings, tmp)
        else:
            trainer, models = build_hf_rlhf(estimator, model_dir, prompts, settings, tmp, value, BACKENDS.get(name),
                                            name)
        timed = {role: model for role, model in models.items() if model is not None}
        if value != "model":
            timed.pop("value", None)  # a value head is no backbone: its cost is inside the policy's forward
        timer.install({role: ppo_bench.backbone(model) for role, model in timed.items()})
        register_optimizer_step_post_hook(lambda *a: steps.append(1))
        timeline = MemoryTimeline()
        trainer.add_callback(timeline)
        rss_before_train = psutil.Process().memory_info().rss / ppo_bench.MB
        timeline.record("before_train")
        cpu_start, start = time.process_time(), time.perf_counter()
        trainer.train()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = ppo_bench.peak_rss_mb()
    return {
        "config": name, "seconds": seconds, "episodes": timer.rows, "episodes_per_s": timer.rows / seconds,
        "cpu_seconds": cpu_seconds, "episodes_per_cpu_s": timer.rows / cpu_seconds,
        "optimizer_steps": len(steps), "peak_rss_mb": peak, "rss_after_import_mb": rss_import,
        "rss_before_train_mb": rss_before_train, "peak_increase_mb": peak - rss_import,
        "memory": ppo_bench.memory_report({k: v for k, v in models.items() if v is not None}, trainer.optimizer),
        "steady_episodes_per_s": steady_rate(timer.rows, timeline.points),
        "phases": timer.report(seconds), "threads": torch.get_num_threads(), "load_before": os.getloadavg()[0],
        "memory_timeline": timeline.points,
    }


def steady_rate(episodes: int, points: list[dict]) -> float | None:
    """Episodes per second from the end of the first optimizer step to the end of the last (steps 2..N, each
    step the same number of episodes), or None with fewer than two steps."""
    ends = [point["time"] for point in points if point["when"] != "before_train"]
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return episodes * (len(ends) - 1) / len(ends) / (ends[-1] - ends[0])


class MemoryTimeline:
    """Peak and current RSS (MB) and the count of imported modules before training and after each optimizer step:
    whether the peak comes from one-time costs of the first step (lazy imports, allocator growth) or grows later.
    Each point also holds its `time.perf_counter()`, from which `steady_rate` reads the steps' ends."""

    def __init__(self):
        self.points = []

    def record(self, when) -> None:
        import psutil

        self.points.append({"when": when, "time": time.perf_counter(), "peak_mb": round(ppo_bench.peak_rss_mb(), 1),
                            "rss_mb": round(psutil.Process().memory_info().rss / ppo_bench.MB, 1),
                            "modules": len(sys.modules)})

    def on_step_end(self, args, state, control, **kwargs):
        self.record(state.global_step)

    def __getattr__(self, name):  # the other TrainerCallback events: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


# ----------------------------------------------------------------------------------------------- parent side
def prepare(settings: dict, root: str) -> str:
    """The toy tokenizer and a seeded toy Llama policy saved to `root`, and the prompts (one step = P prompts)."""
    from hf_rlhf.toy import build_toy_model, build_toy_tokenizer, prompt_dataset

    tokenizer = build_toy_tokenizer()
    if settings["model_size"] == "llama25m":  # bench/generation.py's llama40m shape on the toy vocabulary
        model = build_llama25m(tokenizer)
    else:
        model = build_toy_model(tokenizer, settings["model_size"], seed=0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    for group in {1, settings["num_generations"]}:  # the prompts of one step = its completions / G
        rows = prompt_dataset(settings["micro"] * settings["grad_accum"] // group * settings["steps"], seed=0)
        prefix = settings.get("prompt_prefix", "")
        prompts = [prefix + p for p in rows["prompt"]]
        if settings.get("prompt_lengths") == "longtail":
            prompts = long_tailed_prompts(prompts, tokenizer, seed=group)
        Path(root, f"prompts_g{group}.json").write_text(json.dumps([{"prompt": p} for p in prompts]))
    return root


def build_llama25m(tokenizer):
    """bench/generation.py's llama40m shape (hidden 512, 8 layers, 8 heads, MLP 1,408) on the toy tokenizer's
    vocabulary, so that sampled ids decode: 25M parameters; seeded."""
    import generation as generation_bench  # bench/generation.py

    return generation_bench.build_model("llama40m", tokenizer, vocab_size=len(tokenizer), max_position_embeddings=512,
                                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def long_tailed_prompts(prompts: list[str], tokenizer, seed: int) -> list[str]:
    """Each toy prompt behind filler text (LONG_PROMPT_PREFIX repeated) to a token length drawn from `LONGTAIL`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(np.log(LONGTAIL["median"]), LONGTAIL["sigma"], len(prompts)))
    lengths = np.clip(np.rint(lengths), LONGTAIL["low"], LONGTAIL["high"]).astype(int)
    out = []
    for prompt, length in zip(prompts, lengths):
        filler, have = "", len(tokenizer(prompt).input_ids)
        while have < length:  # grow by the tokens still missing (one character is one token or less)
            filler = (LONG_PROMPT_PREFIX * 4)[: len(filler) + length - have]
            have = len(tokenizer(filler + prompt).input_ids)
        out.append(filler + prompt)
    return out


def check_same_work(runs: list[dict]) -> None:
    for name, reference in REFERENCE.items():
        for a, b in zip((r for r in runs if r["config"] == name), (r for r in runs if r["config"] == reference)):
            if (a["episodes"], a["optimizer_steps"]) != (b["episodes"], b["optimizer_steps"]):
                raise RuntimeError(f"{name} and {reference} did different work: {a['episodes']} / {b['episodes']} "
                                   f"episodes, {a['optimizer_steps']} / {b['optimizer_steps']} optimizer steps")


def summarize(runs: list[dict], configs: list[str], repeats: int) -> dict:
    summary = {}
    by = {(i // len(configs), run["config"]): run for i, run in enumerate(runs)}
    for name in configs:
        entry = {}
        for metric in ("episodes_per_s", "steady_episodes_per_s", "episodes_per_cpu_s", "peak_rss_mb",
                       "peak_increase_mb"):
            if any(by[r, name].get(metric) is None for r in range(repeats)):
                continue  # a run of one step has no steady rate
            entry[f"median_{metric}"] = statistics.median(by[r, name][metric] for r in range(repeats))
            reference = REFERENCE.get(name)
            if reference in configs and all(by[r, reference].get(metric) is not None for r in range(repeats)):
                # paired ratios: the runs of one round ran side by side in time
                ratios = [by[r, name][metric] / by[r, reference][metric] for r in range(repeats)]
                entry[f"ratios_{metric}"], entry[f"median_ratio_{metric}"] = ratios, statistics.median(ratios)
        summary[name] = entry
    return summary


def markdown_table(summary: dict) -> str:
    lines = ["| config | median episodes/s | median peak RSS MB | episodes/s vs TRL | steady episodes/s vs TRL "
             "| episodes/CPU-s vs TRL | peak RSS vs TRL |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, e in summary.items():
        def ratio(m, e=e):
            return f"{e[f'median_ratio_{m}']:.2f}×" if f"median_ratio_{m}" in e else "–"

        lines.append(f"| {name} | {e['median_episodes_per_s']:.2f} | {e['median_peak_rss_mb']:,.0f} "
                     f"| {ratio('episodes_per_s')} | {ratio('steady_episodes_per_s')} | {ratio('episodes_per_cpu_s')} "
                     f"| {ratio('peak_rss_mb')} |")
    return "\n".join(lines)


def phase_table(runs: list[dict], configs: list[str]) -> str:
    """Median seconds per phase of `train()`, per configuration."""
    phases = sorted({p for run in runs for p in run["phases"]["seconds"]})
    lines = ["| config | " + " | ".join(phases) + " | total |", "|---|" + "---:|" * (len(phases) + 1)]
    for name in configs:
        mine = [run for run in runs if run["config"] == name]
        def cell(p, mine=mine):
            return statistics.median(run["phases"]["seconds"].get(p, 0.0) for run in mine)

        lines.append(f"| {name} | " + " | ".join(f"{cell(p):.2f}" for p in phases)
                     + f" | {statistics.median(run['seconds'] for run in mine):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny preset (a smoke run)")
    parser.add_argument("--world", choices=("toy", "longtail"), default="toy",
                        help="longtail: long-tailed prompts of 12-218 tokens, 4 prompts x G = 4 a step, 32-token "
                             "completions, GRPO's β 0.05 (k3 in the loss) unless --grpo_beta is given")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}; 'value' = the value group")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the preset's)")
    parser.add_argument("--model", choices=("toy", "llama25m"), default="toy",
                        help="toy: the preset's toy Llama (0.9M parameters); llama25m: hidden 512, 8 layers")
    parser.add_argument("--prompts", choices=("short", "long"), default="short",
                        help="long: every prompt behind a fixed 89-token instruction (LONG_PROMPT_PREFIX)")
    parser.add_argument("--grpo_beta", type=float, default=None,
                        help="GRPO's β on both sides (0.04 in the loss by default; 0: TRL 1.16's default, "
                             "no reference)")
    parser.add_argument("--output", default="bench/results/critic_free.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.worker:
        print(json.dumps(worker(cli.worker, json.loads(cli.settings), cli.threads, cli.model_dir)))
        return {}
    configs = list(VALUE_CONFIGS) if cli.configs == "value" else cli.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    if cli.quick and cli.world != "toy":
        parser.error("--quick is the toy world's smoke preset; leave out --world")
    longtail = cli.world == "longtail"
    if cli.grpo_beta is None:
        cli.grpo_beta = 0.05 if longtail else KL["grpo"]
    preset = "longtail" if longtail else "quick" if cli.quick else "full"
    settings = dict(PRESETS[preset], betas=dict(KL, grpo=cli.grpo_beta),
                    prompt_prefix=LONG_PROMPT_PREFIX if cli.prompts == "long" else "",
                    prompt_lengths="longtail" if longtail else "fixed")
    if cli.model != "toy":
        settings["model_size"] = cli.model
    if cli.steps is not None:
        settings["steps"] = cli.steps
    runs = []
    with tempfile.TemporaryDirectory() as root:
        model_dir = prepare(settings, root)
        for r in range(cli.repeats):
            for name in configs:  # interleaved: A B C D, A B C D, ...
                run = harness.run_worker(__file__, ["--worker", name, "--settings", json.dumps(settings),
                                                    "--threads", str(cli.threads), "--model_dir", model_dir])
                runs.append(run)
                print(f"round {r + 1}/{cli.repeats} {name}: {run['episodes_per_s']:.2f} episodes/s, "
                      f"peak RSS {run['peak_rss_mb']:.0f} MB", flush=True)
    check_same_work(runs)
    summary = summarize(runs, configs, cli.repeats)
    report = {"settings": settings, "repeats": cli.repeats, "summary": summary, "runs": runs}
    harness.write_report(cli.output, report, harness.versions(("torch", "transformers", "trl", "accelerate")))
    print(markdown_table(summary))
    print()
    print(phase_table(runs, configs))
    chosen = "" if cli.configs == ",".join(DEFAULT_CONFIGS) else f" --configs {cli.configs}"
    beta = "" if cli.grpo_beta == (0.05 if longtail else KL["grpo"]) else f" --grpo_beta {cli.grpo_beta:g}"
    quick = ((" --quick" if cli.quick else "") + (" --world longtail" if longtail else "")
             + (" --prompts long" if cli.prompts == "long" else "")
             + (f" --model {cli.model}" if cli.model != "toy" else "")
             + (f" --steps {cli.steps}" if cli.steps is not None else ""))
    print(f"\nReproduce: `python bench/critic_free.py{quick}{chosen}{beta} --repeats {cli.repeats}`")
    return report


if __name__ == "__main__":
    main()
