"""`NonFiniteStopCallback`: stop training as soon as a watched logged value (the loss, the gradient norm, PPO's
`objective/kl`) is NaN or inf, with one clear log line, instead of training on (or crashing later, e.g. when a NaN
policy samples its next rollout); no checkpoint is written at the step it stops at, nor at the end of that epoch.

It sees what is logged, so it acts at logging steps, after the optimizer step: it is the safety net for any
`transformers.Trainer`. hf_rlhf's trainers attach it by default and also check the loss and gradient norm *before*
each optimizer step (`hf_rlhf.training.nonfinite`, option `nonfinite_policy`); under `nonfinite_policy="skip"` those
steps are dropped there, so this callback only warns. Two Trainer details hide a non-finite loss from the logs:
  - `logging_nan_inf_filter=True` (the Trainer's default; hf_rlhf's configs default to False) replaces a NaN/inf
    step loss by the mean of the others, so `loss` stays finite (0 at the first step of a logging window); the
    `grad_norm` of that step is still NaN;
  - the KL of a rollout is logged at the next logging step (it is a rollout statistic).
With fp16 loss scaling an inf gradient norm is normal (the scaler skips the step), so `grad_norm` is not watched
then.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from transformers import TrainerCallback

logger = logging.getLogger("hf_rlhf")

DEFAULT_METRICS = ("loss", "grad_norm", "objective/kl")


class NonFiniteStopCallback(TrainerCallback):
    """Set `control.should_training_stop` when a watched metric is logged as NaN or ±inf.

    Args:
        metrics: logged names to watch.

    After a stop, `stopped` is `{"step", "metric", "value"}` (None while training is healthy).
    """

    def __init__(self, metrics: Sequence[str] = DEFAULT_METRICS):
        self.metrics = tuple(metrics)
        self.stopped: dict | None = None

    def _watched(self, args) -> tuple[str, ...]:
        if getattr(args, "fp16", False):  # the grad scaler skips inf-gradient steps by design
            return tuple(m for m in self.metrics if m != "grad_norm")
        return self.metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        skip = getattr(args, "nonfinite_policy", "stop") == "skip"
        for metric in self._watched(args):
            value = (logs or {}).get(metric)
            if value is None or isinstance(value, (str, bool)):
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            if not math.isfinite(value) and skip:
                logger.warning("[hf_rlhf] step %d: %s = %s logged; the non-finite optimizer steps were skipped "
                               "(nonfinite_policy='skip')", state.global_step, metric, value)
                break
            if not math.isfinite(value):
                self.stopped = {"step": state.global_step, "metric": metric, "value": value}
                control.should_training_stop = True
                control.should_save = False  # the save of this step comes after the log: it would hold the bad state
                logger.error("[hf_rlhf] stopping training at step %d: %s = %s is not finite (NonFiniteStopCallback); "
                             "the last checkpoint before this step is the last good state", state.global_step,
                             metric, value)
                break
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopped is not None:  # the epoch-end save would write the state after the bad step
            control.should_save = False
        return control
