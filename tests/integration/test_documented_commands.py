"""Every command the project tells a user to run, run as written (a few steps).

The commands are read from where a user reads them: the ```bash blocks of README.md and docs/*.md, the usage lines
of the recipes' and the command line's docstrings, the `#` headers of recipes/configs/ and recipes/accelerate/, and
the commands `hf-rlhf chain` prints at its end. Each is run in this process through the code it names (the
recipe's `main()`, `hf_rlhf.cli.main`, `hf_rlhf.models.merge.main`; `accelerate launch`'s own options are parsed by
accelerate's parser, and one process is what it would start) with options appended that make it a few steps of the
tiny toy model, the outputs under a temporary folder and the toy SFT policy and reward model prebuilt there.

A command that needs the hub (a model or dataset id, a config that names one), a GPU (several processes) or a file
of the user's (`my_ppo.yaml`, `my/sft-model`) cannot run here: it is parsed exactly as the recipe parses it
(`parse_recipe_args`, accelerate's launch parser, merge's parser), which catches an unknown or renamed option, a
missing config file and a value of the wrong type, and stops before anything is loaded. The benchmarks (`bench/`,
their own smoke tests), the install lines and the test command are left out.
"""

import os
import re
import shlex

import pytest
import yaml

from hf_rlhf.cli import launch
from hf_rlhf.cli import main as cli
from hf_rlhf.cli.printing import NEXT_ON_A_REAL_MODEL

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIXES = ("python recipes/", "python -m hf_rlhf", "accelerate launch", "hf-rlhf", "torchrun")
# a few steps of the tiny toy model, per recipe
TINY = {
    "sft": ["--toy_train_size", "64", "--toy_test_size", "4", "--toy_model_size", "tiny", "--max_steps", "1",
            "--per_device_train_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true"],
    "reward": ["--toy_train_size", "32", "--toy_test_size", "16", "--toy_model_size", "tiny", "--max_steps", "1",
               "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16", "--logging_steps", "1",
               "--disable_tqdm", "true"],
    "ppo": ["--toy_train_size", "16", "--toy_test_size", "4", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "1", "--rollout_batch_size", "8", "--num_ppo_epochs", "1",
            "--logging_steps", "1", "--max_steps", "1", "--sample_prompts", "0", "--plot", "false",
            "--disable_tqdm", "true", "--build_missing", "false"],
    # TRL's names (recipes/grpo.py, rloo.py): one generation of 2 prompts x 2, evaluated and saved at its step
    "grpo": ["--toy_train_size", "16", "--toy_test_size", "4", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "1", "--steps_per_generation", "1", "--num_generations", "2",
             "--num_iterations", "1", "--max_steps", "1", "--logging_steps", "1", "--eval_steps", "1",
             "--save_steps", "1", "--per_device_eval_batch_size", "2", "--disable_tqdm", "true",
             "--build_missing", "false"],
    "dpo": ["--toy_train_size", "16", "--toy_test_size", "4", "--max_steps", "1", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true",
            "--build_missing", "false"],
    "kto": ["--toy_train_size", "16", "--toy_test_size", "4", "--max_steps", "1", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true",
            "--build_missing", "false"],
    "distill": ["--toy_train_size", "16", "--toy_test_size", "4", "--max_steps", "1", "--per_device_train_batch_size",
                "8", "--per_device_eval_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true",
                "--build_missing", "false"],
}


def _commands_in(text: str, comment: bool) -> list[str]:
    """Command lines (backslash continuations joined, trailing `# ...` dropped) in `text`."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        if comment:
            line = line.lstrip("#").strip()
        if line.startswith(PREFIXES):
            command = line
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip().lstrip("#" if comment else "").strip()
            out.append(re.sub(r"\s+#\s.*$", "", command).strip())
        i += 1
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command a user is told to run."""
    found = []
    docs = os.path.join(ROOT, "docs")
    pages = ["README.md", *(f"docs/{name}" for name in sorted(os.listdir(docs)) if name.endswith(".md"))]
    for page in pages:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            found += [(page, c) for c in _commands_in(block, comment=False)]
    import ast

    for rel in ("recipes/sft.py", "recipes/reward.py", "recipes/ppo.py", "recipes/dpo.py", "recipes/kto.py",
                "recipes/distill.py", "recipes/grpo.py", "recipes/rloo.py", "hf_rlhf/cli/main.py",
                "hf_rlhf/models/merge.py"):
        path = os.path.join(ROOT, rel)
        assert os.path.isfile(path), f"{rel} moved: name its new path here"  # a moved file must not go unread
        doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
        found += [(rel, c) for c in _commands_in(doc, comment=False)]
    for folder in ("recipes/configs", "recipes/accelerate"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".yaml"):
                text = open(os.path.join(ROOT, folder, name), encoding="utf-8").read()
                header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
                found += [(f"{folder}/{name}", c) for c in _commands_in(header, comment=True)]
                found += [(f"{folder}/{name}", c) for c in re.findall(r"`((?:python|accelerate launch|hf-rlhf) [^`]*)`",
                                                                       header)]
    found += [("hf-rlhf chain's closing note", c) for c in NEXT_ON_A_REAL_MODEL]
    unique = {}
    for where, command in found:
        unique.setdefault(command, where)
    return [(where, command) for command, where in unique.items()]


