"""bench/ppo.py runs end to end in its quick mode and writes its JSON (no timing is asserted).

Only hf_rlhf configurations: the TRL ones need TRL 1.12 side-installed from PyPI (network), which a test must not.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ppo.py"
# two workers (each imports torch/transformers/peft: ~20 s on a busy 2-core box)
CONFIGS = ["hf_rlhf_one_base", "hf_rlhf_value_head_forward"]


@pytest.mark.slow  # a benchmark's smoke run (worker subprocesses, 35-80 s): not in the README's test command
def test_ppo_bench_quick(tmp_path):
    output = tmp_path / "ppo.json"
    # the parent builds and saves the models, then one worker subprocess runs: ~15 s idle, ~45 s on a busy box
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--configs", ",".join(CONFIGS),
         "--output", str(output)],
        capture_output=True, text=True, timeout=300, cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())

    assert list(results["summary"]) == CONFIGS
    runs = {run["config"]: run for run in results["runs"]}
    for name, run in runs.items():
        group = results["settings"][run["group"]]
        # every run rolled out every episode and took one optimizer step per rollout and PPO epoch
        assert run["episodes"] == group["rollouts"] * group["micro"] * group["grad_accum"], name
        assert run["optimizer_steps"] == group["rollouts"] * group["ppo_epochs"], name
        assert run["episodes_per_s"] > 0 and run["peak_rss_mb"] >= run["rss_after_import_mb"] > 0, name
        assert not run["bf16"] and not run["activation_checkpointing"], name
        assert run["phases"]["seconds"]["generate"] > 0, name
    # one base in memory: the policy's, with the reward adapter's head; no reference copy, reward or value model
    memory = runs["hf_rlhf_one_base"]["memory"]
    assert {"weights/policy", "weights/reward_head", "weights/value_head"} <= set(memory)
    assert not {"weights/reference", "weights/reward", "weights/value"} & set(memory)
    # logprobs_from_generation=False: the rollout's own policy forward, once per rollout
    forward = runs["hf_rlhf_value_head_forward"]
    assert forward["phases"]["calls"]["forward/policy/no_grad"] == results["settings"]["speed"]["rollouts"]
    assert "| config | group | median episodes/s | median peak RSS MB |" in done.stdout
    assert "Reproduce: `python bench/ppo.py" in done.stdout
