"""bench/soak.py: two trainers run a few windows in their own processes; the outside samples and the inside probe
lines come back, and the summary compares the first window after warm-up with the last. Growth and drift are
printed by the benchmark, not asserted (a few hundred steps on a shared machine say nothing about them)."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def soak():
    sys.path.insert(0, str(BENCH))
    try:
        import soak

        yield soak
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("soak", None)


def test_two_trainers_are_sampled_from_outside_and_inside(soak, tmp_path):
    out = tmp_path / "soak.json"
    summaries = soak.main(["--trainers", "sft,grpo_tools", "--steps", "200", "--warmup", "100", "--sample_s", "0.5",
                           "--out", str(out), "--workdir", str(tmp_path / "work")])
    assert [s["trainer"] for s in summaries] == ["sft", "grpo_tools"]
    for summary in summaries:
        assert summary["steps"] == 200 and summary["samples"] > 0
        assert summary["rss_mib_warmup"] > 0 and summary["step_ms_warmup"] > 0
        assert summary["tokens_per_step_warmup_end"][0] > 0 and summary["cpu_ms_per_1k_tokens_warmup"] > 0
        assert summary["threads_warmup_end"][1] >= 1 and summary["fds_warmup_end"][1] >= 3
        assert summary["log_entries_warmup_end"] == [9, 19]  # a log every 10 steps, read just before the log
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 and (tmp_path / "soak.png").stat().st_size > 0
    assert [p["step"] for p in report["runs"][1]["probes"]] == [0, 100, 200]
