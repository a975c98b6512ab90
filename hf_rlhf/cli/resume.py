"""`--resume_from_checkpoint` as the recipes take it, and a run's metrics over the whole run when resumed."""

from __future__ import annotations

import os


def resume_argument(value) -> str | None:
    """`--resume_from_checkpoint` as the trainers take it (TrainingArguments types it as a string).

    Returns:
        "latest" for true / latest (the trainers resume from the latest complete checkpoint of `output_dir`), None
        for false / none / empty, else the checkpoint folder.

    Raises:
        FileNotFoundError: a path that is not a folder.
    """
    if value is None or value is False:
        return None
    text = "true" if value is True else str(value).strip()
    if text.lower() in ("true", "latest"):
        return "latest"
    if text.lower() in ("false", "none", ""):
        return None
    if not os.path.isdir(text):
        raise FileNotFoundError(f"--resume_from_checkpoint {text}: no such checkpoint folder (give a checkpoint-N "
                                "folder, or true / latest for the latest complete checkpoint of output_dir)")
    return text


def train_run(trainer, resume_from_checkpoint) -> dict:
    """`trainer.train(resume_from_checkpoint=...)`'s metrics, with `train_loss` over the whole run when resumed.

    The Trainer averages `train_loss` over the steps of this `train()` call only; a resumed run adds the steps
    before the checkpoint from the checkpoint's logged losses (each log covers the steps since the previous one),
    so the figure reads as the uninterrupted run's (exactly when the checkpoint step is a logging step).

    Args:
        trainer: an hf_rlhf trainer (`resolve_resume_checkpoint`).
        resume_from_checkpoint: `resume_argument`'s value.
    """
    from transformers.trainer_callback import TrainerState

    checkpoint = trainer.resolve_resume_checkpoint(resume_from_checkpoint)
    metrics = dict(trainer.train(resume_from_checkpoint=checkpoint).metrics)
    if checkpoint is None or "train_loss" not in metrics:
        return metrics
    start = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json")).global_step
    previous, before = 0, 0.0
    for h in trainer.state.log_history:
        if "loss" in h and previous < h["step"] <= start:
            before += h["loss"] * (h["step"] - previous)
            previous = h["step"]
    resumed = trainer.state.global_step - start
    metrics["train_loss"] = (before + metrics["train_loss"] * resumed) / max(previous + resumed, 1)
    return metrics
