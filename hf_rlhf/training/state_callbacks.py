"""PPO state that must survive a checkpoint, kept in stateful callbacks, and the logged-epoch fix.

The Trainer writes every `ExportableState` callback's `state()` into `trainer_state.json` at each save, but restores
it only when `restore_callback_states_from_checkpoint=True`, and then as a NEW instance that replaces the old one
in the callback handler. So:
  - each callback restores itself in `on_train_begin` from `state.stateful_callbacks` (idempotent: on a fresh run
    that entry is its own current state), whatever the flag says;
  - the trainer never keeps a reference to one of these callbacks; it looks it up in the handler each time
    (`find_callback`).
"""

from __future__ import annotations

import math

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..rl.kl import AdaptiveKLController, FixedKLController
from ..rl.running_moments import RunningMoments


def find_callback(callback_handler, callback_type):
    """The callback of `callback_type` in a `CallbackHandler`, or None."""
    return next((cb for cb in callback_handler.callbacks if isinstance(cb, callback_type)), None)


class _SelfRestoringState(ExportableState):
    """Restore `attributes` from the checkpoint's `stateful_callbacks` entry when training begins."""

    def on_train_begin(self, args, state, control, **kwargs):
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(stored, list):  # several callbacks of one type: the Trainer stores a list
            stored = stored[0] if stored else None
        for attribute, value in (stored or {}).get("attributes", {}).items():
            setattr(self, attribute, value)


class KLControllerCallback(_SelfRestoringState, TrainerCallback):
    """Holds the KL controller: fixed β, or adaptive towards `kl_target` (Ziegler et al. 2019).

    Args:
        kl_coef: β, the initial value when adaptive.
        kl_target: None for a fixed β; else the target KL per sequence.
        kl_horizon: horizon of the adaptive controller.
    """

    def __init__(self, kl_coef: float = 0.05, kl_target: float | None = None, kl_horizon: float = 10000):
        self.kl_coef, self.kl_target, self.kl_horizon = kl_coef, kl_target, kl_horizon
        if kl_target is None:
            self.controller = FixedKLController(kl_coef)
        else:
            self.controller = AdaptiveKLController(kl_coef, kl_target, kl_horizon)

    @property
    def controller_state(self) -> dict:
        return self.controller.state_dict()

    @controller_state.setter
    def controller_state(self, value: dict) -> None:
        self.controller.load_state_dict(value)

    def state(self) -> dict:
        return {"args": {"kl_coef": self.kl_coef, "kl_target": self.kl_target, "kl_horizon": self.kl_horizon},
                "attributes": {"controller_state": self.controller_state}}


class RewardStatsCallback(_SelfRestoringState, TrainerCallback):
    """Holds the running mean / variance of the scores for `reward_normalization="running"`."""

    def __init__(self):
        self.moments = RunningMoments()

    @property
    def moments_state(self) -> dict:
        return self.moments.state_dict()

    @moments_state.setter
    def moments_state(self, value: dict) -> None:
        self.moments.load_state_dict(value)

    def state(self) -> dict:
        return {"args": {}, "attributes": {"moments_state": self.moments_state}}


class EpochFromStepCallback(TrainerCallback):
    """Set `state.epoch` from `global_step` after each optimizer step.

    After a resume the Trainer restarts its in-epoch micro-batch counter at 0, so the epoch it computes (and logs)
    is too small; `global_step / optimizer steps per epoch` is what an uninterrupted run logs.
    """

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        if train_dataloader is None:
            return
        steps_per_epoch = max(math.ceil(len(train_dataloader) / args.gradient_accumulation_steps), 1)
        state.epoch = state.global_step / steps_per_epoch


class AdaptiveEntropyCallback(_SelfRestoringState, TrainerCallback):
    """Holds TRL's adaptive entropy coefficient (`use_adaptive_entropy`): `coef`, and `last`, the token-mean entropy
    of the last optimizer step (inf before the first), so that a resumed run applies the same bonus."""

    def __init__(self, coef: float = 0.0):
        self.coef, self.last, self.window = coef, math.inf, None

    def state(self) -> dict:
        return {"args": {"coef": self.coef}, "attributes": {"coef": self.coef, "last": self.last}}
