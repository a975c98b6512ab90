"""What GRPOTrainer adds around TRL's logging and reference options: `CompletionsLog` (`log_completions`: each
rollout's prompts, completions, rewards per function and advantages, as TRL's completions table) and
`SyncPolicyRefCallback` (`sync_ref_model`: trl's TR-DPO callback, pointed at the policy inside PPO's module).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict, deque

from accelerate.utils import gather_object
from trl.trainer.callbacks import SyncRefModelCallback

logger = logging.getLogger("hf_rlhf")
COMPLETIONS_FILE = "completions.jsonl"


class CompletionsLog:
    """TRL's completions table: one row per completion (step, prompt, completion, each reward function's score,
    the advantage, and the columns reward functions add with `log_extra`), written at each logging step to
    `output_dir/completions.jsonl` (appended, main process), printed (`num_completions_to_print` rows; with
    `log_unique_prompts` each prompt once) and sent as a table to wandb when `report_to` has it.

    Args:
        args: a `GRPOConfig`.
    """

    def __init__(self, args):
        self.path = os.path.join(args.output_dir, COMPLETIONS_FILE)
        self.enabled = args.log_completions
        self.to_print, self.unique_prompts = args.num_completions_to_print, args.log_unique_prompts
        self.rows: list[dict] = []
        # TRL's `GRPOTrainer._logs`: the latest generation's columns (its tests read them)
        size = args.generation_batch_size
        self.logs = {"images": deque(maxlen=size), "prompt": deque(maxlen=size), "completion": deque(maxlen=size),
                     "rewards": defaultdict(lambda: deque(maxlen=size)), "advantages": deque(maxlen=size),
                     "extra": defaultdict(lambda: deque(maxlen=size))}
        self.pending: list[dict] = []
        self._extra: dict[str, list] = {}

    def add_rewards(self, prompts: list, completions: list, per_func, names: list[str]) -> None:
        """This rank's rows of one scoring call; `per_func` (K, B), NaN where a function did not score (None)."""
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            rewards = {name: _number(per_func[k, i]) for k, name in enumerate(names)}
            self.pending.append({"prompt": prompt, "completion": completion, "rewards": rewards})

    def add_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra(column, values)` for reward functions: one value per completion of the call."""
        self._extra.setdefault(column, []).extend(values)

    def end_rollout(self, step: int, advantages, accelerator) -> None:
        """Gather the rollout's rows over ranks (every rank calls this) with their (N,) gathered advantages."""
        for column, values in self._extra.items():
            for row, value in zip(self.pending, values):
                row.setdefault("extra", {})[column] = value
        rows = gather_object(self.pending) if accelerator.num_processes > 1 else self.pending
        for row, advantage in zip(rows, advantages.tolist()):
            self.logs["prompt"].append(row["prompt"])
            self.logs["completion"].append(row["completion"])
            for name, value in row["rewards"].items():
                self.logs["rewards"][name].append(value)
            self.logs["advantages"].append(advantage)
            for column, value in row.get("extra", {}).items():
                self.logs["extra"][column].append(value)
            if self.enabled:
                self.rows.append({"step": step, **row, "advantage": advantage})
        self.pending, self._extra = [], {}

    def flush(self, step: int, report_to) -> None:
        """Write, print and report the rows gathered since the last call (main process)."""
        if not self.rows:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            for row in self.rows:
                f.write(json.dumps(row, default=str) + "\n")
        shown, seen = [], set()
        for row in self.rows:
            key = json.dumps(row["prompt"], default=str)
            if self.unique_prompts and key in seen:
                continue
            seen.add(key)
            shown.append(row)
        for row in shown[: self.to_print]:
            logger.info("step %d | prompt %r | completion %r | rewards %s | advantage %.4g", step, row["prompt"],
                        row["completion"], row["rewards"], row["advantage"])
        if "wandb" in (report_to or []):
            import wandb

            if wandb.run is not None:
                columns = ["step", "prompt", "completion", "rewards", "advantage"]
                table = wandb.Table(columns=columns, data=[[str(r[c]) for c in columns] for r in self.rows])
                wandb.log({"completions": table})
        self.rows = []


def _number(value) -> float | None:
    value = float(value)
    return None if value != value else value  # NaN (a function's None) back to None


class SyncPolicyRefCallback(SyncRefModelCallback):
    """trl's `SyncRefModelCallback` (TR-DPO: every `ref_model_sync_steps` optimizer steps the reference becomes
    α·policy + (1 − α)·reference) applied to the policy of PPO's policy + value module."""

    def on_step_end(self, args, state, control, **kwargs):
        model = kwargs["model"]
        if self.accelerator is not None:
            model = self.accelerator.unwrap_model(model)
        kwargs["model"] = getattr(model, "policy", model)
        return super().on_step_end(args, state, control, **kwargs)
