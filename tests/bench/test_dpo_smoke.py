"""bench/dpo.py runs end to end in its quick mode and writes its JSON (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "dpo.py"


@pytest.mark.slow  # a benchmark's smoke run (4 worker subprocesses, 35-80 s): not in the README's test command
def test_dpo_bench_quick(tmp_path):
    output = tmp_path / "dpo.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeats", "1", "--output", str(output)],
                          capture_output=True, text=True, timeout=300, cwd=BENCH.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["summary"]) == {"padded", "padding_free", "prefix_sharing", "trl"}
    runs = {run["config"]: run for run in results["runs"]}
    assert len({(run["real_tokens"], run["pairs"]) for run in runs.values()}) == 1  # the same work
    assert runs["prefix_sharing"]["positions_per_pair"] < runs["padded"]["positions_per_pair"]  # prompt computed once
    assert runs["padding_free"]["positions_per_pair"] < runs["padded"]["positions_per_pair"]  # no padding
