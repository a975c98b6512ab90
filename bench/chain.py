"""The default toy chain end to end at two commits of this repository, interleaved: issue 18's target "the default
toy chain (`accelerate launch recipes/ppo.py`) at least 1.5x faster end to end than today with the same result or
better", where "today" is 97ec1b7, the commit the fast-rollouts work started from.

    python bench/chain.py                                   # 97ec1b7 against HEAD, 2 rounds (~25 min here)
    python bench/chain.py --baseline 97ec1b7 --candidate HEAD --repeats 3 --output /tmp/chain.json

Every run is a subprocess on a clean tree of its commit (`git archive`: no outputs, no uncommitted changes), with
that tree first on PYTHONPATH so the commit's own hf_rlhf runs, not the installed one: `accelerate launch
recipes/ppo.py [--chain_args]` exactly as a user types it, which builds the SFT policy and then runs PPO. Rounds are
interleaved (baseline, candidate, baseline, candidate ...), one run at a time: two 2-thread torch jobs side by side
on a 2-core machine slow each other down many times over. Reported per run: wall seconds from launch to exit, the
recipe's own stage timings (`sft_s`, `ppo_s`, `eval_s` of results.json), held-out greedy exact match before and
after PPO, and the md5 of the SFT and PPO weights: identical SFT bytes at both commits mean the same SFT policy,
identical PPO bytes across rounds a deterministic run. The floats, and so the models, depend on the kernels torch
picks for the CPU (two machines here trained different SFT policies from the same seed), so compare commits on one
machine: the JSON names its CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import finish

ROOT = Path(__file__).resolve().parents[1]
START_OF_FAST_ROLLOUTS = "97ec1b7"


def resolve_commit(name: str) -> str:
    """The full sha of `name` (a sha, tag, branch or HEAD) in this repository.

    Raises:
        SystemExit: not a commit here (a shallow clone lacks old commits: `git fetch --unshallow`).
    """
    done = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench/chain.py: {name!r} is not a commit of {ROOT} (a shallow clone lacks old commits: "
                         "`git fetch --unshallow`)")
    return done.stdout.strip()


def export_tree(sha: str, directory: Path) -> Path:
    """The files of commit `sha` written to `directory` (created), as `git archive` gives them."""
    directory.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    return directory


def md5(path: Path) -> str | None:
    """The md5 of the file at `path`, None when it is missing."""
    if not path.is_file():
        return None
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (and theirs, once waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_chain(label: str, sha: str, chain_args: list[str], workdir: Path, timeout: float, keep: bool) -> dict:
    """One default chain at commit `sha` in a fresh tree under `workdir`; what it took and what it wrote.

    Raises:
        RuntimeError: the chain failed or ran past `timeout` seconds; the message ends with its output's tail.
    """
    tree = export_tree(sha, workdir / label)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "accelerate.commands.launch", "recipes/ppo.py", *chain_args]
    log_path = workdir / f"{label}.log"
    load_before = os.getloadavg()[0]
    cpu_start = children_cpu_seconds()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    seconds = time.perf_counter() - start
    cpu_seconds = children_cpu_seconds() - cpu_start
    tail = log_path.read_text(errors="replace")[-4000:]
    if returncode != 0:
        why = f"ran past {timeout:.0f} s" if returncode is None else f"exited {returncode}"
        raise RuntimeError(f"chain {label} ({sha[:7]}) {why} (its tree and log are kept in {workdir}); its output "
                           f"ends:\n{tail}")
    results = json.loads((tree / "outputs" / "ppo" / "results.json").read_text())
    run = {
        "label": label, "commit": sha, "seconds": seconds, "cpu_seconds": cpu_seconds, "load_before": load_before,
        "load_after": os.getloadavg()[0], "timings": results.get("timings", {}),
        "before": results["before"].get("exact_match"), "after": results["after"].get("exact_match"),
        "sft_md5": md5(tree / "outputs" / "sft" / "model.safetensors"),
        "ppo_md5": md5(tree / "outputs" / "ppo" / "model.safetensors"),
    }
    if not keep:
        shutil.rmtree(tree)
    return run


def summarize(runs: list[dict], repeats: int) -> dict:
    """Medians per side and the per-round ratios baseline seconds / candidate seconds (> 1: the candidate is faster).

    Args:
        runs: with "round", "side" ("baseline" or "candidate"), "seconds", "cpu_seconds", "timings", "before",
            "after" (`run_chain`'s, plus the first two).
    """
    by = {(run["round"], run["side"]): run for run in runs}
    summary = {}
    for side in ("baseline", "candidate"):
        mine = [by[r, side] for r in range(repeats)]
        entry = {"seconds": [run["seconds"] for run in mine],
                 "median_seconds": statistics.median(run["seconds"] for run in mine),
                 "median_cpu_seconds": statistics.median(run["cpu_seconds"] for run in mine),
                 "after": [run["after"] for run in mine], "before": [run["before"] for run in mine]}
        for stage in ("sft_s", "ppo_s"):
            values = [run["timings"][stage] for run in mine if stage in run["timings"]]
            if values:
                entry[f"median_{stage}"] = statistics.median(values)
        summary[side] = entry
    ratios = [by[r, "baseline"]["seconds"] / by[r, "candidate"]["seconds"] for r in range(repeats)]
    summary["ratios"] = ratios
    summary["median_ratio"] = statistics.median(ratios)
    # CPU seconds move far less with the shared machine's load than wall time
    cpu = [by[r, "baseline"]["cpu_seconds"] / by[r, "candidate"]["cpu_seconds"] for r in range(repeats)]
    summary["cpu_ratios"] = cpu
    summary["median_cpu_ratio"] = statistics.median(cpu)
    stage_ratios = [by[r, "baseline"]["timings"]["ppo_s"] / by[r, "candidate"]["timings"]["ppo_s"]
                    for r in range(repeats) if all("ppo_s" in by[r, s]["timings"] for s in ("baseline", "candidate"))]
    if stage_ratios:
        summary["ppo_stage_ratios"] = stage_ratios
    return summary


def listed(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def ratio_note(summary: dict) -> str:
    """The per-round ratios in wall time, CPU time and the PPO stage's time, as a sentence."""
    text = (f"Per-round end-to-end ratios {listed(summary['ratios'])} (median {summary['median_ratio']:.2f}×); "
            f"in CPU seconds {listed(summary['cpu_ratios'])} (median {summary['median_cpu_ratio']:.2f}×)")
    if "ppo_stage_ratios" in summary:
        text += f"; the PPO stage alone {listed(summary['ppo_stage_ratios'])}"
    return text + "."


def table(summary: dict, shas: dict) -> str:
    lines = ["| commit | median end to end | CPU seconds | SFT stage | PPO stage | exact match before → after PPO "
             "(per round) | end-to-end ratio (per round) |", "|---|---:|---:|---:|---:|---|---:|"]
    for side in ("baseline", "candidate"):
        entry = summary[side]
        stage = {k: f"{entry[f'median_{k}']:.0f} s" if f"median_{k}" in entry else "–" for k in ("sft_s", "ppo_s")}
        results = ", ".join(f"{b} → {a}" for b, a in zip(entry["before"], entry["after"]))
        ratio = "1.00×" if side == "baseline" else (
            f"**{summary['median_ratio']:.2f}×** ({listed(summary['ratios'])})")
        lines.append(f"| {side} {shas[side][:7]} | {entry['median_seconds']:.1f} s | {entry['median_cpu_seconds']:.0f} "
                     f"s | {stage['sft_s']} | {stage['ppo_s']} | {results} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=START_OF_FAST_ROLLOUTS,
                        help=f"commit of 'today' (default {START_OF_FAST_ROLLOUTS}, where the fast-rollouts work "
                             "started)")
    parser.add_argument("--candidate", default="HEAD", help="commit measured against it (default HEAD; uncommitted "
                                                            "changes are not part of it)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--chain_args", default="", help="options added to `accelerate launch recipes/ppo.py` at both "
                                                         "commits, one shell-quoted string (default none: the default "
                                                         "chain)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one chain may run (default 3600)")
    parser.add_argument("--workdir", help="where the trees are written (default a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep every tree and its outputs (default: removed)")
    parser.add_argument("--output", default="bench/results/chain.json", help="JSON results path")
    cli = parser.parse_args(argv)
    if cli.repeats < 1:
        parser.error("--repeats must be at least 1")
    shas = {"baseline": resolve_commit(cli.baseline), "candidate": resolve_commit(cli.candidate)}
    chain_args = shlex.split(cli.chain_args)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    if dirty and cli.candidate == "HEAD":
        print("bench/chain.py: the working tree has uncommitted changes; they are not measured (HEAD is)", flush=True)
    workdir = Path(cli.workdir) if cli.workdir else Path(tempfile.mkdtemp(prefix="hf_rlhf_chain_"))
    workdir.mkdir(parents=True, exist_ok=True)

    runs = []
    for r in range(cli.repeats):
        for side in ("baseline", "candidate"):
            run = {"round": r, "side": side,
                   **run_chain(f"{side}_r{r}", shas[side], chain_args, workdir, cli.timeout, cli.keep)}
            runs.append(run)
            t = run["timings"]
            print(f"round {r + 1}/{cli.repeats} {side:>9} {shas[side][:7]}: {run['seconds']:7.1f} s "
                  f"(SFT {t.get('sft_s', '–')} s, PPO {t.get('ppo_s', '–')} s), exact match {run['before']} -> "
                  f"{run['after']}, SFT md5 {str(run['sft_md5'])[:8]}, PPO md5 {str(run['ppo_md5'])[:8]}, "
                  f"load {run['load_before']:.1f}", flush=True)
    if not cli.keep and not cli.workdir:
        shutil.rmtree(workdir, ignore_errors=True)

    summary = summarize(runs, cli.repeats)
    sft_same = len({run["sft_md5"] for run in runs}) == 1
    ppo_same = {side: len({run["ppo_md5"] for run in runs if run["side"] == side}) == 1
                for side in ("baseline", "candidate")}
    after = {side: statistics.median(summary[side]["after"]) for side in ("baseline", "candidate")}
    notes = [
        f"`{shlex.join(['accelerate', 'launch', 'recipes/ppo.py', *chain_args])}` in a clean tree of each commit "
        "(git archive), one run at a time, rounds interleaved; wall time from launch to exit.",
        ratio_note(summary),
        ("The same SFT weights in every run (md5 identical at both commits)" if sft_same else
         "The SFT weights differ between runs (md5): the two commits did not train the same SFT policy")
        + "; PPO weights identical across rounds: "
        + ", ".join(f"{side} {'yes' if same else 'no'}" for side, same in ppo_same.items()) + ".",
        f"Median held-out exact match after PPO: baseline {after['baseline']}, candidate {after['candidate']} "
        f"({'the same or better' if after['candidate'] >= after['baseline'] else 'lower'}).",
        f"Load average {min(r['load_before'] for r in runs):.1f}–{max(r['load_before'] for r in runs):.1f} "
        f"on {os.cpu_count()} cores.",
    ]
    argv_text = shlex.join(argv if argv is not None else sys.argv[1:])
    finish(cli.output, f"python bench/chain.py {argv_text}".strip(),
           {"baseline": shas["baseline"], "candidate": shas["candidate"], "chain_args": chain_args,
            "summary": summary, "same_sft_weights": sft_same, "ppo_weights_repeat": ppo_same,
            "table": table(summary, shas), "notes": notes, "runs": runs},
           ("torch", "transformers", "trl", "accelerate"))


if __name__ == "__main__":
    main()
