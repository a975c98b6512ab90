"""KL control on the toy PPO run: the adaptive controller with a target KL beside the same run with a fixed coefficient.

Both runs are `recipes/ppo.py` with the toy config (`recipes/configs/ppo_toy.yaml`) in their own subprocess, one
after the other (the first builds the SFT policy / reward model if they are missing, the second reuses them); they
differ only in `kl_target` (T for the adaptive run, None for the fixed one) — same seed, prompts, initial β, steps.
The toy config logs once per rollout, so each logged `objective/kl` is one rollout's mean KL (summed over the
response tokens, k1 estimator), measured before the rollout's updates. Reported for the second half of the steps:
the mean KL and the fraction of logged rollouts within T ± 25 % (the acceptance criterion of the adaptive controller).

    python bench/kl_control.py                            # ~2 x 4 min on 2 busy CPU cores (models already built)
    python bench/kl_control.py --target 1.0 --horizon 1024 --max_steps 400
    python bench/kl_control.py --quick                    # smoke test: a tiny policy, few steps, < 2 min

Writes bench/results/kl_control.json and bench/results/kl_control.png (the two KL curves with the target band, and
β against the step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "ppo.py"
TOY_CONFIG = ROOT / "recipes" / "configs" / "ppo_toy.yaml"
BAND = 0.25
# --quick: a fresh tiny SFT model (built by the recipe at a tiny size) and the verifiable reward function
QUICK = {"max_steps": 48, "toy_train_size": 2048, "toy_test_size": 32, "reward_source": "function"}


def run_recipe(name: str, overrides: dict, out_dir: Path, extra_args: list[str]) -> dict:
    """Run the PPO recipe with the toy config + `overrides` in a subprocess; return its results and log history."""
    with open(TOY_CONFIG) as f:
        config = yaml.safe_load(f)
    config.update(overrides)
    config["output_dir"] = str(out_dir / name)
    config_path = out_dir / f"{name}.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, str(RECIPE), "--config", str(config_path), "--disable_tqdm", "true", *extra_args]
    print(f"[kl_control] {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (out_dir / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{name} run failed (exit {done.returncode}); log: {out_dir / f'{name}.log'}\n"
                           f"{done.stderr[-3000:]}")
    run_dir = out_dir / name
    results = json.loads((run_dir / "results.json").read_text())
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return {"config": config, "results": results, "history": history, "wall_s": round(wall, 1)}


def kl_curve(history: list[dict]) -> tuple[list[int], list[float], list[float]]:
    rows = [h for h in history if "objective/kl" in h]
    return [h["step"] for h in rows], [h["objective/kl"] for h in rows], [h["objective/kl_coef"] for h in rows]


def summarize(run: dict, target: float) -> dict:
    steps, kls, coefs = kl_curve(run["history"])
    half = steps[-1] / 2
    second = [kl for step, kl in zip(steps, kls) if step > half]
    mean = sum(second) / len(second)
    results = run["results"]
    return {
        "kl_target": run["config"].get("kl_target"),
        "kl_mean_second_half": mean,
        "kl_mean_second_half_vs_target": mean / target - 1,
        "fraction_within_25pct_second_half": sum(abs(kl / target - 1) <= BAND for kl in second) / len(second),
        "kl_min_max_second_half": [min(second), max(second)],
        "kl_final": kls[-1],
        "kl_coef_initial": coefs[0],
        "kl_coef_final": coefs[-1],
        "logged_rollouts_second_half": len(second),
        "exact_match_before": results["before"].get("exact_match"),
        "exact_match_after": results["after"].get("exact_match"),
        "score_before": results["before"].get("score"),
        "score_after": results["after"].get("score"),
        "wall_s": run["wall_s"],
        "curve": {"step": steps, "kl": kls, "kl_coef": coefs},
    }


def plot(summary: dict, target: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6.4), constrained_layout=True)
    FigureCanvasAgg(figure)
    ax_kl, ax_coef = figure.subplots(2, 1, sharex=True)
    ax_kl.axhspan(target * (1 - BAND), target * (1 + BAND), color="tab:green", alpha=0.15,
                  label=f"target {target:g} ± 25 %")
    ax_kl.axhline(target, color="tab:green", linewidth=0.8)
    for name, color in (("adaptive", "tab:blue"), ("fixed", "tab:orange")):
        curve = summary[name]["curve"]
        label = f"{name} (β₀ = {curve['kl_coef'][0]:g})"
        ax_kl.plot(curve["step"], curve["kl"], color=color, marker=".", linewidth=1.2, label=label)
        ax_coef.plot(curve["step"], curve["kl_coef"], color=color, linewidth=1.2, label=name)
    last = summary["adaptive"]["curve"]["step"][-1]
    for ax in (ax_kl, ax_coef):
        ax.axvline(last / 2, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    ax_kl.set_ylabel("KL per response (rollout mean)")
    ax_coef.set_ylabel("KL coefficient β")
    ax_coef.set_xlabel("optimizer step (dotted: start of the second half)")
    figure.suptitle("Toy PPO: adaptive KL controller vs fixed coefficient")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def table(summary: dict, target: float) -> str:
    lines = [f"KL target T = {target:g}; second half of the steps; one logged KL per rollout",
             "| run | β initial → final | mean KL (2nd half) | vs T | in T ± 25 % | min–max KL | exact match "
             "before → after |",
             "|---|---|---|---|---|---|---|"]
    for name in ("adaptive", "fixed"):
        s = summary[name]
        em = (f"{s['exact_match_before']:.3f} → {s['exact_match_after']:.3f}"
              if s["exact_match_before"] is not None else "-")
        lines.append(f"| {name} | {s['kl_coef_initial']:.4g} → {s['kl_coef_final']:.4g} | "
                     f"{s['kl_mean_second_half']:.3f} | {s['kl_mean_second_half_vs_target']:+.0%} | "
                     f"{s['fraction_within_25pct_second_half']:.0%} ({s['logged_rollouts_second_half']} rollouts) | "
                     f"{s['kl_min_max_second_half'][0]:.2f}–{s['kl_min_max_second_half'][1]:.2f} | {em} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=None, help="KL target T (default: the toy config's)")
    parser.add_argument("--horizon", type=float, default=None, help="controller horizon (default: the toy config's)")
    parser.add_argument("--kl_coef", type=float, default=None, help="initial / fixed β (default: the toy config's)")
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--reward_source", choices=["model", "function"], default=None)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny models, few steps")
    parser.add_argument("--work_dir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "kl_control.json"))
    args, extra = parser.parse_known_args(argv)  # anything else goes to both recipe runs as is

    with open(TOY_CONFIG) as f:
        toy = yaml.safe_load(f)
    common = dict(QUICK) if args.quick else {}
    for key in ("horizon", "kl_coef", "max_steps", "reward_source"):
        value = getattr(args, key)
        if value is not None:
            common["kl_horizon" if key == "horizon" else key] = value
    target = args.target if args.target is not None else toy.get("kl_target")
    if target is None:
        parser.error("the toy config has no kl_target: pass --target")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kl_control-"))
    if args.quick:
        # a tiny SFT policy built in the work directory (the shared outputs/ is left alone)
        extra = ["--sft_model_path", str(work / "sft-tiny"), "--sft_config", str(_tiny_sft_config(work)), *extra]

    runs = {"adaptive": run_recipe("adaptive", {**common, "kl_target": target}, work, extra),
            "fixed": run_recipe("fixed", {**common, "kl_target": None}, work, extra)}
    summary = {name: summarize(run, target) for name, run in runs.items()}
    output = Path(args.output)
    png = output.with_suffix(".png")
    plot(summary, target, png)
    report = {
        "kl_target": target, "band": BAND, "plot": str(png), "work_dir": str(work), "summary": summary,
        "settings": {name: {k: v for k, v in run["config"].items() if k != "output_dir"} for name, run in runs.items()},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_1_5_15_at_end": list(os.getloadavg())},
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    print(table(summary, target))
    print(f"\n[kl_control] results: {output}\n[kl_control] plot:    {png}")
    return report


def _tiny_sft_config(work: Path) -> Path:
    with open(ROOT / "recipes" / "configs" / "sft_toy.yaml") as f:
        config = yaml.safe_load(f)
    config.update({"toy_model_size": "tiny", "max_steps": 60, "toy_train_size": 2000, "logging_steps": 20,
                   "disable_tqdm": True})
    path = work / "sft_tiny.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


if __name__ == "__main__":
    main()
