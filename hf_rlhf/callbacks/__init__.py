"""Small `TrainerCallback`s that users switch on and off; each reacts to Trainer events and acts only through the
logs and `TrainerControl`, never through trainer internals.

    PlotCallback             a PNG of chosen logged curves, written into `output_dir` when training ends (`plot` extra)
    SampleCompletionsCallback  greedy completions of a few fixed prompts, printed and appended to a JSONL file
    NonFiniteStopCallback    stop training when the loss / grad norm / KL logged becomes NaN or inf

Importing this package needs only transformers; matplotlib is imported when a plot is drawn.
"""

from .nonfinite_stop import NonFiniteStopCallback
from .plot import PlotCallback, plot_log_history
from .sample_completions import SampleCompletionsCallback

__all__ = ["NonFiniteStopCallback", "PlotCallback", "SampleCompletionsCallback", "plot_log_history"]
