"""bench/tools_toy.py runs end to end on a tiny budget and prints its phases (no figure is asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tools_toy.py"


@pytest.mark.slow  # a benchmark's smoke run (SFT 4 steps, 1 RL step with tools, 30-60 s): not in the test command
def test_tools_toy_bench_tiny(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(BENCH.parents[1]))
    done = subprocess.run([sys.executable, str(BENCH), "--model_size", "tiny", "--sft_examples", "32", "--sft_steps",
                           "4", "--rl_steps", "1", "--eval_size", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"phase"')]  # the Trainer logs too
    phases = {line["phase"]: line for line in map(json.loads, lines)}
    assert set(phases) == {"sft", "sft_sample", "rl_with_tools"}
    assert 0.0 <= phases["rl_with_tools"]["exact_match"] <= 1.0
