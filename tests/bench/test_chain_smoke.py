"""bench/chain.py: the default toy chain at two commits. Its ratio arithmetic and its refusal of an unknown commit
run in the README's test command; a whole (tiny) chain at HEAD twice is the slow tier (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "chain.py"


@pytest.fixture
def chain_bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import chain

        yield chain
    finally:
        sys.path.remove(str(BENCH.parent))
        sys.modules.pop("chain", None)


def test_ratios_are_baseline_seconds_over_candidate_seconds_per_round(chain_bench):
    def run(r, side, seconds, sft, ppo, after):
        return {"round": r, "side": side, "seconds": seconds, "cpu_seconds": 2 * seconds,
                "timings": {"sft_s": sft, "ppo_s": ppo}, "before": 0.25, "after": after}

    runs = [run(0, "baseline", 400.0, 200.0, 180.0, 0.50), run(0, "candidate", 200.0, 150.0, 45.0, 0.55),
            run(1, "baseline", 450.0, 220.0, 210.0, 0.50), run(1, "candidate", 300.0, 170.0, 120.0, 0.60)]
    summary = chain_bench.summarize(runs, repeats=2)
    assert summary["ratios"] == [2.0, 1.5]
    assert summary["median_ratio"] == 1.75
    assert summary["ppo_stage_ratios"] == [4.0, 1.75]
    assert summary["cpu_ratios"] == [2.0, 1.5] and summary["candidate"]["median_cpu_seconds"] == 500.0
    assert summary["baseline"]["median_seconds"] == 425.0 and summary["candidate"]["median_seconds"] == 250.0
    assert summary["candidate"]["median_sft_s"] == 160.0 and summary["baseline"]["median_ppo_s"] == 195.0
    assert summary["candidate"]["after"] == [0.55, 0.60]
    table = chain_bench.table(summary, {"baseline": "a" * 40, "candidate": "b" * 40})
    assert "**1.75×** (2.00, 1.50)" in table and "| baseline aaaaaaa | 425.0 s | 850 s | 210 s | 195 s |" in table
    assert "in CPU seconds 2.00, 1.50 (median 1.75×)" in chain_bench.ratio_note(summary)


def test_an_unknown_commit_is_refused_before_any_run(tmp_path):
    output = tmp_path / "chain.json"
    done = subprocess.run([sys.executable, str(BENCH), "--baseline", "no-such-commit", "--output", str(output)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0
    assert "'no-such-commit' is not a commit" in done.stderr
    assert not output.exists()


@pytest.mark.slow
def test_the_same_commit_twice_trains_the_same_models(tmp_path):
    """HEAD against HEAD, a tiny chain (two ~40 s runs): the report holds both runs, the same SFT and PPO bytes."""
    with open(ROOT / "recipes" / "configs" / "sft_toy.yaml") as f:
        sft = yaml.safe_load(f)
    sft.update(toy_model_size="tiny", toy_train_size=64, toy_test_size=4, max_steps=2, logging_steps=1,
               per_device_train_batch_size=8, disable_tqdm=True)
    sft_config = tmp_path / "sft_tiny.yaml"
    sft_config.write_text(yaml.safe_dump(sft))
    chain_args = (f"--sft_config {sft_config} --toy_train_size 16 --toy_test_size 4 --per_device_train_batch_size 8 "
                  "--gradient_accumulation_steps 1 --rollout_batch_size 8 --num_ppo_epochs 1 --logging_steps 1 "
                  "--max_steps 1 --sample_prompts 0 --plot false --disable_tqdm true")
    output = tmp_path / "chain.json"
    done = subprocess.run([sys.executable, str(BENCH), "--baseline", "HEAD", "--candidate", "HEAD", "--repeats", "1",
                           "--chain_args", chain_args, "--workdir", str(tmp_path / "trees"), "--output", str(output)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert [(run["side"], run["round"]) for run in report["runs"]] == [("baseline", 0), ("candidate", 0)]
    first, second = report["runs"]
    assert first["commit"] == second["commit"] == report["baseline"] == report["candidate"]
    assert first["sft_md5"] == second["sft_md5"] is not None and report["same_sft_weights"] is True
    assert first["ppo_md5"] == second["ppo_md5"] is not None
    for run in report["runs"]:
        assert run["seconds"] > 0 and run["cpu_seconds"] > 0 and 0.0 <= run["after"] <= 1.0
        assert {"sft_s", "ppo_s"} <= set(run["timings"])
    assert not (tmp_path / "trees" / "baseline_r0").exists()  # trees are removed unless --keep
    assert report["machine"]["cpu"] and report["machine"]["torch_cpu_capability"]
    assert "| commit | median end to end |" in done.stdout
