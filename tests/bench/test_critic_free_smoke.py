"""bench/critic_free.py runs end to end in its quick mode and writes its JSON (no timing is asserted).

One pair (hf_rlhf GRPO and the installed `trl.GRPOTrainer`): each worker imports torch/transformers/trl, ~30 s on a
busy 2-core box.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "critic_free.py"
CONFIGS = ["hf_rlhf_grpo", "trl_grpo"]


def load_bench():
    """bench/critic_free.py as a module. It imports its neighbours as `harness` and `ppo`: whatever those names were
    is put back (a recipe's `ppo` imported by another test must not be shadowed by the bench's, nor the other way
    round)."""
    import importlib.util

    saved = {name: sys.modules.pop(name, None) for name in ("harness", "ppo")}
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("critic_free_bench", BENCH)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH.parent))
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
    return bench


@pytest.mark.slow  # a benchmark's smoke run (worker subprocesses, 35-80 s): not in the README's test command
def test_critic_free_bench_quick(tmp_path):
    output = tmp_path / "critic_free.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--configs", ",".join(CONFIGS),
         "--output", str(output)],
        capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())

    assert list(results["summary"]) == CONFIGS
    settings = results["settings"]
    runs = {run["config"]: run for run in results["runs"]}
    for name, run in runs.items():
        # the same work: every completion generated, one optimizer step per generation
        assert run["episodes"] == settings["steps"] * settings["micro"] * settings["grad_accum"], name
        assert run["optimizer_steps"] == settings["steps"], name
        assert run["episodes_per_s"] > 0 and run["peak_rss_mb"] >= run["rss_after_import_mb"] > 0, name
        assert run["steady_episodes_per_s"] > 0, name  # steps 2..N (the quick preset has 2)
        assert run["phases"]["seconds"]["generate"] > 0, name
        assert run["memory"]["weights/reference"] > 0, name  # both hold a reference (β > 0)
    ratio = results["summary"]["hf_rlhf_grpo"]["median_ratio_episodes_per_s"]
    assert ratio == pytest.approx(runs["hf_rlhf_grpo"]["episodes_per_s"] / runs["trl_grpo"]["episodes_per_s"])
    steady = results["summary"]["hf_rlhf_grpo"]["median_ratio_steady_episodes_per_s"]
    assert steady == pytest.approx(runs["hf_rlhf_grpo"]["steady_episodes_per_s"]
                                   / runs["trl_grpo"]["steady_episodes_per_s"])
    assert "| config | median episodes/s | median peak RSS MB |" in done.stdout
    assert "Reproduce: `python bench/critic_free.py --quick" in done.stdout


@pytest.mark.slow  # a benchmark's smoke run (worker subprocesses, 35-80 s): not in the README's test command
def test_critic_free_bench_long_prompts_beta_zero(tmp_path):
    """`--prompts long --grpo_beta 0` (TRL 1.16's default β): no reference on either side, the long prompts reach
    both trainers, and hf_rlhf's prompt sharing can be switched off (`hf_rlhf_grpo_unshared`)."""
    output = tmp_path / "critic_free.json"
    configs = ["hf_rlhf_grpo_unshared", "trl_grpo"]
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--configs", ",".join(configs), "--prompts", "long",
         "--grpo_beta", "0", "--output", str(output)],
        capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["settings"]["betas"]["grpo"] == 0.0 and results["settings"]["prompt_prefix"].startswith("you are")
    for run in results["runs"]:
        assert "weights/reference" not in run["memory"], run["config"]  # β = 0: no reference model built
        assert "forward/reference/no_grad" not in run["phases"]["seconds"], run["config"]
    assert "Reproduce: `python bench/critic_free.py --quick --prompts long --configs hf_rlhf_grpo_unshared,trl_grpo " \
           "--grpo_beta 0 --repeats 1`" in done.stdout


def test_every_configurations_options_are_ppo_options(tmp_path):
    """The hf_rlhf configurations that differ by options (`OPTIONS`: prefix_sharing, group_by_length off) pass
    options that PPOConfig takes and keeps (a renamed option would stop the bench only after minutes of others)."""
    from hf_rlhf.trainers.ppo_config import PPOConfig

    bench = load_bench()
    assert set(bench.OPTIONS) == {"hf_rlhf_grpo_unshared", "hf_rlhf_grpo_ungrouped"}
    for name, options in bench.OPTIONS.items():
        assert name in bench.CONFIGS and bench.REFERENCE[name] == "trl_grpo"
        args = PPOConfig(output_dir=str(tmp_path), report_to="none", **options)
        assert all(getattr(args, key) == value for key, value in options.items()), name


def test_steady_rate_counts_steps_after_the_first():
    steady_rate = load_bench().steady_rate
    points = [{"when": "before_train", "time": 0.0}, {"when": 1, "time": 2.0}, {"when": 2, "time": 3.0},
              {"when": 3, "time": 5.0}]
    # 30 episodes in 3 steps: steps 2 and 3 (20 episodes) from t=2 to t=5
    assert steady_rate(30, points) == pytest.approx(20 / 3)
    assert steady_rate(10, points[:2]) is None  # one step: no interval after it


@pytest.mark.slow  # a benchmark's smoke run (worker subprocesses): not in the README's test command
def test_critic_free_bench_long_tailed_world(tmp_path):
    """`--world longtail` (issue 42's unseen world) as documented, cut to 2 steps: G = 4, 16 completions a step of 32
    tokens, β 0.05, long-tailed prompts reach both trainers."""
    output = tmp_path / "critic_free.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--world", "longtail", "--configs", "hf_rlhf_grpo,trl_grpo", "--repeats", "1",
         "--steps", "2", "--output", str(output)],
        capture_output=True, text=True, timeout=900, cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    settings = results["settings"]
    assert (settings["num_generations"], settings["micro"] * settings["grad_accum"], settings["response_length"],
            settings["betas"]["grpo"], settings["prompt_lengths"]) == (4, 16, 32, 0.05, "longtail")
    for run in results["runs"]:
        assert run["episodes"] == 2 * 16 and run["optimizer_steps"] == 2, run["config"]
    assert "Reproduce: `python bench/critic_free.py --world longtail --steps 2 --configs hf_rlhf_grpo,trl_grpo " \
           "--repeats 1`" in done.stdout


def test_long_tailed_prompts_span_12_to_218_tokens(tmp_path):
    """The long-tailed world's prompts: token lengths from 12 to 218, median near 40, a tail several times longer."""
    import statistics

    from transformers import AutoTokenizer

    bench = load_bench()
    settings = dict(bench.PRESETS["longtail"], steps=48, prompt_prefix="", prompt_lengths="longtail")
    bench.prepare(settings, str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    rows = json.loads((tmp_path / "prompts_g4.json").read_text())
    lengths = sorted(len(tokenizer(row["prompt"]).input_ids) for row in rows)
    assert len(lengths) == 48 * 16 // 4
    assert lengths[0] >= 12 and lengths[-1] <= 218 and lengths[-1] >= 150
    assert 25 <= statistics.median(lengths) <= 60
    assert lengths[-len(lengths) // 10] >= 2.5 * statistics.median(lengths)  # the top decile: 2.5x the median+
