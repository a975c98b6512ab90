"""`MetricAccumulator`: the trainers' logged metrics, kept on the device between two logs.

A weighted metric is a pair (sum, weight) kept as a device tensor, so a micro-batch adds to it without a host sync;
at a log the pairs of every rank are summed in one collective and the logged value is sum / weight. A token mean is
(Σ value·tokens, Σ tokens); a mean over calls is (Σ value, number of calls); a plain total reads the sum.

An extreme metric (`add_min`, `add_max`) keeps the smallest / largest value seen since the last log; at a log the
ranks' values are gathered in one collective and reduced as a min / max (a max is kept negated, so one min over
the gathered rows reduces both kinds).
"""

from __future__ import annotations

import torch


class MetricAccumulator:
    """Weighted sums and extremes of named metrics, reduced over ranks once per log.

    Every rank must add the same names between two logs (they run the same steps), since the reduction is a
    collective over the stacked values in name order.

    >>> metrics = MetricAccumulator()
    >>> metrics.add("accuracy", torch.tensor(3.0), torch.tensor(4.0))
    >>> metrics.add("accuracy", torch.tensor(1.0), torch.tensor(4.0))
    >>> metrics.add_max("max_reward", torch.tensor([0.5, 2.0]))
    >>> metrics.add_max("max_reward", torch.tensor(1.0))
    >>> metrics.means()
    {'accuracy': 0.5, 'max_reward': 2.0}
    """

    def __init__(self):
        self._pairs: dict[str, torch.Tensor] = {}
        self._mins: dict[str, torch.Tensor] = {}  # name -> 0-dim min (a max metric: its negated max)
        self._is_max: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self._pairs) or bool(self._mins)

    def add(self, name: str, value_sum, weight=1.0) -> None:
        """Add `value_sum` (a 0-dim tensor or a number) with `weight` to the metric `name`; nothing leaves the
        device."""
        value_sum = torch.as_tensor(value_sum)
        pair = torch.stack([value_sum.detach().double().reshape(()),
                            torch.as_tensor(weight, device=value_sum.device).detach().double().reshape(())])
        self._pairs[name] = self._pairs[name] + pair if name in self._pairs else pair

    def add_min(self, name: str, values) -> None:
        """Keep the smallest of `values` (a tensor of any shape, or a number) in the metric `name`."""
        self._add_extreme(name, values, is_max=False)

    def add_max(self, name: str, values) -> None:
        """Keep the largest of `values` (a tensor of any shape, or a number) in the metric `name`."""
        self._add_extreme(name, values, is_max=True)

    def _add_extreme(self, name: str, values, is_max: bool) -> None:
        if self._is_max.setdefault(name, is_max) != is_max or name in self._pairs:
            raise ValueError(f"metric {name!r} is already accumulated as another kind")
        values = torch.as_tensor(values).detach().double()
        if values.numel() == 0:
            return
        low = -values.max() if is_max else values.min()
        self._mins[name] = torch.minimum(self._mins[name], low) if name in self._mins else low

    def clear(self) -> None:
        """Forget everything added since the last log (no collective)."""
        self._pairs, self._mins = {}, {}

    def totals(self, accelerator=None) -> dict[str, tuple[float, float]]:
        """{name: (sum, weight)} summed over ranks (when `accelerator` is given), then cleared.

        An extreme metric reads (its min / max over ranks, 1.0), so sum / weight is the value itself.
        """
        out = {}
        distributed = accelerator is not None and accelerator.num_processes > 1
        if self._pairs:
            names = sorted(self._pairs)
            device = accelerator.device if accelerator is not None else self._pairs[names[0]].device
            stacked = torch.stack([self._pairs[name].to(device) for name in names])
            if distributed:
                stacked = accelerator.reduce(stacked, reduction="sum")
            out.update({name: (float(s), float(w)) for name, (s, w) in zip(names, stacked.tolist())})
        if self._mins:
            names = sorted(self._mins)
            device = accelerator.device if accelerator is not None else self._mins[names[0]].device
            lows = torch.stack([self._mins[name].to(device) for name in names])
            if distributed:  # (P·K,) gathered in rank order -> (P, K) -> min over ranks
                lows = accelerator.gather(lows).reshape(-1, len(names)).min(dim=0).values
            out.update({name: (-low if self._is_max[name] else low, 1.0) for name, low in zip(names, lows.tolist())})
        self.clear()
        return out

    def means(self, accelerator=None) -> dict[str, float]:
        """{name: sum / weight} over ranks for every metric with a positive weight, then cleared."""
        return {name: s / w for name, (s, w) in self.totals(accelerator).items() if w > 0}


def real_token_count(inputs: dict) -> torch.Tensor:
    """The real (non-pad) input tokens of a collated batch, as TRL 1.16 counts its `num_tokens`.

    Args:
        inputs: a batch with a (B, T) `attention_mask` (its sum), or padding-free `position_ids` (1, N) (every
            token is real: N), or else only `input_ids` (all of them).

    Returns:
        A 0-dim tensor on the batch's device.
    """
    mask = inputs.get("attention_mask")
    if mask is not None and mask.ndim == 2:
        return mask.sum()
    ids = inputs["position_ids"] if "position_ids" in inputs else inputs["input_ids"]
    return torch.tensor(ids.numel(), device=ids.device)
