"""Non-finite safety for every trainer: a NaN / inf loss, gradient norm (or a value a trainer adds, e.g. PPO's KL
and reward scores) is caught before the optimizer step applies it.

`nonfinite_policy` (an option of every config) says what happens then:
  - `"stop"` (default): the step's gradients are dropped, training stops, and nothing is saved from that step on
    (no checkpoint at that step or later, and `save_model()` raises `NonFiniteError`), so the newest checkpoint is
    the last good state; the message names the step, the value and that checkpoint.
  - `"skip"`: the step's gradients are dropped (the parameters and the optimizer state stay as they were; the
    learning-rate schedule moves on) and training continues; `nonfinite_skipped` in the logs counts the steps
    skipped since the previous log.

Where: the Trainer computes the gradient norm of every optimizer step (`_get_grad_norm`, also with
`max_grad_norm=0`) just before `on_pre_optimizer_step` and `optimizer.step()`; the check runs there, with one
device sync per optimizer step (the norm is read anyway) and, on several processes, one all-reduce of the flags so
that every rank takes the same decision. Dropping a step sets the gradients to None, which torch optimizers skip.
With fp16 loss scaling an inf gradient norm is the grad scaler's business (it skips the step), so the norm is not
watched then; under DeepSpeed the engine owns the step, so "skip" is not supported there (use "stop").
"""

from __future__ import annotations

import logging

import torch

from ..callbacks.nonfinite_stop import NonFiniteStopCallback
from .checkpoints import latest_complete_checkpoint

logger = logging.getLogger("hf_rlhf")

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """Saving (or going on) after training was stopped by a non-finite value."""


class NonFiniteGuardMixin:
    """For `transformers.Trainer` subclasses (before `Trainer` in the bases): the check described in the module
    docstring, and a `NonFiniteStopCallback` attached unless the caller passed one.

    A subclass adds values to watch by overriding `_nonfinite_watch(inputs) -> {name: value}` (per micro-batch).
    After a stop, `nonfinite_stop` is `{"step", "metric", "value", "last_good_checkpoint", "message"}`.
    """

    def __init__(self, *args, callbacks=None, **kwargs):
        callbacks = list(callbacks or [])
        if not any(isinstance(cb, NonFiniteStopCallback) or cb is NonFiniteStopCallback for cb in callbacks):
            callbacks.append(NonFiniteStopCallback())
        super().__init__(*args, callbacks=callbacks, **kwargs)
        self._nonfinite_policy = policy = getattr(self.args, "nonfinite_policy", "stop")
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_policy must be one of {NONFINITE_POLICIES}, got {policy!r}")
        if policy == "skip" and self.is_deepspeed_enabled:
            raise ValueError("nonfinite_policy='skip' is not supported under DeepSpeed (the engine owns the "
                             "optimizer step); use 'stop'")
        self.nonfinite_stop: dict | None = None
        self._nonfinite_values: dict[str, list[torch.Tensor]] = {}
        self._nonfinite_skipped = 0

    def _nonfinite_watch(self, inputs) -> dict:
        """Values of this micro-batch to check besides the loss (name -> number or tensor)."""
        return {}

    # -- detection ---------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        watched = self._nonfinite_watch(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        for name, value in {"loss": loss, **watched}.items():
            # tensors stay where they are (no sync here); numbers as float64 on the CPU (no float32 overflow)
            value = value.detach().float() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float64)
            self._nonfinite_values.setdefault(name, []).append(value.reshape(-1))
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        # called once per optimizer step, after clipping and right before `optimizer.step()`
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self._guard_optimizer_step(grad_norm)
        return grad_norm

    def _guard_optimizer_step(self, grad_norm) -> None:
        values = {name: torch.cat(parts) for name, parts in self._nonfinite_values.items()}
        self._nonfinite_values = {}
        if grad_norm is not None and not self.args.fp16:  # fp16: the grad scaler skips inf steps itself
            values["grad_norm"] = (grad_norm.detach().float() if torch.is_tensor(grad_norm)
                                   else torch.tensor(grad_norm, dtype=torch.float64)).reshape(-1)
        if not values:
            return
        names = sorted(values)
        device = self.accelerator.device
        flags = torch.stack([(~torch.isfinite(values[n])).any().to(device, torch.float32) for n in names])
        if self.accelerator.num_processes > 1:  # every rank takes the same decision
            flags = self.accelerator.reduce(flags, reduction="sum")
        bad = [name for name, flag in zip(names, flags.tolist()) if flag > 0]
        if not bad:
            return
        local = values.get(bad[0])
        nonfinite = local[~torch.isfinite(local)] if local is not None else local
        value = nonfinite[0].item() if nonfinite is not None and len(nonfinite) else float("nan")
        step = self.state.global_step + 1
        self.optimizer.zero_grad(set_to_none=True)  # torch optimizers skip parameters without gradients
        if self._nonfinite_policy == "skip":
            self._nonfinite_skipped += 1
            logger.warning("[hf_rlhf] step %d: %s = %s is not finite; that optimizer step was skipped "
                           "(nonfinite_policy='skip')", step, bad[0], value)
            return
        last_good = latest_complete_checkpoint(self.args.output_dir, self.args.save_only_model)
        message = (f"training stopped at step {step}: {bad[0]} = {value} is not finite (nonfinite_policy='stop'). "
                   f"The update of step {step} was not applied and nothing is saved from step {step} on; the last "
                   "good checkpoint is " + (last_good if last_good else "none (no checkpoint was written before)"))
        self.nonfinite_stop = {"step": step, "metric": bad[0], "value": value, "last_good_checkpoint": last_good,
                               "message": message}
        self.control.should_training_stop = True
        logger.error("[hf_rlhf] %s", message)

    # -- what follows a stop ------------------------------------------------------------------------
    def _nonfinite_record(self) -> dict | None:
        """The guard's stop, else a `NonFiniteStopCallback`'s (it reads the logs, after the step)."""
        if self.nonfinite_stop is not None:
            return self.nonfinite_stop
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, NonFiniteStopCallback) and cb.stopped is not None:
                stopped = dict(cb.stopped)
                stopped.setdefault("message", f"training stopped at step {stopped['step']}: {stopped['metric']} = "
                                              f"{stopped['value']} was logged (NonFiniteStopCallback)")
                return stopped
        return None

    def _save_checkpoint(self, model, trial):
        stopped = self._nonfinite_record()
        if stopped is not None:
            logger.warning("[hf_rlhf] not writing the checkpoint of step %d: %s", self.state.global_step,
                           stopped["message"])
            return
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        stopped = self._nonfinite_record()
        if stopped is not None:
            raise NonFiniteError(f"not saving the model: {stopped['message']}")
        return super().save_model(output_dir, _internal_call)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self._nonfinite_skipped and "loss" in logs:
            logs["nonfinite_skipped"] = self._nonfinite_skipped
            self._nonfinite_skipped = 0
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        self.nonfinite_stop = None
        output = super().train(*args, **kwargs)
        stopped = self._nonfinite_record()
        if stopped is not None:
            output.metrics["nonfinite_stop_step"] = stopped["step"]
            logger.error("[hf_rlhf] %s", stopped["message"])
        return output
