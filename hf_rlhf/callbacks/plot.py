"""`PlotCallback`: a PNG of chosen logged curves (one panel each, against the optimizer step), written into
`output_dir` when training ends, next to the model and `results.json`.

matplotlib (the `plot` extra) is imported when the callback is created, so a missing extra fails before training
rather than after it; `import hf_rlhf.callbacks` itself never imports it. The figure is drawn with the Agg canvas
directly (no pyplot): no display, no global figure state.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

from transformers import TrainerCallback

logger = logging.getLogger("hf_rlhf")


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'hf-rlhf[plot]'") from err


def curve(log_history: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of every finite logged value of `metric` in a Trainer's `log_history`."""
    steps, values = [], []
    for entry in log_history:
        value = entry.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(entry.get("step", len(steps))))
            values.append(float(value))
    return steps, values


def plot_log_history(log_history: list[dict], metrics: Sequence[str], path: str, titles: dict | None = None,
                     bands: dict | None = None, title: str | None = None) -> str | None:
    """Draw `metrics` from `log_history` as stacked panels sharing the step axis and save a PNG.

    Args:
        log_history: `TrainerState.log_history` (a list of logged dicts with a `step`).
        metrics: logged names, one panel each, top to bottom.
        path: where the PNG goes (its directory is created).
        titles: {metric: panel label}; default the metric name.
        bands: {metric: (low, high)}: a shaded horizontal band (e.g. a KL target ± 25 %).
        title: the figure title.

    Returns:
        `path`, or None when none of the metrics was ever logged (nothing is written).
    """
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = {metric: curve(log_history, metric) for metric in metrics}
    if not any(steps for steps, _ in curves.values()):
        return None
    titles, bands = titles or {}, bands or {}
    figure = Figure(figsize=(7, 2.3 * len(metrics) + 0.4), constrained_layout=True)
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric in zip(axes, metrics):
        steps, values = curves[metric]
        if metric in bands:
            low, high = bands[metric]
            ax.axhspan(low, high, color="tab:green", alpha=0.15, label=f"[{low:.3g}, {high:.3g}]")
            ax.legend(loc="best", fontsize="small")
        if steps:
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, f"{metric} was not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(titles.get(metric, metric), fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    if title:
        figure.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


class PlotCallback(TrainerCallback):
    """At the end of training, plot logged metrics into `<output_dir>/<filename>` (main process only).

    Args:
        metrics: logged names to plot, one panel each (e.g. `("objective/scores", "objective/kl",
            "objective/kl_coef")` for PPO, `("loss",)` for SFT).
        filename: the PNG's name inside `args.output_dir`.
        titles, bands: as in `plot_log_history`.

    After training, `path` is where the PNG went (None if nothing was plotted).

    Example:
        >>> trainer = PPOTrainer(..., callbacks=[PlotCallback(["objective/scores", "objective/kl"])])
    """

    def __init__(self, metrics: Sequence[str], filename: str = "curves.png", titles: dict | None = None,
                 bands: dict | None = None):
        _require_matplotlib()
        if not metrics:
            raise ValueError("PlotCallback needs at least one metric name")
        self.metrics, self.filename = list(metrics), filename
        self.titles, self.bands = titles, bands
        self.path: str | None = None

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, self.filename)
        self.path = plot_log_history(state.log_history, self.metrics, path, self.titles, self.bands)
        if self.path is None:
            logger.warning("PlotCallback: none of %s was logged; no plot written", self.metrics)
