"""The end of a recipe's run: results.json (written atomically); after a non-finite stop, results.json saying so and a
non-zero exit; after a SIGTERM stop (`hf_rlhf.training.preemption`), results.json saying so and exit 0."""

from __future__ import annotations

import json
import os
import tempfile


def nonfinite_stop_of(trainer, metrics: dict) -> dict | None:
    """The run's non-finite stop (`trainer.nonfinite_stop`, or a `NonFiniteStopCallback`'s), or None."""
    if "nonfinite_stop_step" not in metrics:
        return None
    if trainer.nonfinite_stop is not None:
        return dict(trainer.nonfinite_stop)
    from ..callbacks import NonFiniteStopCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, NonFiniteStopCallback) and cb.stopped is not None:
            return {**cb.stopped, "message": f"training stopped at step {cb.stopped['step']}: "
                                             f"{cb.stopped['metric']} = {cb.stopped['value']} was logged"}
    return {"step": metrics["nonfinite_stop_step"], "message": f"training stopped at step "
                                                                f"{metrics['nonfinite_stop_step']}: a non-finite value"}


def exit_after_nonfinite_stop(trainer, output_dir: str, metrics: dict, results: dict) -> None:
    """After a non-finite stop: write results.json saying so (no model saved, none evaluated) and exit non-zero.

    Returns only when the run did not stop on a non-finite value.

    Raises:
        SystemExit: with the stop's message (step, value, last good checkpoint); the exit status is 1.
    """
    stop = nonfinite_stop_of(trainer, metrics)
    if stop is None:
        return
    if trainer.is_world_process_zero():
        write_results(output_dir, {**results, "train": metrics, "stopped": stop})
    raise SystemExit(f"[hf_rlhf] {stop['message']}. No model was saved or evaluated; results: "
                     f"{os.path.join(output_dir, 'results.json')}")


def exit_after_stop(trainer, output_dir: str, metrics: dict, results: dict) -> None:
    """After a SIGTERM stop or a non-finite stop: results.json saying so, nothing saved or evaluated, and an exit.

    Returns only when training ran to its end.

    Raises:
        SystemExit: 0 after a SIGTERM stop (its checkpoint is written: the scheduler's grace period is not spent on
            a final save and evaluation; `--resume_from_checkpoint latest` goes on from it), 1 after a non-finite
            stop (`exit_after_nonfinite_stop`).
    """
    preempted = getattr(trainer, "preempted", None)
    if preempted is not None:
        if trainer.is_world_process_zero():
            write_results(output_dir, {**results, "train": metrics, "preempted": preempted})
            print(f"[hf_rlhf] {preempted['signal']}: stopped at step {preempted['step']} with checkpoint "
                  f"{preempted['checkpoint']} ({preempted['seconds_after_signal']} s after the signal); no model "
                  "was saved or evaluated; go on with --resume_from_checkpoint latest", flush=True)
        from .errors import close_process_group

        close_process_group()  # every rank stopped at the same step (the flag is all-reduced) and gets here
        raise SystemExit(0)
    exit_after_nonfinite_stop(trainer, output_dir, metrics, results)


def write_results(output_dir: str, results: dict) -> str:
    """Write `<output_dir>/results.json` atomically (a crash leaves the old file or none)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "results.json")
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".json", dir=output_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(results, f, indent=2, default=float)
    os.replace(tmp, path)
    return path
