"""SIGTERM (what a scheduler sends before SIGKILL): a checkpoint at the next optimizer-step boundary, then a clean stop.

The signal handler only sets a flag; nothing is saved from inside it (a handler runs between two bytecodes of
whatever the main thread was doing, inside a save or a collective). `SaveOnSigtermCallback.on_step_end` reads the
flag after every optimizer step and, once it is set, asks the Trainer to save (`control.should_save`, the Trainer's
own atomic save: `checkpoints.AtomicCheckpointMixin`) and to stop (`control.should_training_stop`). The checkpoint is
taken where a regular one would be, so a run resumed from it with `resume_from_checkpoint="latest"` continues
exactly as if it had never stopped. The time from the signal to the stop is at most the rest of the current
optimizer step (with PPO / GRPO, a rollout when one is due) plus one save.

On several processes the ranks agree on the step to stop at: the flag is all-reduced (max) at every step end, so a
rank that got the signal later, or not at all, still saves and stops with the others.

Why not transformers' own `enable_jit_checkpoint`: it saves from `on_pre_optimizer_step` (in the middle of a
step, after the backward, so the saved RNG state is not that of a step boundary and a resume is not exact), waits
a fixed 3 s on a timer thread first, and its ranks do not agree on a step. When a user turns it on, this callback
stands aside.

`PreemptionMixin` attaches the callback to every hf_rlhf trainer; `trainer.remove_callback(SaveOnSigtermCallback)`
switches it off. After such a stop `trainer.preempted` is `{"step", "signal", "checkpoint"}` and the metrics of
`train()` hold `preempted_step`; the recipes then write results.json saying so and exit 0 (`cli.results`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger("hf_rlhf")


def _agreed(flag: bool) -> bool:
    """`flag` or-ed over the ranks (one all-reduce when several processes run; `flag` itself otherwise)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    from accelerate import PartialState

    value = torch.tensor([1.0 if flag else 0.0], device=PartialState().device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class SaveOnSigtermCallback(TrainerCallback):
    """On SIGTERM: save a checkpoint at the next optimizer-step boundary and stop training (see module docstring).

    The handler is installed when training begins (from the main thread only: Python delivers signals there) and the
    previous one is put back when training ends. After a stop, `stopped` is `{"step", "signal", "signal_time"}`.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        self.requested: int | None = None  # the signal number received, set by the handler
        self.requested_at: float | None = None
        self.stopped: dict | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):  # only a flag and a clock read: no I/O, no locks
        if self.requested is None:
            self.requested, self.requested_at = signum, time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self.requested = self.requested_at = self.stopped = None
        if getattr(args, "enable_jit_checkpoint", False):
            logger.info("[hf_rlhf] enable_jit_checkpoint is on: transformers' SIGTERM checkpoint is used, not "
                        "SaveOnSigtermCallback's")
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("[hf_rlhf] train() runs outside the main thread: no SIGTERM checkpoint (Python delivers "
                           "signals to the main thread only)")
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        if not _agreed(self.requested is not None):
            return
        control.should_save = True
        control.should_training_stop = True
        name = signal.Signals(self.requested).name if self.requested is not None else "a signal on another rank"
        self.stopped = {"step": state.global_step, "signal": name, "signal_time": self.requested_at}

    def on_train_end(self, args, state, control, **kwargs):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


class PreemptionMixin:
    """For `transformers.Trainer` subclasses (before `Trainer` in the bases): a `SaveOnSigtermCallback` attached
    unless the caller passed one; after a stop, `preempted` and `metrics["preempted_step"]`."""

    def __init__(self, *args, callbacks=None, **kwargs):
        callbacks = list(callbacks or [])
        if not any(isinstance(cb, SaveOnSigtermCallback) or cb is SaveOnSigtermCallback for cb in callbacks):
            callbacks.append(SaveOnSigtermCallback())
        super().__init__(*args, callbacks=callbacks, **kwargs)
        self.preempted: dict | None = None

    def train(self, *args, **kwargs):
        self.preempted = None
        output = super().train(*args, **kwargs)
        callback = next((cb for cb in self.callback_handler.callbacks if isinstance(cb, SaveOnSigtermCallback)),
                        None)
        if callback is not None and callback.stopped is not None:
            stop = callback.stopped
            folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{stop['step']}")
            waited = None if stop["signal_time"] is None else round(time.monotonic() - stop["signal_time"], 2)
            self.preempted = {"step": stop["step"], "signal": stop["signal"],
                              "checkpoint": folder if os.path.isdir(folder) else None, "seconds_after_signal": waited}
            output.metrics["preempted_step"] = stop["step"]
            logger.warning("[hf_rlhf] %s received: stopped at step %d, checkpoint %s (%s s after the signal)",
                           stop["signal"], stop["step"], self.preempted["checkpoint"], waited)
        return output
