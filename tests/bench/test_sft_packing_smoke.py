"""bench/sft_packing.py runs end to end in its quick mode and writes its JSON (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sft_packing.py"


@pytest.mark.slow  # a benchmark's smoke run (worker subprocesses, 35-80 s): not in the README's test command
def test_sft_packing_bench_quick(tmp_path):
    output = tmp_path / "sft_packing.json"
    # three worker subprocesses, each importing torch/transformers/trl: ~25 s idle, ~50 s on a busy 2-core box
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--output", str(output)],
        capture_output=True, text=True, timeout=300, cwd=BENCH.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())

    assert set(results["summary"]) == {"padded", "packed", "trl_packed"}
    for name, entry in results["summary"].items():
        assert entry["median_tokens_per_s"] > 0, name
    runs = results["runs"]
    assert len(runs) == 3
    # every configuration trained on the same examples and tokens, the packed ones on the same bfd rows
    assert len({(run["real_tokens"], run["examples"]) for run in runs}) == 1
    assert runs[0]["real_tokens"] == runs[0]["dataset_tokens"]
    packed = {run["config"]: run for run in runs}
    assert packed["packed"]["packing_hash"] == packed["trl_packed"]["packing_hash"] is not None
    assert packed["packed"]["rows"] < packed["padded"]["rows"]
    assert "| config | median real tokens/s |" in done.stdout
