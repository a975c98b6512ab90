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
