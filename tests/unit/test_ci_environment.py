"""CI runs the README's test command as a user runs it (issue 45): in a clean environment (`env -i`) with nothing
of its own that a user would not have (HF_HUB_OFFLINE and the like), since the suite sets what it needs itself
(tests/conftest.py): offline hub and datasets, no telemetry, no tokenizers thread pool, for its own processes too."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CI = os.path.join(ROOT, ".ci", "run")
# what a user would not have set: CI may not set it, for the test command or before it
NOT_A_USERS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
               "HF_HUB_DISABLE_TELEMETRY", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "PYTHONPATH")
# what the clean environment may hold: the shell's own and the caches that only make CI faster
CLEAN_ENV = {"PATH", "HOME", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR"}


def script() -> str:
    """.ci/run without its comments."""
    with open(CI) as f:
        return "\n".join(line for line in f.read().splitlines() if not line.lstrip().startswith("#"))


def test_ci_sets_nothing_a_user_would_not_have():
    code = script()
    for name in NOT_A_USERS:
        assert not re.search(rf"\b{name}=", code), f".ci/run sets {name}: the suite sets it itself (tests/conftest.py)"


def test_ci_runs_the_readme_command_under_env_i():
    code = script()
    runs = [line for line in code.splitlines() if re.search(r'bash -c "\$test_cmd"', line)]
    assert len(runs) == 1, runs
    # a bash array named on the line ("${clean_env[@]}") stands for its definition
    arrays = {m.group(1): m.group(2) for m in re.finditer(r"^(\w+)=\((.*?)\)$", code, re.S | re.M)}
    command = re.sub(r'"\$\{(\w+)\[@\]\}"', lambda m: arrays[m.group(1)], runs[0])
    assert re.match(r"\s*env -i\s", command), f"the README's command does not run under env -i: {runs[0]}"
    passed = set(re.findall(r"\b([A-Z_]+)=", command.split('bash -c "$test_cmd"')[0]))
    assert passed <= CLEAN_ENV, f"the clean environment passes {sorted(passed - CLEAN_ENV)}"


def test_the_suite_sets_its_environment_itself():
    from huggingface_hub import constants

    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert constants.HF_HUB_OFFLINE
    # a process a test starts inherits it (a recipe, accelerate launch and its ranks)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('HF_HUB_OFFLINE'))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "1"
