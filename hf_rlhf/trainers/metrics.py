"""`MetricAccumulator`: the trainers' logged metrics, summed on the device between two logs.

Each metric is a pair (sum, weight) kept as a device tensor, so a micro-batch adds to it without a host sync; at a
log the pairs of every rank are summed in one collective and the logged value is sum / weight. A token mean is
(Σ value·tokens, Σ tokens); a mean over calls is (Σ value, number of calls); a plain total reads the sum.
"""

from __future__ import annotations

import torch


class MetricAccumulator:
    """Weighted sums of named metrics, reduced over ranks once per log.

    Every rank must add the same names between two logs (they run the same steps), since the reduction is a
    collective over the stacked pairs in name order.

    >>> metrics = MetricAccumulator()
    >>> metrics.add("accuracy", torch.tensor(3.0), torch.tensor(4.0))
    >>> metrics.add("accuracy", torch.tensor(1.0), torch.tensor(4.0))
    >>> metrics.means()
    {'accuracy': 0.5}
    """

    def __init__(self):
        self._pairs: dict[str, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def add(self, name: str, value_sum, weight=1.0) -> None:
        """Add `value_sum` (a 0-dim tensor or a number) with `weight` to the metric `name`; nothing leaves the device."""
        value_sum = torch.as_tensor(value_sum)
        pair = torch.stack([value_sum.detach().double().reshape(()),
                            torch.as_tensor(weight, device=value_sum.device).detach().double().reshape(())])
        self._pairs[name] = self._pairs[name] + pair if name in self._pairs else pair

    def totals(self, accelerator=None) -> dict[str, tuple[float, float]]:
        """{name: (sum, weight)} summed over ranks (when `accelerator` is given), then cleared."""
        if not self._pairs:
            return {}
        names = sorted(self._pairs)
        device = accelerator.device if accelerator is not None else self._pairs[names[0]].device
        stacked = torch.stack([self._pairs[name].to(device) for name in names])
        if accelerator is not None and accelerator.num_processes > 1:
            stacked = accelerator.reduce(stacked, reduction="sum")
        self._pairs = {}
        return {name: (float(s), float(w)) for name, (s, w) in zip(names, stacked.tolist())}

    def means(self, accelerator=None) -> dict[str, float]:
        """{name: sum / weight} over ranks for every metric with a positive weight, then cleared."""
        return {name: s / w for name, (s, w) in self.totals(accelerator).items() if w > 0}