COMMANDS = documented_commands()


def test_the_commands_are_found():
    commands = [c for _, c in COMMANDS]
    for expected in ("hf-rlhf chain", "hf-rlhf sft", "python recipes/sft.py", "accelerate launch recipes/ppo.py",
                     "python recipes/ppo.py --config recipes/configs/grpo_toy.yaml",
                     "python recipes/ppo.py --config recipes/configs/tools_toy.yaml",
                     "python recipes/sft.py --config recipes/configs/sft_tools_toy.yaml", NEXT_ON_A_REAL_MODEL[-1]):
        assert expected in commands
    assert len(commands) >= 30


def resolve(command: str) -> tuple[str, str | None, list[str], list[str]]:
    """(kind, name, arguments, launch options) of a command: kind "recipe" (name: sft / reward / ppo / dpo / distill),
    "cli" (the `hf-rlhf` arguments), "merge"."""
    command = re.sub(r"\s*\[[^\]]*\]", "", command)  # optional parts, [--dtype float32]
    command = re.sub(r"\$[A-Z_]+", "0", command)  # $NODE_RANK, $MASTER_ADDR: the user's values
    tokens = [t for t in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", t)]  # OMP_NUM_THREADS=1 ...
    launch_args = []
    if tokens[:2] == ["accelerate", "launch"] or tokens[0] == "torchrun":
        arity = launch.launch_option_arity() if tokens[0] == "accelerate" else {"--nproc_per_node": 1}
        i = 2 if tokens[0] == "accelerate" else 1
        while tokens[i].startswith("--"):
            take = 0 if "=" in tokens[i] else arity[tokens[i].split("=")[0]]
            launch_args += tokens[i:i + 1 + take]
            i += 1 + take
        if tokens[i] == "-m":
            module, rest = tokens[i + 1], tokens[i + 2:]
            assert module == "hf_rlhf.cli", command
            return "cli", None, rest, launch_args
        tokens = ["python", *tokens[i:]]
    if tokens[:2] == ["hf-rlhf", "merge"]:
        return "merge", None, tokens[2:], launch_args
    if tokens[0] == "hf-rlhf":
        return "cli", None, tokens[1:], launch_args
    if tokens[:3] == ["python", "-m", "hf_rlhf.models.merge"]:
        return "merge", None, tokens[3:], launch_args
    if tokens[:3] == ["python", "-m", "hf_rlhf.cli"]:
        return "cli", None, tokens[3:], launch_args
    script = tokens[1]
    assert script.startswith("recipes/") and script.endswith(".py"), command
    return "recipe", script[len("recipes/"):-3], tokens[2:], launch_args


def needs_what_is_not_here(args: list[str], launch_args: list[str]) -> str | None:
    """Why the command cannot run here (hub, GPU, a file of the user's), or None."""
    text = " ".join(args)
    if re.search(r"\bmy[_/.]", text):
        return "a file of the user's"
    if "qwen" in text.lower() or re.search(r"--(model_name_or_path|dataset_name) (?!outputs/)", text):
        return "the hub"
    if launch_args:
        return "several processes"
    return None


class Parsed(Exception):
    """Raised in place of the run once the recipe has parsed its arguments."""


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """A tiny toy SFT policy and a tiny reward model on it, as outputs/sft and outputs/reward would hold them, and a
    tiny SFT policy of the toy tools task, as outputs/sft_tools would."""
    import torch

    from recipes import reward, sft

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("prebuilt")
    sft.main(["--config", os.path.join(ROOT, "recipes", "configs", "sft_toy.yaml"), *TINY["sft"],
              "--output_dir", str(base / "sft")])
    reward.main(["--config", os.path.join(ROOT, "recipes", "configs", "reward_toy.yaml"), *TINY["reward"],
                 "--sft_model_path", str(base / "sft"), "--output_dir", str(base / "reward")])
    sft.main(["--config", os.path.join(ROOT, "recipes", "configs", "sft_tools_toy.yaml"), *TINY["sft"],
              "--output_dir", str(base / "sft_tools")])
    torch.set_num_threads(threads)
    return {"sft": str(base / "sft"), "reward": str(base / "reward"), "sft_tools": str(base / "sft_tools")}


def is_tools_toy(args: list[str]) -> bool:
    """The command runs the toy tools task (its SFT policy is the tool-calling one)."""
    if "--toy_task" in args:
        return args[args.index("--toy_task") + 1] == "tools"
    config = args[args.index("--config") + 1] if "--config" in args else None
    if config is None or not os.path.isfile(os.path.join(ROOT, config)):
        return False
    return (yaml.safe_load(open(os.path.join(ROOT, config))) or {}).get("toy_task") == "tools"


def few_steps(name: str, args: list[str], out: str, prebuilt: dict) -> list[str]:
    """The options appended to a toy command: a few steps, outputs under `out`, the prebuilt models."""
    extra = [*TINY["grpo" if name == "rloo" else name], "--output_dir", out]
    if name in ("grpo", "rloo"):
        extra += ["--sft_model_path", prebuilt["sft"]]
    if name == "reward":
        extra += ["--sft_model_path", prebuilt["sft"]]
    if name in ("dpo", "kto"):
        extra += ["--sft_model_path", prebuilt["sft"]]
    if name == "distill":  # the tiny SFT policy as the (PPO) teacher and as the student's start
        extra += ["--ppo_model_path", prebuilt["sft"], "--student_model_path", prebuilt["sft"]]
    if name == "ppo":
        sft_model = prebuilt["sft_tools"] if is_tools_toy(args) else prebuilt["sft"]
        extra += ["--sft_model_path", sft_model, "--reward_model_path", prebuilt["reward"]]
        if "--num_generations" in args:  # one prompt's samples per rollout
            extra += ["--rollout_batch_size", args[args.index("--num_generations") + 1]]
    return extra


@pytest.mark.parametrize("where, command", COMMANDS, ids=[c for _, c in COMMANDS])
def test_documented_command_runs(where, command, tmp_path, monkeypatch, prebuilt, one_thread, capsys):
    monkeypatch.chdir(ROOT)
    for name in launch.LAUNCHED_ENV:
        monkeypatch.delenv(name, raising=False)
    kind, name, args, launch_args = resolve(command)
    if launch_args and command.startswith("accelerate"):
        from accelerate.commands.launch import launch_command_parser

        launch_command_parser().parse_args([*launch_args, "script.py"])  # accelerate's own options are valid
    # a file of the user's is an empty YAML file of the same name (the toy defaults), not a missing one
    for i, a in enumerate(args):
        if re.fullmatch(r"my[_\w]*\.yaml", a):
            (tmp_path / a).write_text("{}\n")
            args[i] = str(tmp_path / a)
    reason = needs_what_is_not_here(args, launch_args)
    out = str(tmp_path / "out")

    if kind == "merge":
        import hf_rlhf.models.merge

        merged = []
        monkeypatch.setattr(hf_rlhf.models.merge, "merge_adapter", lambda *a: merged.append(a))
        hf_rlhf.models.merge.main(args)
        assert merged and merged[0][:2] == (args[args.index("--adapter") + 1], args[args.index("--output") + 1])
        return

    if kind == "cli":
        command_name = args[0] if args else None
        training = ("sft", "reward", "ppo", "dpo", "kto", "distill", "grpo", "rloo", "chain")
        if command_name in training and "--help" not in args:
            recipe_name = cli.COMMANDS[command_name][0]
            launched = []
            monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda a: launched.append(a))
            if reason:
                _parse_only(monkeypatch, recipe_name, lambda: cli.main(args), launched)
                return
            assert cli.main([*args, *few_steps(recipe_name, args, out, prebuilt)]) == 0
            assert not launched and os.path.isfile(os.path.join(out, "results.json"))
            return
        assert cli.main(args) == 0  # env, --help, merge (run above as merge)
        return

    from hf_rlhf.cli.recipes import load_recipe

    module = load_recipe(name)
    if reason:
        _parse_only(monkeypatch, name, lambda: module.main(args))
        return
    results = module.main([*args, *few_steps(name, args, out, prebuilt)])
    assert results.get("after", results.get("train")) and os.path.isfile(os.path.join(out, "results.json"))


