"""bench/generation.py runs end to end in its quick mode and writes its JSON (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a benchmark's smoke run (worker subprocesses, ~55 s on 2 cores): not in the README's test command
pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "generation.py"


def test_generation_bench_quick(tmp_path):
    output = tmp_path / "generation.json"
    # three worker subprocesses (one compiles a tiny model): ~60 s on a busy 2-core box
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--output", str(output)],
        capture_output=True, text=True, timeout=400, cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    assert set(results["summary"]) == {"generate", "static_eager", "static"}
    runs = {run["config"]: run for run in results["runs"]}
    assert len({run["tokens_per_call"] for run in runs.values()}) == 1  # the same work: 4 rows x 8 new tokens
    assert runs["generate"]["tokens_per_call"] == 4 * 8
    assert runs["static"]["engine_compiles"] == 1 and runs["static_eager"]["engine_compiles"] == 0
    for name, entry in results["summary"].items():
        assert entry["median_tokens_per_s_excl_compile"] > 0, name
    assert "| config | tokens/s excl. compile |" in done.stdout
