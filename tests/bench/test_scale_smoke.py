"""bench/scale.py runs end to end on its tiny shape and writes its JSON (no timing is asserted): the SFT and GRPO
pairs against TRL, and the roofline of two generation engines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


@pytest.mark.slow  # a benchmark's smoke run (6 worker subprocesses, ~60 s): not in the README's test command
def test_scale_bench_quick(tmp_path):
    output = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeats", "1", "--output", str(output),
                           "--workloads", "sft_padded,grpo,roofline", "--libraries", "trl,hf_rlhf,generate,lean"],
                          capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1],
                          env={**os.environ, "HF_RLHF_BENCH_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["summary"]) == {"tiny/sft_padded:trl", "tiny/sft_padded:hf_rlhf", "tiny/grpo:trl",
                                       "tiny/grpo:hf_rlhf", "tiny/roofline:generate", "tiny/roofline:lean"}
    runs = {run["config"]: run for run in results["runs"]}
    assert runs["tiny/sft_padded:trl"]["real_tokens"] == runs["tiny/sft_padded:hf_rlhf"]["real_tokens"]
    assert abs(runs["tiny/sft_padded:trl"]["first_loss"] - runs["tiny/sft_padded:hf_rlhf"]["first_loss"]) < 1e-3
    assert runs["tiny/grpo:trl"]["episodes"] == runs["tiny/grpo:hf_rlhf"]["episodes"] == 8
    for name, run in runs.items():
        if "roofline" in name:
            assert run["bandwidth"]["copy_gb_s"] > 0
            assert 0 < run["results"]["batch_8"]["fraction_of_roofline"]
        else:
            assert run["peak_mb"] > 0 and run["predicted_mb"] > 0
    assert "| tiny | sft_padded | hf_rlhf |" in results["table"]


@pytest.mark.slow  # ~70 s: 6 worker subprocesses, TRL 1.12 side-installed for the PPO pair
def test_scale_bench_quick_reward_ppo_prefix_sharing(tmp_path):
    output = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--output", str(output), "--workloads",
                           "dpo_padded,dpo_prefix_sharing,reward,ppo", "--dpo_batch", "2", "--grpo_batch", "4"],
                          capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1],
                          env={**os.environ, "HF_RLHF_BENCH_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    runs = {run["config"]: run for run in results["runs"]}
    assert set(runs) == {f"tiny/{w}:{lib}" for w in ("dpo_padded", "reward", "ppo") for lib in ("trl", "hf_rlhf")} | {
        "tiny/dpo_prefix_sharing:hf_rlhf"}
    # the same pairs whatever the layout: the prefix-shared batches hold each prompt once, the work counted is not
    assert runs["tiny/dpo_prefix_sharing:hf_rlhf"]["real_tokens"] == runs["tiny/dpo_padded:trl"]["real_tokens"]
    assert abs(runs["tiny/dpo_prefix_sharing:hf_rlhf"]["first_loss"] - runs["tiny/dpo_padded:trl"]["first_loss"]) < 1e-4
    assert runs["tiny/reward:trl"]["steps"] == runs["tiny/reward:hf_rlhf"]["steps"] == 2  # 2 x dpo_batch pairs
    assert runs["tiny/ppo:trl"]["episodes"] == runs["tiny/ppo:hf_rlhf"]["episodes"] == 8  # one rollout of 4 x 2
    assert runs["tiny/ppo:hf_rlhf"]["prediction"]["parts"]["reward model"] > 0
    assert "value model" in runs["tiny/ppo:trl"]["prediction"]["parts"]  # TRL's separate value model, planned
    assert results["settings"]["optim"] == "adamw_torch_fused"