def _parse_only(monkeypatch, recipe_name: str, run, launched=None) -> None:
    """Run until the recipe has parsed its arguments (as it would), then stop; or until the launch is handed over."""
    from hf_rlhf.cli.arguments import parse_recipe_args
    from hf_rlhf.cli.recipes import load_recipe

    module = load_recipe(recipe_name)

    def parse_then_stop(types, argv, toy_config):
        raise Parsed(parse_recipe_args(types, argv, toy_config))

    monkeypatch.setattr(module, "parse_recipe_args", parse_then_stop)
    try:
        status = run()
    except Parsed as parsed:
        assert parsed.args[0], "nothing parsed"
        return
    assert status == 0 and launched, "the command neither parsed its options nor launched"
    # the launched process would run the recipe on the rest: parse that too
    rest = launched[0].training_script_args[1:]
    with pytest.raises(Parsed):
        module.main(rest)


def test_a_wrong_option_in_a_documented_command_would_fail(monkeypatch):
    """The check has teeth: a misspelt option in a command that cannot run here is still refused."""
    monkeypatch.chdir(ROOT)
    from recipes import sft

    with pytest.raises(Exception, match="did you mean --lora_r"):
        _parse_only(monkeypatch, "sft", lambda: sft.main(["--config", "recipes/configs/sft_qwen_lora.yaml",
                                                          "--lora_rr", "8"]))
