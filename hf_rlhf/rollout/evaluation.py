"""Evaluation of an online trainer (PPO, GRPO, RLOO) on held-out prompts, as TRL 1.16's GRPOTrainer evaluates.

Per batch of `per_device_eval_batch_size` completions (`num_generations_eval` per prompt, a prompt's completions on
one process): generate (sampled at the training temperature, or greedy), decode, score with every reward source.
Then, over every process's completions, TRL's metric names (logged with the `eval_` prefix by the Trainer):
`reward`, `reward_std`, `rewards/{name}/mean|std`, `frac_reward_zero_std`, `completions/*`, `loss` (the policy loss of
these completions at ratio 1, critic-free estimators), and hf_rlhf's `pass@k` (k = 1, 2, 4, ..., n with
`num_generations_eval` = n > 1) and whatever `compute_metrics(prompts, completions, **columns)` returns.

The training run is not disturbed: generation draws from its own seeded stream (`isolated_rng`: the global torch,
CUDA, Python and NumPy states are put back afterwards), and no state of the run is read or written (no reward
statistics, KL controller, prompt loader, experience). A run that evaluates every N steps therefore trains exactly
as the same run without evaluation, and resume is unaffected.
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..trainers.eval_metrics import on_policy_loss, pass_at_k, pass_at_k_values
from ..trainers.grpo_metrics import completion_metrics, reward_metrics


@contextmanager
def isolated_rng(seed: int, device: torch.device):
    """Run the block on its own seeded torch stream; every global RNG state (torch CPU, the CUDA device's, Python's,
    NumPy's) is as it was before once the block ends."""
    devices = [device] if device.type == "cuda" else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def eval_batches(num_rows: int, prompts_per_batch: int, process_index: int, num_processes: int) -> list[list[int]]:
    """This process's batches of dataset rows: rows process_index, process_index + P, ... in batches of
    `prompts_per_batch`. Every process gets the same number of batches (generation may be a collective, e.g. under
    ZeRO-3); a process out of rows gets `[-1]`, a placeholder batch whose completions are generated and dropped.

    >>> eval_batches(5, 2, 1, 2)
    [[1, 3], [-1]]
    """
    rows = list(range(process_index, num_rows, num_processes))
    count = math.ceil(math.ceil(num_rows / num_processes) / prompts_per_batch)
    batches = [rows[i * prompts_per_batch:(i + 1) * prompts_per_batch] for i in range(count)]
    return [batch or [-1] for batch in batches]


def eval_loader(dataset, args, accelerator, num_workers: int = 0) -> DataLoader:
    """This process's batches of prepared prompt rows (`eval_batches`; a placeholder batch reads row 0), each a list
    of row dicts, read by `num_workers` worker processes (0: in this one); no global RNG is drawn from.

    Args:
        dataset: prepared prompt rows (`prepare_prompt_dataset`).
        args: the trainer's config (`per_device_eval_batch_size`, `eval_generations`).
        accelerator: the Trainer's accelerator (this process's rank and the number of processes).
        num_workers: the `DataLoader`'s workers (`dataloader_num_workers`; 0 for a streamed eval set, as TRL).
    """
    per_batch = max(1, args.per_device_eval_batch_size // args.eval_generations)
    batches = eval_batches(len(dataset), per_batch, accelerator.process_index, accelerator.num_processes)
    return DataLoader(dataset, batch_sampler=[[max(i, 0) for i in batch] for batch in batches],
                      num_workers=num_workers, collate_fn=list, generator=torch.Generator())


class PromptEvaluator:
    """Completions of held-out prompts, scored, and the metrics of an evaluation.

    Args:
        args: the trainer's config (`OnlineEvalOptions`, `advantage_estimator`, `scale_rewards`, `loss_type`, ...).
        rollout_maker: the trainer's `RolloutMaker` (its `complete`: the rollout's own generation).
        accelerator: the Trainer's accelerator.
        score: `(prompts, completions, **columns) -> (names, (K, B) scores per reward source, (K,) weights)`.
        compute_metrics: None, or `(prompts, completions, **columns) -> {name: float}` over every evaluated
            completion (all processes), logged with the `eval_` prefix.
    """

    def __init__(self, args, rollout_maker, accelerator, score, compute_metrics=None):
        self.args, self.rollout_maker, self.accelerator = args, rollout_maker, accelerator
        self.score, self.compute_metrics = score, compute_metrics

    def run(self, model, loader: DataLoader, seed: int) -> tuple[dict[str, float], int]:
        """Evaluate `model` (the unwrapped `PolicyAndValue`) on the batches of `loader` (`eval_loader`).

        Returns:
            ({metric name: value} identical on every process, number of completions evaluated).
        """
        args, acc = self.args, self.accelerator
        n = args.eval_generations
        per_batch = max(1, args.per_device_eval_batch_size // n)
        batches = eval_batches(len(loader.dataset), per_batch, acc.process_index, acc.num_processes)
        parts = []
        with isolated_rng(seed + acc.process_index, acc.device):
            for indices, batch in zip(batches, loader):
                rows = [row for row in batch for _ in range(n)]
                parts.append(self._batch(model, rows, keep=indices != [-1]))
        parts = [part for part in parts if part is not None]
        gathered = _gather(parts, acc)
        return self._metrics(gathered, n), len(gathered["rewards"])

    def _batch(self, model, rows: list[dict], keep: bool) -> dict | None:
        out = self.rollout_maker.complete(model, rows, do_sample=self.args.eval_do_sample)
        names, per_func, weights = self.score(out["prompts"], out["completions"], **out["columns"])
        if not keep:
            return None
        per_func, weights = torch.as_tensor(per_func, dtype=torch.float32).cpu(), torch.as_tensor(weights).float()
        rewards = (weights[:, None] * per_func).sum(0)
        mask = out["response_mask"]
        part = {"names": list(names), "weights": weights.tolist(), "per_func": per_func.T.tolist(),
                "rewards": rewards.tolist(), "lengths": mask.sum(1).tolist(), "stopped": out["stopped"].tolist()}
        if self.args.critic_free:  # the training loss's value on these completions (ratio 1)
            args = self.args
            part["loss"] = on_policy_loss(rewards.to(mask.device), mask, args.advantage_estimator,
                                          args.eval_generations, args.scale_rewards, args.normalize_advantages,
                                          args.loss_type, args.response_length).item()
        if self.compute_metrics is not None:
            part.update(prompts=list(out["prompts"]), completions=list(out["completions"]),
                        columns={k: list(v) for k, v in out["columns"].items()})
        return part

    def _metrics(self, parts: list[dict], n: int) -> dict[str, float]:
        if not parts["rewards"]:
            return {}
        names, weights = parts["names"], torch.tensor(parts["weights"])
        per_func = torch.tensor(parts["per_func"]).T  # (K, N)
        metrics = reward_metrics(per_func, names, weights, n)
        metrics.update(completion_metrics(torch.tensor(parts["lengths"]), torch.tensor(parts["stopped"])))
        if parts["losses"]:
            metrics["loss"] = sum(parts["losses"]) / len(parts["losses"])
        correct = (torch.tensor(parts["rewards"]) >= self.args.eval_pass_threshold).view(-1, n)
        for k in pass_at_k_values(n):
            metrics[f"pass@{k}"] = pass_at_k(correct, k)
        if self.compute_metrics is not None:
            extra = self.compute_metrics(parts["prompts"], parts["completions"], **parts["columns"])
            metrics.update({name: float(value) for name, value in (extra or {}).items()})
        return metrics


def _gather(parts: list[dict], accelerator) -> dict:
    """Every process's batches, joined in process order (each process's prompt groups stay whole)."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        parts = gather_object([parts])
        parts = [part for process in parts for part in process]
    out = {"names": parts[0]["names"] if parts else [], "weights": parts[0]["weights"] if parts else [],
           "losses": [p["loss"] for p in parts if "loss" in p], "prompts": [], "completions": [], "columns": {}}
    for key in ("per_func", "rewards", "lengths", "stopped", "prompts", "completions"):
        out[key] = [value for part in parts for value in part.get(key, [])]
    for part in parts:
        for name, values in part.get("columns", {}).items():
            out["columns"].setdefault(name, []).extend(values)
    return out
