"""Run TRL's own SFT, reward, DPO, KTO, GRPO, RLOO and distillation test modules against trl and against hf_rlhf
(issues 20, 42, 43).

    git -C <trl mirror> archive HEAD tests scripts | tar -x -C /tmp/trl-src
    PYTHONPATH=. python tests/compat/trl_tests/run_trl_tests.py --trl-tests /tmp/trl-src

Copies ``tests/test_sft_trainer.py``, ``tests/test_reward_trainer.py``, ``tests/test_dpo_trainer.py``,
``tests/test_kto_trainer.py`` and the helpers they import into a temp package twice: once as they are, once with only
the ``from trl import SFTConfig, SFTTrainer`` / ``RewardConfig, RewardTrainer`` / ``DPOConfig, DPOTrainer`` /
``KTOConfig, KTOTrainer`` lines rewritten to ``from hf_rlhf import ...``.  Each
copy runs in a pytest subprocess with ``trl_offline_plugin`` (offline tiny models, zen datasets, n/a skips,
per-test timeout).  Prints per module: collected, not applicable, passed on trl, passed on hf_rlhf, the deliberate
differences (``DELIBERATE``) and the other tests that pass on trl but fail on hf_rlhf, grouped by their first error
line; exits 1 when there is any of those.  TRL's files are never copied into this repository.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # this checkout: the hf_rlhf copies import it, whatever PYTHONPATH the runner was given
MODULES = ["test_sft_trainer.py", "test_reward_trainer.py", "test_dpo_trainer.py", "test_kto_trainer.py",
           "test_grpo_trainer.py", "test_rloo_trainer.py", "experimental/test_distillation_trainer.py"]
# TRL tests that fail on hf_rlhf on purpose (docs/trl_compatibility.md), each with its own test in
# tests/integration/test_trl_preparation.py (KTO's: tests/integration/test_kto_trainer.py)
DELIBERATE = {
    "test_sft_trainer.py::TestSFTTrainer::test_padding_free_without_packing_and_max_length_raises":
        "padding_free without packing keeps max_length (rows cut when prepared); TRL refuses the pair",
    "test_sft_trainer.py::TestSFTTrainer::test_skip_prepare_dataset_with_masks_but_no_labels_raises":
        "skip_prepare_dataset rows with masks and no labels train on the masked tokens; TRL refuses them",
    "test_dpo_trainer.py::TestDPOTrainer::test_evaluate_precompute_ref_log_probs_after_training_raises":
        "evaluate(new rows) after training with precompute_ref_log_probs takes the kept reference's log-probs; "
        "TRL keeps no reference and refuses",
    "test_kto_trainer.py::TestKTOTrainer::test_evaluate_precompute_ref_log_probs_after_training_raises":
        "as DPO's: evaluate(new rows) after training with precompute_ref_log_probs takes the kept reference's "
        "log-probs; TRL keeps no reference and refuses",
    # TRL internals: these call private methods of TRL's GRPOTrainer (its rollout and forward helpers), which
    # hf_rlhf's GRPOTrainer, built on PPO's loop, does not have
    "test_grpo_trainer.py::TestGRPORolloutDispatch::test_generate_rollout_func_raises_when_required_keys_are_missing":
        "calls TRL's private GRPOTrainer._generate; hf_rlhf's rollout_func_sample checks the same keys",
    "test_grpo_trainer.py::TestGRPOTrainer::test_prepare_input_called_with_correct_data":
        "steps_per_generation=4 with gradient_accumulation_steps=3 (a rollout straddling optimizer steps) is refused "
        "by name; the test then reads the prompt dicts TRL hands to training_step, Experience rows here",
    "test_rloo_trainer.py::TestRLOOTrainer::test_prepare_input_called_with_correct_data":
        "as GRPO's: steps_per_generation=4 with gradient_accumulation_steps=3 is refused by name; the test then "
        "reads the prompt dicts TRL hands to training_step, Experience rows here",
    "test_grpo_trainer.py::TestGRPOTrainer::test_entropy_bonus_flows_gradients":
        "calls TRL's private _get_per_token_logps_and_entropies; the bonus's gradient is in compute_loss here",
}
HELPERS = ["__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py"]
REWRITES = {
    "from trl import SFTConfig, SFTTrainer": "from hf_rlhf import SFTConfig, SFTTrainer",
    "from trl import RewardConfig, RewardTrainer": "from hf_rlhf import RewardConfig, RewardTrainer",
    "from trl import DPOConfig, DPOTrainer": "from hf_rlhf import DPOConfig, DPOTrainer",
    "from trl import KTOConfig, KTOTrainer": "from hf_rlhf import KTOConfig, KTOTrainer",
    "from trl.experimental.distillation import DistillationConfig, DistillationTrainer":
        "from hf_rlhf import DistillationConfig, DistillationTrainer",
    "from trl import GRPOConfig, GRPOTrainer": "from hf_rlhf import GRPOConfig, GRPOTrainer",
    "from trl import RLOOConfig, RLOOTrainer": "from hf_rlhf import RLOOConfig, RLOOTrainer",
}


def prepare(trl_tests, dest, target, modules):
    pkg = dest / "trl_tests"  # not "tests": hf_rlhf has a tests package on the path too
    pkg.mkdir(parents=True)
    for name in modules + HELPERS:
        text = (trl_tests / name).read_text()
        if target == "hf_rlhf" and name in modules:
            hits = [line for line in REWRITES if line in text]
            assert hits, f"no trainer import line found in {name}"
            for line in hits:
                text = text.replace(line, REWRITES[line])
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
        if (pkg / name).parent != pkg:
            (pkg / name).parent.joinpath("__init__.py").touch()
    shutil.copytree(trl_tests / "data", pkg / "data")  # chat templates etc. for the lazy_shared_datadir fixture
    return pkg


def run_pytest(pkg, module, junit, timeout, extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_CACHE=str(Path(os.environ["TRL_OFFLINE_CACHE"]) / "hub"), TRL_TEST_TIMEOUT=str(timeout),
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", WANDB_DISABLED="true")
    cmd = [sys.executable, "-m", "pytest", str(pkg / module), "-p", "trl_offline_plugin", "-p", "no:cacheprovider",
           "-v", "-rN", "--tb=line", f"--junitxml={junit}", f"--rootdir={pkg.parent}", *extra]
    log = open(Path(junit).with_suffix(".log"), "w")  # noqa: SIM115 -- lives as long as the subprocess
    return subprocess.Popen(cmd, cwd=pkg.parent, env=env, stdout=log, stderr=subprocess.STDOUT)


def parse(junit):
    """test name -> ("passed" | "skipped" | "failed", first error line, skip reason)"""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("classname").rsplit(".", 1)[-1] + "::" + case.get("name")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            results[name] = ("failed", message[0][:160] if message else "?")
        elif skip is not None:
            results[name] = ("skipped", skip.get("message", ""))
        else:
            results[name] = ("passed", "")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-tests", required=True, type=Path,
                        help="a TRL source tree (holding tests/ and scripts/generate_zen_dataset.py)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    parser.add_argument("--cache", default=os.environ.get("TRL_OFFLINE_CACHE", "/tmp/hf_rlhf_trl_offline"))
    parser.add_argument("--modules", nargs="*", default=MODULES)
    parser.add_argument("--workdir", type=Path, help="keep the copies, junit files and pytest logs here "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the trl and hf_rlhf targets one after the other (default: side by side)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k train")
    args = parser.parse_args(argv)
    os.environ["TRL_OFFLINE_CACHE"] = args.cache
    sys.path.insert(0, str(HERE))
    import trl_offline_plugin

    trl_offline_plugin.build_cache(args.trl_tests / "scripts")
    rows, lost, deliberate = [], collections.defaultdict(list), []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.workdir:
            shutil.rmtree(args.workdir, ignore_errors=True)
            tmp = args.workdir
        print(f"pytest logs: {tmp}/<target>-<module>.log", flush=True)
        pkgs = {t: prepare(args.trl_tests / "tests", tmp / t, t, args.modules) for t in ("trl", "hf_rlhf")}
        for module in args.modules:
            junits = {t: tmp / f"{t}-{module.replace('/', '-')}.xml" for t in pkgs}  # both targets side by side
            procs = []
            for t, pkg in pkgs.items():
                procs.append(run_pytest(pkg, module, junits[t], args.timeout, args.pytest_args))
                if args.sequential:
                    procs[-1].wait()
            for proc in procs:
                proc.wait()
            res = {t: parse(junit) for t, junit in junits.items()}
            trl, ours = res["trl"], res["hf_rlhf"]
            na = sorted(n for n, r in trl.items() if r[0] == "skipped")
            na_ours = sorted(n for n, r in ours.items() if r[0] == "skipped")
            reasons = collections.Counter(re.sub(r"\[.*|ForConditionalGeneration.*|, .*", "", trl[n][1]) for n in na)
            print(f"{module}: n/a by reason: " + "; ".join(f"{c} x {r}" for r, c in reasons.most_common()))
            if na != na_ours:
                print(f"warning: {module}: skipped sets differ: {sorted(set(na) ^ set(na_ours))}")
            passed = [n for n, r in trl.items() if r[0] == "passed"]
            ok = [n for n in passed if ours.get(n, ("?",))[0] == "passed"]
            differ = [n for n in passed if ours.get(n, ("?",))[0] != "passed" and f"{module}::{n}" in DELIBERATE]
            rows.append((module, len(trl), len(na), len(passed), len(ok), len(differ)))
            for n in passed:
                if ours.get(n, ("?",))[0] != "passed":
                    if f"{module}::{n}" in DELIBERATE:
                        deliberate.append(f"{module}::{n}: {DELIBERATE[f'{module}::{n}']}")
                    else:
                        lost[ours.get(n, ("missing", "not run"))[1]].append(f"{module}::{n}")
            for n, r in trl.items():
                if r[0] == "failed":
                    print(f"fails on trl too: {module}::{n}: {r[1]}")
    print()
    print("| module | TRL tests collected | n/a here | pass on trl | pass on hf_rlhf (of those) | deliberate differences |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print()
    print("Deliberate differences (pass on trl, not on hf_rlhf, on purpose):")
    for line in deliberate:
        print(f"- {line}")
    print()
    print("Pass on trl, not on hf_rlhf, grouped by first error line:")
    for cause, names in sorted(lost.items(), key=lambda kv: -len(kv[1])):
        print(f"- {len(names)} x {cause}")
        for n in names:
            print(f"    {n}")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
