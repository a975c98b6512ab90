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
