"""What every benchmark here shares: one subprocess per run, and the JSON report with the machine it ran on.

The benchmarks run as scripts (`python bench/<name>.py`), so they import this module as `harness`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def run_worker(script: str, args: list[str], extra_pythonpath: str | None = None) -> dict:
    """Run `python <script> <args>` in a fresh process and return the JSON object on its last stdout line.

    Args:
        extra_pythonpath: a directory put first on the worker's PYTHONPATH (a side-installed reference library).

    Raises:
        RuntimeError: the worker failed; the message ends with its stderr.
    """
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_pythonpath, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def training_kwargs(settings: dict, output_dir: str) -> dict:
    """TrainingArguments both libraries get in the SFT and reward benchmarks: one epoch at a constant 1e-3 with
    AdamW, fp32 on the CPU, fixed seeds and data order, no logging, saving, worker processes or pinned memory.

    Args:
        settings: with "batch_size", "epochs" and "max_length".
    """
    return dict(
        output_dir=output_dir, per_device_train_batch_size=settings["batch_size"], num_train_epochs=settings["epochs"],
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        max_length=settings["max_length"], logging_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, data_seed=0, use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, dataloader_pin_memory=False,
    )


def versions(packages: tuple[str, ...], **fixed: str) -> dict:
    """Installed versions of `packages` (None when missing), after the `fixed` entries."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict = dict(fixed)
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def write_report(path: str, report: dict, versions: dict) -> None:
    """Write `report` plus the machine (cores, platform, Python, `versions`) as JSON to `path`, and say where."""
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "versions": versions}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**report, "machine": machine}, indent=2) + "\n")
    print(f"wrote {path}")


def finish(output: str, command: str, report: dict, packages: tuple[str, ...], sections: dict[str, str] | None = None,
           **fixed_versions: str) -> None:
    """Print the benchmark's table, notes and extra `sections` (title -> markdown) and how to reproduce it, then
    write `report` (which holds "table" and "notes") with the command and the machine to `output`."""
    sections = sections or {}
    print("\n" + report["table"] + "\n\n" + "\n".join(f"- {n}" for n in report["notes"])
          + "".join(f"\n\n{title}:\n\n{text}" for title, text in sections.items())
          + f"\n\nReproduce: `{command}`")
    write_report(output, {"command": command, **report}, versions(packages, **fixed_versions))
