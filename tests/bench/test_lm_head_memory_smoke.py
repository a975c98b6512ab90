"""bench/lm_head_memory.py's sweep runs end to end (no timing or memory figure asserted): the plain and chunked
runs of each point reach the same loss, each has the plan's prediction beside it, and the plot is written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lm_head_memory.py"


@pytest.mark.slow  # 4 worker subprocesses, ~40 s on an idle machine
def test_lm_head_memory_sweep(tmp_path):
    output, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    done = subprocess.run([sys.executable, str(BENCH), "--rows", "1", "--tokens", "32", "--steps", "2", "--layers",
                           "1", "--vocab", "2000", "--sweep", "layers=1,2", "--plot",
                           str(png), "--output", str(output)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(output.read_text())["runs"]
    assert [(r["sweep"], r["mode"]) for r in runs] == [("layers", mode) for _ in range(2) for mode in ("plain",
                                                                                                        "chunked")]
    assert [r["layers"] for r in runs] == [1, 1, 2, 2] and {r["vocab"] for r in runs} == {2000}
    for plain, chunked in zip(runs[::2], runs[1::2]):
        assert abs(plain["loss"] - chunked["loss"]) < 1e-4  # the same step, the head in chunks or not
        assert plain["predicted_step_mb"] > 0 and chunked["predicted_step_mb"] > 0
    assert png.stat().st_size > 0
