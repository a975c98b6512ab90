"""Running mean and variance of the reward scores, for `reward_normalization="running"` (torch only)."""

from __future__ import annotations

import math

import torch


class RunningMoments:
    """Mean and variance of every score seen so far, merged batch by batch (Chan et al. 1979's parallel update).

    Args:
        mean, var, count: the state (var is the population variance of the `count` scores seen).
    """

    def __init__(self, mean: float = 0.0, var: float = 1.0, count: int = 0):
        self.mean, self.var, self.count = float(mean), float(var), int(count)

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values: torch.Tensor) -> None:
        """Merge a batch of scores, any shape, into the running moments."""
        values = values.detach().double().reshape(-1)
        n = values.numel()
        if n == 0:
            return
        batch_mean, batch_var = values.mean().item(), values.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var, self.count = m2 / total, total

    def normalize(self, values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """(values - mean) / (std + eps), any shape."""
        return (values - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])
