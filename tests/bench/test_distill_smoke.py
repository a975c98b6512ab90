"""bench/distill.py runs end to end in its quick mode and writes its JSON (no timing is asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "distill.py"


@pytest.mark.slow  # a benchmark's smoke run (3 worker subprocesses, ~45 s): not in the README's test command
def test_distill_bench_quick(tmp_path):
    output = tmp_path / "distill.json"
    path = os.pathsep.join(filter(None, [str(BENCH.parents[1]), os.environ.get("PYTHONPATH")]))  # this checkout
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeats", "1", "--output", str(output)],
                          capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["summary"]) == {"hf_rlhf", "hf_rlhf_lean", "trl"}
    runs = {run["config"]: run for run in results["runs"]}
    assert {run["pairs"] for run in runs.values()} == {32}  # the same completions
    for name in ("hf_rlhf", "hf_rlhf_lean"):
        assert runs[name]["train_loss"] == pytest.approx(runs["trl"]["train_loss"], rel=1e-4)
    assert results["summary"]["hf_rlhf"]["median_ratio_vs_trl"] > 0


@pytest.mark.slow  # two workers at a 49k vocabulary (~1-2 min)
def test_distill_bench_real_shape_losses_equal_trls(tmp_path):
    """The real-shape preset's path (bench/scale.py's models, word prompts) at SmolLM2-135M's 49,152-entry
    vocabulary, where hf_rlhf's divergence runs chunked with its gradient worked out in the forward: TRL's loss."""
    output = tmp_path / "distill.json"
    path = os.pathsep.join(filter(None, [str(BENCH.parents[1]), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, HF_RLHF_BENCH_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(BENCH), "--preset", "smoke_shape", "--configs", "hf_rlhf_lean,trl",
                           "--repeats", "1", "--output", str(output)],
                          capture_output=True, text=True, timeout=900, cwd=BENCH.parents[1], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    runs = {run["config"]: run for run in results["runs"]}
    assert set(runs) == {"hf_rlhf_lean", "trl"} and {run["pairs"] for run in runs.values()} == {8}
    assert runs["hf_rlhf_lean"]["train_loss"] == pytest.approx(runs["trl"]["train_loss"], rel=1e-4)
    assert "vocabulary 49,152" in " ".join(results["notes"])
