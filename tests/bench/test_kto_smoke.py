"""bench/kto.py runs end to end in its quick mode and writes its JSON (no timing is asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kto.py"


@pytest.mark.slow  # a benchmark's smoke run (3 worker subprocesses, ~40 s): not in the README's test command
def test_kto_bench_quick(tmp_path):
    output = tmp_path / "kto.json"
    root = str(BENCH.parents[1])  # this checkout's hf_rlhf in the workers, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeats", "1", "--output", str(output)],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["summary"]) == {"padded", "padding_free", "prefix_sharing", "trl"}
    runs = {run["config"]: run for run in results["runs"]}
    assert len({(run["real_tokens"], run["pairs"]) for run in runs.values()}) == 1  # the same work
    assert runs["padded"]["train_loss"] == pytest.approx(runs["trl"]["train_loss"], abs=1e-5)  # the same loss
    assert runs["padding_free"]["positions_per_pair"] < runs["padded"]["positions_per_pair"]  # no padding
    assert runs["prefix_sharing"]["train_loss"] == pytest.approx(runs["trl"]["train_loss"], abs=1e-5)
