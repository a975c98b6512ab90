"""TRL's `step_time` metric for the trainers built on PPO's loop (`GRPOTrainer`, `RLOOTrainer`,
`DistillationTrainer`): the wall seconds of one optimizer step, from fetching its micro-batches (the rollout that
feeds them included) to the end of its last micro-batch's `training_step`."""

from __future__ import annotations

import time


class StepTimeMixin:
    """Adds `step_time` to `self.metrics["train"]` once per optimizer step; put it before the trainer class."""

    _step_started: float | None = None
    _micro_left: int = 0

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self._step_started = time.perf_counter()
        batches, tokens = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._micro_left = len(batches)
        return batches, tokens

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self._micro_left -= 1
        if self._micro_left == 0 and self._step_started is not None:
            self.metrics["train"].add("step_time", time.perf_counter() - self._step_started)
        return loss
